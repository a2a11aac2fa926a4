"""A stack-attention call as one masked attention over stack slots ``[0, base + T)``
(:mod:`dtree.ops.stack_attention.call_mask` gives the mask), with the attention kernel
pluggable: :data:`TORCH_MASKED_CALL` here, dense float32 (float64 for float64 inputs) math, the
reference this path is tested with on CPU; flash-attn-4 with block sparsity and a mask
function on Hopper (:mod:`dtree.ops.stack_attention.flash4_masked_call`).

The own K/V must sit in the stack's slots ``[base, base + T)``: the forward writes them
there (the same values a push writes; the plan sizes the stack for every call's slots when
the backend reads own K/V from the stack, :data:`.interface.OWN_KV_IN_STACK`), unless the
caller pushed them already (``own_in_stack``: the walk's groups that write the stack). The backward
adds the slots below the call into the stack's gradient buffers and returns the call's own
slots as the gradients of ``k, v``: they hold every contribution of this call (its own
rows' and its in-call descendants'), so nothing of the call goes through the stack's
gradient slots, and :func:`.seed_from_stack` adds only later calls' terms.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ..stack_ops.kv_stack import KVStack
from .call_mask import CallMask, visible_from_tables
from .output_memo import kept_or_computed
from .segment_layout import SegmentLayout

__all__ = ["TORCH_MASKED_CALL", "MaskedCallKernel", "stack_attention_masked_call"]


class MaskedCallKernel(Protocol):
    """Softmax attention of ``q [T, Hq, Dk]`` over ``k [N, Hkv, Dk]``, ``v [N, Hkv, Dv]``
    (N = ``mask.num_keys``, GQA by head groups) under ``mask``."""

    def forward(self, q, k, v, mask: CallMask, layout: SegmentLayout, scale: float):
        """-> (out [T, Hq, Dv] in q's dtype, natural log-sum-exp [Hq, T] float32)."""

    def backward(self, q, k, v, out, dout, lse, mask: CallMask, layout: SegmentLayout, scale: float):
        """-> (dq, dk [N, Hkv, Dk], dv [N, Hkv, Dv]) in the inputs' dtypes."""


class _TorchMaskedCall:
    """:class:`MaskedCallKernel` in dense torch: the reference (every key any row reads, the mask
    from the tables as the kernel's mask function evaluates them)."""

    @staticmethod
    def _dense(q, k, v, mask: CallMask, scale: float):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        visible = visible_from_tables(mask)
        read = np.flatnonzero(visible.any(axis=0))  # unread slots may hold anything (NaN included)
        cols = torch.as_tensor(read, device=q.device)
        seen = torch.as_tensor(visible[:, read], device=q.device)
        group = q.shape[1] // k.shape[1]
        kk = k[cols].to(acc).repeat_interleave(group, 1)
        vv = v[cols].to(acc).repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q.to(acc), kk) * scale
        return s.masked_fill(~seen[None], float("-inf")), kk, vv, cols, acc

    def forward(self, q, k, v, mask, layout, scale):
        s, _, vv, _, acc = self._dense(q, k, v, mask, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv)
        return out.to(q.dtype), lse.to(torch.float64 if acc == torch.float64 else torch.float32)

    def backward(self, q, k, v, out, dout, lse, mask, layout, scale):
        s, kk, vv, cols, acc = self._dense(q, k, v, mask, scale)
        p = torch.exp(s - lse.to(acc)[..., None])
        do = dout.to(acc)
        delta = (do * out.to(acc)).sum(-1).transpose(0, 1)  # [H, T]
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta[..., None])
        hkv, group = k.shape[1], q.shape[1] // k.shape[1]
        dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dk_h = torch.einsum("hqk,qhd->khd", ds, q.to(acc)) * scale
        dv_h = torch.einsum("hqk,qhd->khd", p, do)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        dk[cols] = dk_h.reshape(len(cols), hkv, group, -1).sum(2)
        dv[cols] = dv_h.reshape(len(cols), hkv, group, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


TORCH_MASKED_CALL: MaskedCallKernel = _TorchMaskedCall()


class _MaskedCallAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, stack: KVStack, layer: int, layout: SegmentLayout, mask: CallMask, scale: float,
                kernel: MaskedCallKernel, own_in_stack: bool):
        base, n = mask.base, mask.num_keys
        if not own_in_stack:
            stack.k[layer, base:n].copy_(k)
            stack.v[layer, base:n].copy_(v)
        t, hq = q.shape[:2]
        out, lse = kept_or_computed(
            lambda: kernel.forward(q, stack.k[layer, :n], stack.v[layer, :n], mask, layout, scale),
            (t, hq, v.shape[-1]), (hq, t), q.dtype,
        )
        ctx.save_for_backward(q, out, lse)
        ctx.stack, ctx.layer, ctx.layout, ctx.mask, ctx.scale, ctx.kernel = stack, layer, layout, mask, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        stack, layer, mask = ctx.stack, ctx.layer, ctx.mask
        base, n = mask.base, mask.num_keys
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = ctx.kernel.backward(q, stack.k[layer, :n], stack.v[layer, :n], out, dout, lse, mask, ctx.layout,
                                         ctx.scale)
        if stack.has_grad and base > 0:
            stack.grad_slots_through(base)
            stack.grad_k[layer, :base].add_(dk[:base])
            stack.grad_v[layer, :base].add_(dv[:base])
        return dq, dk[base:], dv[base:], None, None, None, None, None, None, None


def stack_attention_masked_call(
    q, k, v, stack: KVStack, layer: int, layout: SegmentLayout, mask: CallMask, scale: float,
    kernel: MaskedCallKernel = TORCH_MASKED_CALL, own_in_stack: bool = False,
) -> torch.Tensor:
    """Plain stack attention of one call as one masked attention (see the module
    docstring). q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] with unit last strides; the
    stack holds at least ``mask.num_keys`` slots. ``own_in_stack``: ``k, v`` sit in slots
    ``[mask.base, mask.num_keys)`` already (the caller pushed them: one write, not two)."""
    if stack.capacity < mask.num_keys:
        raise ValueError(f"the call's slots end at {mask.num_keys}, past the stack capacity {stack.capacity}")
    return _MaskedCallAttention.apply(q, k, v, stack, layer, layout, mask, float(scale), kernel, own_in_stack)
