"""The naive stack attention: the ground truth every backend is tested against.

One segment at a time, every key of the segment gathered explicitly, a dense mask,
plain autograd, and the arithmetic in the inputs' dtype (pass float64 copies for an
exact reference, bf16 ones for "PyTorch at the same precision" in the flash-attention
tolerance rule). Nothing here is fast or clever on purpose.

Semantics, for query row ``r`` of segment ``i`` with ``P`` prefix keys (the slots
``layout.prefix_ranges[i]``, root first: they are the whole root-to-segment path, so a
key's index in ``[prefix ; own]`` is its depth in the tree and the query's depth is
``P + r``)::

    s_j  = scale * q . k_j                           for the keys j = 0 .. P + r
    s_j  = softcap * tanh(s_j / softcap)             if softcap (Gemma2)
    s_j -= slope_h * (pos_q - pos_j)                 if alibi_slopes (Bloom, MPT, Falcon)
    key j masked unless pos_q - window < pos_j       if window (HF sliding_window)
    p_j  = exp(s_j) / (exp(sink_h) + sum_j exp(s_j)) if sinks (GPT-OSS), else softmax
    out  = sum_j p_j v_j

with ``h`` the query head. Keys may be wider than values (MLA): q, k ``Dk``, v ``Dv``.

HF conventions: Gemma2 caps after the scale (as here); GPT-OSS's sinks are unscaled
logits (as here); Bloom adds ``slope_h * pos_k`` to the scaled scores, which differs
from the ALiBi term here by a per-row constant (softmax ignores it): pass its slopes
(tests/test_stack_attention.py checks this against transformers' Bloom code). Falcon
adds the same bias *before* scaling by ``1 / sqrt(head_dim)``: pass ``slope * scale``.
HF's sliding window: a query at ``i`` sees keys ``i - window < j <= i`` (as here).
"""

from __future__ import annotations

import torch

from .segment_layout import SegmentLayout

__all__ = ["stack_attention_naive"]


def stack_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stack_k: torch.Tensor,
    stack_v: torch.Tensor,
    layout: SegmentLayout,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of every packed segment over (its prefix slots + its own keys).

    Args:
        q: [T, Hq, Dk] packed queries.
        k: [T, Hkv, Dk], v: [T, Hkv, Dv] the segments' own keys and values.
        stack_k: [S, Hkv, Dk], stack_v: [S, Hkv, Dv] one layer of the KV stack (any
            tensors indexed by slot; make them leaves to get the prefix gradients).
        layout: segment offsets and prefix ranges.
        scale: applied to q . k before everything else.
        softcap, sinks [Hq], alibi_slopes [Hq], window: see the module docstring.

    Returns:
        [T, Hq, Dv] in the inputs' dtype.
    """
    group = q.shape[1] // k.shape[1]
    outs = []
    for i in range(layout.num_segments):
        a, b = int(layout.q_offsets[i]), int(layout.q_offsets[i + 1])
        slots = [j for lo, hi in layout.prefix_ranges[i] for j in range(lo, hi)]
        idx = torch.tensor(slots, dtype=torch.long, device=stack_k.device)
        kk = torch.cat([stack_k[idx], k[a:b]]).repeat_interleave(group, 1)
        vv = torch.cat([stack_v[idx], v[a:b]]).repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b], kk) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        pos_q = len(slots) + torch.arange(b - a, device=q.device)
        pos_k = torch.arange(len(slots) + b - a, device=q.device)
        dist = pos_q[:, None] - pos_k[None, :]  # [Tq, Tk]
        if alibi_slopes is not None:
            s = s - alibi_slopes.to(s.dtype)[:, None, None] * dist.to(s.dtype)
        hidden = dist < 0
        if window is not None:
            hidden = hidden | (dist >= window)
        s = s.masked_fill(hidden, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:
            sink = sinks.to(s.dtype)[:, None, None].expand(-1, b - a, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
    return torch.cat(outs)
