"""Causal depthwise convolution of packed segments, each continuing its parent's window.

The short convolution of gated DeltaNet, Mamba and LFM2 layers mixes each token with
the ``kernel - 1`` inputs before it on its path: its conv state. In a packed call,
segment ``i``'s first rows read the last inputs of its parent (from the state stack,
from its parent's rows in the same call, or zeros at a root; see
:mod:`dtree.ops.segment_states`), and a segment with children in later calls stores
its final window.

:func:`causal_conv1d_segments` lays out, per segment, its ``kernel - 1`` preceding
inputs followed by its own rows (one gather), runs one valid depthwise ``F.conv1d``
over the whole layout (the conv transformers' torch path runs, float32 inside where the
weights are), and gathers the rows' outputs. :func:`causal_conv1d_reference` is the
naive form it is tested against: each segment on its own, its window concatenated in
front, as transformers runs a cached continuation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..segment_states import LayerStates

__all__ = ["causal_conv1d_segments", "causal_conv1d_reference"]


def causal_conv1d_segments(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: LayerStates, name: str = "conv"
) -> torch.Tensor:
    """Causal depthwise convolution over the packed segments of one call.

    Args:
        x: [T, C] the call's inputs, rows of the segments of ``states.layout``.
        weight: [C, K] the depthwise kernel (``conv1d.weight.squeeze(1)``), tap ``K - 1``
            on the current token.
        bias: [C] or None.
        states: the layer's states; its state ``name`` is the window [K - 1, C].

    Returns:
        [T, C] in ``x.dtype``, before any activation. Initial windows come from the
        stack or the in-call parent; final windows are stored for segments with a push slot.
    """
    width = weight.shape[1] - 1
    channels = x.shape[1]
    if width == 0:
        return (x.to(weight.dtype) * weight[:, 0] + (0 if bias is None else bias)).to(x.dtype)
    layout = states.layout
    window_segments, z_index, out_rows, final_index = layout.conv_tables(width)
    parts = [x]
    if len(window_segments):
        parts.append(states.read(name, window_segments, x.dtype, x.device).reshape(-1, channels))
    parts.append(x.new_zeros(1, channels))
    src = torch.cat(parts)
    dev = x.device
    z = src.index_select(0, layout.device_index(("conv_z", width), lambda: z_index, dev))
    out = F.conv1d(z.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=channels)[0].t()
    y = out.index_select(0, layout.device_index(("conv_out", width), lambda: out_rows, dev)).to(x.dtype)
    pushing = layout.pushing()
    if len(pushing):
        rows = layout.device_index(("conv_final", width), lambda: final_index[pushing].reshape(-1), dev)
        states.push(name, pushing, src.index_select(0, rows).reshape(len(pushing), width, channels))
    return states.tie(y)


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, windows: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The naive form: per segment, ``F.conv1d`` over ``cat(window, x_i)`` (no padding).

    Args:
        x: list of [T_i, C] segment inputs (one path's segments need not be packed).
        windows: per segment its initial window [K - 1, C], or None for zeros.

    Returns:
        (per segment [T_i, C] outputs, per segment [K - 1, C] final windows)."""
    width = weight.shape[1] - 1
    outs, finals = [], []
    for xi, window in zip(x, windows):
        window = xi.new_zeros(width, xi.shape[1]) if window is None else window
        full = torch.cat([window, xi])
        out = F.conv1d(full.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=xi.shape[1])[0].t()
        outs.append(out.to(xi.dtype))
        finals.append(full[-width:] if width else full[:0])
    return outs, finals
