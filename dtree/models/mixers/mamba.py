"""Mamba2 (Nemotron-H, Bamba, Granite-4 hybrid, Falcon-H1) and Mamba (Jamba) mixers.

Mamba2: ``in_proj`` gives the gate, ``xBC`` and ``dt``; ``xBC`` goes through the causal
depthwise convolution and the activation (state ``conv``); then the SSD recurrence per
head, ``S = exp(A dt) S + (x dt) B^T``, ``y = C S + D x`` (state ``recurrent``:
[heads, state_size, head_dim]), with ``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``
and B, C shared by the heads of a group; then the gated RMSNorm (or Falcon-H1's plain
``silu`` gate) and ``out_proj``. Falcon-H1 scales the input by ``ssm_in_multiplier`` and
the projection by its ``mup_vector``.

Mamba (Jamba): ``in_proj`` gives ``x`` and the gate; ``x`` goes through the convolution
(state ``conv``); ``x_proj`` gives dt (rank-reduced), B and C, each RMS-normed; per
channel ``d``, ``s_d = exp(dt_d A_d) s_d + dt_d x_d B`` (a state per channel and state
size: ``recurrent`` [channels, state_size, 1]), ``y = C s + D x``, gated by ``silu``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...ops.linear_recurrence import linear_recurrence
from ...ops.segment_states import LayerStates
from ...ops.short_conv import causal_conv1d_segments
from .adapter import MixerAdapter, activation, conv_weights, plain

__all__ = ["MAMBA_ADAPTERS"]


def _dt_limit(m) -> tuple[float, float]:
    """The clamp of dt: ``time_step_limit``; Nemotron-H before transformers 5.11 clamps at
    ``time_step_min`` only."""
    low, high = getattr(m, "time_step_limit", None) or (0.0, math.inf)
    if type(m).__name__ == "NemotronHMamba2Mixer" and getattr(m, "time_step_min", None) is not None:
        low, high = m.time_step_min, math.inf
    return float(low), float(high)


def _mamba2_forward(m, states: LayerStates, x: torch.Tensor) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: the Mamba2 mixers' torch forward."""
    dtype, t = x.dtype, x.shape[0]
    if getattr(m, "ssm_in_multiplier", None) is not None:
        x = x * m.ssm_in_multiplier
    projected = m.in_proj(x)
    if getattr(m, "mup_vector", None) is not None:
        projected = projected * m.mup_vector.reshape(-1)
    groups_state = m.n_groups * m.ssm_state_size
    d_mlp = (projected.shape[-1] - 2 * m.intermediate_size - 2 * groups_state - m.num_heads) // 2
    _, _, gate, xbc, dt = projected.split([d_mlp, d_mlp, m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    weight, bias = conv_weights(m, "conv1d")
    xbc = activation(m)(causal_conv1d_segments(xbc, weight, bias, states, "conv"))
    xs, b, c = torch.split(xbc, [m.intermediate_size, groups_state, groups_state], dim=-1)
    low, high = _dt_limit(m)
    dt = torch.clamp(F.softplus(dt + m.dt_bias.to(dt.dtype)), low, high).float()
    xs = xs.reshape(t, m.num_heads, m.head_dim).float()
    b, c = (y.reshape(t, m.n_groups, m.ssm_state_size).float() for y in (b, c))
    a = -torch.exp(m.A_log.float())
    y = linear_recurrence(c, b, xs * dt[..., None], a * dt, None, states, scale=1.0)
    y = (y + m.D[:, None] * xs).reshape(1, t, -1)
    if isinstance(getattr(m, "norm", None), torch.nn.Identity) or getattr(m, "mamba_rms_norm", True) is False:
        y = y * F.silu(gate[None])  # Falcon-H1 without its gated norm
    else:
        y = m.norm(y, gate[None])
    return m.out_proj(y.squeeze(0).to(dtype))  # a view back, not a select (its backward zero-fills and copies)


def _mamba2_states(m) -> dict[str, tuple[int, ...]]:
    weight, _ = conv_weights(m, "conv1d")
    return {
        "conv": (weight.shape[1] - 1, weight.shape[0]),
        "recurrent": (m.num_heads, m.ssm_state_size, m.head_dim),
    }


def _jamba_forward(m, states: LayerStates, x: torch.Tensor) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: ``JambaMambaMixer``'s torch forward."""
    dtype, t = x.dtype, x.shape[0]
    xs, gate = m.in_proj(x).chunk(2, dim=-1)
    weight, bias = conv_weights(m, "conv1d")
    xs = activation(m)(causal_conv1d_segments(xs, weight, bias, states, "conv"))
    time_step, b, c = torch.split(m.x_proj(xs), [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
    time_step, b, c = m.dt_layernorm(time_step), m.b_layernorm(b), m.c_layernorm(c)
    dt_proj = plain(m, m.dt_proj, torch.nn.Linear, "dt_proj")  # transformers 5.24 reads its weight directly
    dt = F.linear(time_step, dt_proj.weight)
    dt = F.softplus(dt + dt_proj.bias.float().to(dt.dtype)).float()  # [T, channels]
    a = -torch.exp(m.A_log.float())  # [channels, state_size]
    channels = xs.shape[1]
    q, k = (y.float()[:, None, :].expand(t, channels, m.ssm_state_size) for y in (c, b))
    y = linear_recurrence(q, k, (dt * xs.float())[..., None], dt[..., None] * a, None, states, scale=1.0)
    y = (y[..., 0] + xs * m.D) * F.silu(gate)
    return m.out_proj(y.to(dtype))


def _jamba_states(m) -> dict[str, tuple[int, ...]]:
    weight, _ = conv_weights(m, "conv1d")
    return {"conv": (weight.shape[1] - 1, weight.shape[0]), "recurrent": (weight.shape[0], m.ssm_state_size, 1)}


def _m(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


_MAMBA2_READS = (
    "in_proj", "conv1d", "dt_bias", "A_log", "D", "out_proj", "n_groups", "ssm_state_size", "intermediate_size",
    "conv_dim", "num_heads", "head_dim",
)

MAMBA_ADAPTERS = (
    MixerAdapter(_m("nemotron_h"), "NemotronHMamba2Mixer", _mamba2_forward, _mamba2_states, _MAMBA2_READS + ("norm",)),
    MixerAdapter(_m("bamba"), "BambaMixer", _mamba2_forward, _mamba2_states, _MAMBA2_READS + ("norm",)),
    MixerAdapter(
        _m("granitemoehybrid"), "GraniteMoeHybridMambaLayer", _mamba2_forward, _mamba2_states,
        _MAMBA2_READS + ("norm",),
    ),
    MixerAdapter(
        _m("falcon_h1"), "FalconH1Mixer", _mamba2_forward, _mamba2_states,
        _MAMBA2_READS + ("ssm_in_multiplier", "mup_vector"),
    ),
    MixerAdapter(
        _m("jamba"), "JambaMambaMixer", _jamba_forward, _jamba_states,
        ("in_proj", "conv1d", "x_proj", "dt_proj", "dt_layernorm", "b_layernorm", "c_layernorm", "A_log", "D",
         "out_proj", "time_step_rank", "ssm_state_size"),
    ),
)
