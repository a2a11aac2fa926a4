"""Attention of packed query segments over the KV stack.

One model call runs several query segments packed along the token axis (varlen).
Segment ``i`` holds rows ``[q_offsets[i], q_offsets[i+1])``; its keys are

* its ancestors' K/V, read from the stack at ``prefix_ranges[i]`` with no mask, then
* its own K/V (the call's ``k, v`` rows of the segment), read causally.

That is, query row ``r`` of a segment with ``P`` prefix keys sees prefix keys
``0 .. P-1`` and own keys ``0 .. r``: lower-right-aligned causal attention over
``P + len`` keys, the same as that token sees in its linearized path.

Gradients: ``dq`` and the own ``dk, dv`` flow back through autograd; the prefix
``dk, dv`` are *added into the stack's gradient buffers* (they belong to ancestor
segments whose backward has not run yet; the runtime seeds it with them).

Backends, all with the signature of :func:`stack_attention_reference`:

* ``reference``: pure torch, float32 math, one segment at a time. The ground truth
  for the others.
* ``sdpa``: ``F.scaled_dot_product_attention`` per segment with a lower-right causal
  bias over (prefix gathered from the stack + own K/V). Any device.
* ``triton``: one fused kernel for all segments, reading the stack in place
  (:mod:`dtree.ops.stack_attention_triton`, CUDA only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..kv_stack import KVStack
from ..transfer import upload

__all__ = [
    "SegmentLayout",
    "stack_attention",
    "stack_attention_reference",
    "stack_attention_sdpa",
    "BACKENDS",
]

BACKENDS = ("reference", "sdpa", "triton")


@dataclass
class SegmentLayout:
    """Where the query segments of one call read K/V from (host side, plus cached
    device tables).

    Attributes:
        q_offsets: [S+1] row offsets of the segments in the call.
        own_slot: [S] stack slot of each segment's first own token.
        prefix_ranges: per segment, ancestor slot ranges ``((lo, hi), ...)``.
        call_slots: ``(lo, hi)``, the call's own stack slots, when some of its segments
            have ancestors in the same call (their slots are then inside prefix
            ranges); None otherwise.
    """

    q_offsets: np.ndarray
    own_slot: np.ndarray
    prefix_ranges: list[tuple[tuple[int, int], ...]]
    call_slots: tuple[int, int] | None = None
    _index_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_segments(self) -> int:
        return len(self.own_slot)

    def prefix_index(self, i: int, device: torch.device) -> slice | torch.Tensor | None:
        """Stack slots of segment ``i``'s prefix: a slice when contiguous, else a
        LongTensor; None when the segment has no ancestors."""
        ranges = self.prefix_ranges[i]
        if not ranges:
            return None
        if len(ranges) == 1:
            return slice(ranges[0][0], ranges[0][1])
        key = (i, device)
        if key not in self._index_cache:
            idx = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
            self._index_cache[key] = upload(idx, device)
        return self._index_cache[key]

    def device_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """int32 tables for fused kernels: ``q_offsets [S+1]``, ``own_slot [S]``,
        ``range_offsets [S+1]`` into ``range_lo/range_hi [R]``."""
        key = ("tables", device)
        if key not in self._index_cache:
            counts = [len(r) for r in self.prefix_ranges]
            offs = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=offs[1:])
            flat = [p for r in self.prefix_ranges for p in r] or [(0, 0)]
            lo = np.array([p[0] for p in flat], dtype=np.int64)
            hi = np.array([p[1] for p in flat], dtype=np.int64)
            packed = np.concatenate([self.q_offsets, self.own_slot, offs, lo, hi]).astype(np.int32)
            t = upload(packed, device)
            s = self.num_segments
            r = len(lo)
            cuts = np.cumsum([s + 1, s, s + 1, r])
            self._index_cache[key] = {
                "q_offsets": t[: cuts[0]],
                "own_slot": t[cuts[0] : cuts[1]],
                "range_offsets": t[cuts[1] : cuts[2]],
                "range_lo": t[cuts[2] : cuts[3]],
                "range_hi": t[cuts[3] :],
            }
        return self._index_cache[key]


def _gather_kv(k_seg, v_seg, stack: KVStack, layer: int, index):
    """``cat(stack[prefix], own)`` for K and V: [P + len, kv_heads, dim] each."""
    if index is None:
        return k_seg, v_seg
    return torch.cat([stack.k[layer, index], k_seg]), torch.cat([stack.v[layer, index], v_seg])


def check_packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_tokens: int, layout_name: str) -> None:
    """Shapes of a packed call: q [T, Hq, D], k and v [T, Hkv, D] with Hkv dividing Hq,
    and T the ``num_tokens`` the layout (``layout_name``, for the message) covers."""
    if q.ndim != 3 or k.shape != v.shape or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q [T, Hq, D] and k, v [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.shape[0] != num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows but {layout_name} covers {num_tokens}")


def attend_math(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 (float64 for float64 inputs) attention of one segment.

    q: [Tq, Hq, D]; kk, vv: [P + Tq, Hkv, D] (prefix first). Row r sees keys ``0 .. P + r``.
    """
    group = q.shape[1] // kk.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    tq, tk = q.shape[0], kk.shape[0]
    qf = q.to(compute)
    kf = kk.to(compute).repeat_interleave(group, dim=1)
    vf = vv.to(compute).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    rows = torch.arange(tq, device=q.device)[:, None]
    cols = torch.arange(tk, device=q.device)[None, :]
    scores = scores.masked_fill(cols - (tk - tq) > rows, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf).to(q.dtype)


