"""Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid) and Kimi delta attention (Kimi-Linear).

Both project q, k, v, run them through one causal depthwise convolution and an
activation (state ``conv``: the last ``kernel - 1`` inputs), then the delta rule over
L2-normalized q and k scaled by ``1/sqrt(head_k_dim)`` (state ``recurrent``: [H, K, V]),
then a gated RMSNorm and the output projection. Gated DeltaNet decays each head by
``exp(-exp(A_log) * softplus(a + dt_bias))``; Kimi's forget gate decays each key row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.linear_recurrence import linear_recurrence
from ...ops.segment_states import LayerStates
from ...ops.short_conv import causal_conv1d_segments
from .adapter import MixerAdapter, activation, conv_weights

__all__ = ["DELTA_ADAPTERS"]

_CONVS = ("conv1d", "q_conv1d", "k_conv1d", "v_conv1d")


def _conv(module, states: LayerStates, mixed: torch.Tensor) -> torch.Tensor:
    weight, bias = conv_weights(module, *_CONVS)
    return activation(module)(causal_conv1d_segments(mixed, weight, bias, states, "conv"))


def _qwen3_next_inputs(m, x: torch.Tensor):
    """Qwen3-Next's grouped projection layout, split by the module's own method."""
    query, key, value, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x)[None], m.in_proj_ba(x)[None])
    mixed = torch.cat([t.reshape(t.shape[1], -1) for t in (query, key, value)], dim=-1)
    return mixed, z.squeeze(0), b.squeeze(0), a.squeeze(0)  # views back: a select's backward zero-fills and copies


def _qwen3_5_inputs(m, x: torch.Tensor):
    return m.in_proj_qkv(x), m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)


def _olmo_inputs(m, x: torch.Tensor):
    return torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1), m.g_proj(x), m.b_proj(x), m.a_proj(x)


def _gated_deltanet(inputs, norm: str, out: str):
    def forward(m, states: LayerStates, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: ``Qwen3NextGatedDeltaNet.forward`` and its kin."""
        t = x.shape[0]
        mixed, z, b, a = inputs(m, x)
        mixed = _conv(m, states, mixed)
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k = q.reshape(t, -1, m.head_k_dim), k.reshape(t, -1, m.head_k_dim)
        v = v.reshape(t, -1, m.head_v_dim)
        beta = b.sigmoid()
        if getattr(m, "allow_neg_eigval", False):
            beta = beta * 2.0
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        o = linear_recurrence(q, k, v, g, beta, states, scale=m.head_k_dim**-0.5, qk_l2norm=True)
        o = getattr(m, norm)(o.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return getattr(m, out)(o.reshape(t, -1))

    return forward


def _gdn_states(m) -> dict[str, tuple[int, ...]]:
    weight, _ = conv_weights(m, *_CONVS)
    return {
        "conv": (weight.shape[1] - 1, weight.shape[0]),
        "recurrent": (m.num_v_heads, m.head_k_dim, m.head_v_dim),
    }


def _kimi_forward(m, states: LayerStates, x: torch.Tensor) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: ``KimiLinearDeltaAttention.forward``."""
    t = x.shape[0]
    mixed = _conv(m, states, torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1))
    q, k, v = (y.reshape(t, -1, m.head_dim) for y in torch.split(mixed, [m.qkv_dim] * 3, dim=-1))
    g = m.forget_gate(x[None]).squeeze(0)  # [T, H, K] log decay per key row
    beta = torch.sigmoid(m.b_proj(x))
    o = linear_recurrence(q, k, v, g, beta, states, scale=m.head_dim**-0.5, qk_l2norm=True)
    gate = m.g_b_proj(m.g_a_proj(x)).reshape(t, -1, m.head_dim)
    return m.o_proj(m.o_norm(o, gate).reshape(t, -1))


def _kimi_states(m) -> dict[str, tuple[int, ...]]:
    weight, _ = conv_weights(m, "conv1d")
    return {"conv": (weight.shape[1] - 1, weight.shape[0]), "recurrent": (m.num_heads, m.head_dim, m.head_dim)}


_GDN_READS = ("key_dim", "value_dim", "head_k_dim", "head_v_dim", "num_v_heads", "A_log", "dt_bias", "conv1d|q_conv1d")
_QWEN3_NEXT = _gated_deltanet(_qwen3_next_inputs, "norm", "out_proj")
_QWEN3_5 = _gated_deltanet(_qwen3_5_inputs, "norm", "out_proj")
_QWEN3_5_READS = _GDN_READS + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj")


def _m(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


DELTA_ADAPTERS = (
    MixerAdapter(
        _m("qwen3_next"), "Qwen3NextGatedDeltaNet", _QWEN3_NEXT, _gdn_states,
        _GDN_READS + ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", "norm", "out_proj"),
    ),
    MixerAdapter(_m("qwen3_5"), "Qwen3_5GatedDeltaNet", _QWEN3_5, _gdn_states, _QWEN3_5_READS),
    MixerAdapter(_m("qwen3_5_moe"), "Qwen3_5MoeGatedDeltaNet", _QWEN3_5, _gdn_states, _QWEN3_5_READS),
    MixerAdapter(
        _m("olmo_hybrid"), "OlmoHybridGatedDeltaNet", _gated_deltanet(_olmo_inputs, "o_norm", "o_proj"), _gdn_states,
        _GDN_READS + ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj", "o_norm", "o_proj"),
    ),
    MixerAdapter(
        _m("kimi_linear"), "KimiLinearDeltaAttention", _kimi_forward, _kimi_states,
        ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj",
         "head_dim", "qkv_dim", "num_heads"),
    ),
)
