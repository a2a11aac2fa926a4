"""MiniMax's lightning attention (``MiniMaxLightningAttention``): linear attention whose
state decays by a constant per head.

``act(qkv_proj(x))`` gives q, k, v per head; the state ``S`` [head_dim, head_dim] per
head evolves as ``S = exp(-slope_h) S + k^T v`` and ``o = q S`` (no scaling; state
``recurrent``); an RMSNorm over all heads, a sigmoid output gate and ``out_proj``
follow. transformers computes it block by block; it is the same recurrence.
"""

from __future__ import annotations

import torch

from ...ops.linear_recurrence import linear_recurrence
from ...ops.segment_states import LayerStates
from .adapter import MixerAdapter

__all__ = ["LIGHTNING_ADAPTERS"]


def _minimax_forward(m, states: LayerStates, x: torch.Tensor) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: ``MiniMaxLightningAttention.forward``."""
    t, heads, dim = x.shape[0], m.num_attention_heads, m.head_dim
    qkv = m.act_fn(m.qkv_proj(x)).reshape(t, heads, 3 * dim)
    q, k, v = torch.split(qkv, dim, dim=-1)
    decay = -m.slope_rate.reshape(1, heads).float().expand(t, heads)
    o = linear_recurrence(q, k, v, decay, None, states, scale=1.0)
    o = m.norm(o.reshape(t, heads * dim))
    return m.out_proj(torch.sigmoid(m.output_gate(x)) * o)


def _minimax_states(m) -> dict[str, tuple[int, ...]]:
    return {"recurrent": (m.num_attention_heads, m.head_dim, m.head_dim)}


LIGHTNING_ADAPTERS = (
    MixerAdapter(
        "transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention", _minimax_forward,
        _minimax_states,
        ("qkv_proj", "act_fn", "slope_rate", "norm", "output_gate", "out_proj", "num_attention_heads", "head_dim"),
        returns_tuple=True,
    ),
)