def attend_sdpa(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as :func:`attend_math`, through ``scaled_dot_product_attention``
    with a lower-right causal bias (FlashAttention-2 inside on CUDA)."""
    from torch.nn.attention.bias import causal_lower_right

    tq, tk = q.shape[0], kk.shape[0]
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, kk, vv))
    if tq == tk:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(tq, tk), scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)


class _SegmentAttention(torch.autograd.Function):
    """One segment's attention over (stack prefix + own K/V).

    Saves only the segment's own q/k/v: the prefix is re-read from the stack in
    backward (ancestors stay on the stack until this segment pops), so activation
    memory never holds a copy of the prefix. The backward recomputes the attention
    with autograd, sends the own dK/dV back through autograd and adds the prefix
    dK/dV into the stack's gradient buffers.
    """

    @staticmethod
    def forward(ctx, q, k, v, stack: KVStack, layer: int, index, core, scale: float):
        ctx.stack, ctx.layer, ctx.index, ctx.core, ctx.scale = stack, layer, index, core, scale
        ctx.save_for_backward(q, k, v)
        kk, vv = _gather_kv(k, v, stack, layer, index)
        return core(q, kk, vv, scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        stack, layer, index = ctx.stack, ctx.layer, ctx.index
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_(True) for x in (q, k, v))
            inputs = [q_, k_, v_]
            if index is not None:
                pk = stack.k[layer, index].detach().requires_grad_(True)
                pv = stack.v[layer, index].detach().requires_grad_(True)
                inputs += [pk, pv]
                kk, vv = torch.cat([pk, k_]), torch.cat([pv, v_])
            else:
                kk, vv = k_, v_
            out = ctx.core(q_, kk, vv, ctx.scale)
            grads = torch.autograd.grad(out, inputs, grad_out)
        if index is not None and stack.has_grad:
            stack.accumulate(layer, index, grads[3], grads[4])
        return grads[0], grads[1], grads[2], None, None, None, None, None


def _per_segment(q, k, v, stack, layer, layout: SegmentLayout, scale, core) -> torch.Tensor:
    outs = []
    for i in range(layout.num_segments):
        a, b = int(layout.q_offsets[i]), int(layout.q_offsets[i + 1])
        index = layout.prefix_index(i, q.device)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            outs.append(_SegmentAttention.apply(q[a:b], k[a:b], v[a:b], stack, layer, index, core, scale))
        else:
            kk, vv = _gather_kv(k[a:b], v[a:b], stack, layer, index)
            outs.append(core(q[a:b], kk, vv, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def stack_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stack: KVStack,
    layer: int,
    layout: SegmentLayout,
    scale: float,
) -> torch.Tensor:
    """Pure-torch attention over the stack, float32 math, one segment at a time.

    Args:
        q: [T, q_heads, dim] packed queries of all segments.
        k, v: [T, kv_heads, dim] the segments' own keys/values.
        stack: the KV stack holding every ancestor's K/V for ``layer``.
        layout: segment offsets and prefix ranges.
        scale: softmax scale.

    Returns:
        [T, q_heads, dim] in ``q.dtype``. Backward adds the prefix dK/dV into
        ``stack.grad_k/grad_v``.
    """
    return _per_segment(q, k, v, stack, layer, layout, scale, attend_math)


def stack_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stack: KVStack,
    layer: int,
    layout: SegmentLayout,
    scale: float,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` per segment over (stack prefix + own K/V),
    lower-right causal. Shapes and gradients as :func:`stack_attention_reference`."""
    return _per_segment(q, k, v, stack, layer, layout, scale, attend_sdpa)


class _InCallGrad(torch.autograd.Function):
    """Identity on the call's own (k, v) whose backward adds what the call's segments
    sent each other through the stack.

    A segment whose ancestor runs in the same call reads that ancestor's K/V from the
    stack like any prefix, so the backends add its dK/dV into the stack's gradient
    slots of this very call. Those belong in this call's own dK/dV: this backward runs
    after every attention backward that consumed (k, v) at this layer (autograd waits
    for all of an output's consumers), and adds the slots in. The runtime clears the
    call's slots before the call's backward, so they hold only these contributions.
    """

    @staticmethod
    def forward(ctx, k, v, stack: KVStack, layer: int, lo: int, hi: int):
        ctx.stack, ctx.layer, ctx.lo, ctx.hi = stack, layer, lo, hi
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        sk = ctx.stack.grad_k[ctx.layer, ctx.lo : ctx.hi]
        sv = ctx.stack.grad_v[ctx.layer, ctx.lo : ctx.hi]
        gk = sk.to(gk.dtype) if gk is None else gk + sk.to(gk.dtype)
        gv = sv.to(gv.dtype) if gv is None else gv + sv.to(gv.dtype)
        return gk, gv, None, None, None, None


def stack_attention(q, k, v, stack, layer, layout, scale, backend: str = "sdpa") -> torch.Tensor:
    """Dispatch to a backend by name (see module docstring)."""
    if layout.call_slots is not None and stack.has_grad and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        k, v = _InCallGrad.apply(k, v, stack, layer, *layout.call_slots)
    if backend == "reference":
        return stack_attention_reference(q, k, v, stack, layer, layout, scale)
    if backend == "sdpa":
        return stack_attention_sdpa(q, k, v, stack, layer, layout, scale)
    if backend == "triton":
        from .stack_attention_triton import stack_attention_triton

        return stack_attention_triton(q, k, v, stack, layer, layout, scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
