"""LFM2's short convolution (``Lfm2ShortConv``, ``Lfm2MoeShortConv``).

``in_proj`` gives B, C and x; ``B * x`` goes through the causal depthwise convolution
(no activation; state ``conv``: the last ``kernel - 1`` values of ``B * x``), ``C``
gates the result, ``out_proj`` maps it back.
"""

from __future__ import annotations

import torch

from ...ops.segment_states import LayerStates
from ...ops.short_conv import causal_conv1d_segments
from .adapter import MixerAdapter, conv_weights

__all__ = ["SHORT_CONV_ADAPTERS"]


def _lfm2_forward(m, states: LayerStates, x: torch.Tensor) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: ``Lfm2ShortConv.forward``."""
    b, c, xs = m.in_proj(x).chunk(3, dim=-1)
    weight, bias = conv_weights(m, "conv")
    return m.out_proj(c * causal_conv1d_segments(b * xs, weight, bias, states, "conv"))


def _lfm2_states(m) -> dict[str, tuple[int, ...]]:
    weight, _ = conv_weights(m, "conv")
    return {"conv": (weight.shape[1] - 1, weight.shape[0])}


SHORT_CONV_ADAPTERS = tuple(
    MixerAdapter(f"transformers.models.{family}.modeling_{family}", cls, _lfm2_forward, _lfm2_states,
                 ("in_proj", "conv", "out_proj"))
    for family, cls in (("lfm2", "Lfm2ShortConv"), ("lfm2_moe", "Lfm2MoeShortConv"))
)
