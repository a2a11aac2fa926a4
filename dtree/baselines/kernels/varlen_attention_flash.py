"""Attention through the flash-attn package's ``flash_attn_varlen_func``, when it is installed.

Two ops, both one varlen kernel per call:

* :func:`varlen_attention_flash_attn`: the linearized baseline's packed causal attention
  (the contract of :func:`dtree.baselines.kernels.varlen_attention.varlen_attention_reference`), as
  verl and OpenRLHF run it (``cu_seqlens_q = cu_seqlens_k``, ``causal=True``).
* :func:`stack_attention_flash_attn`: a backend for dtree's attention over the KV stack
  (the contract of :func:`dtree.ops.stack_attention.stack_attention_reference`): each
  segment's ancestors are gathered from the stack in front of its own K/V (one gather
  per call), and the segment attends with ``cu_seqlens_k`` covering prefix + own and
  flash-attn's causal mask, which is aligned bottom-right when a sequence has more keys
  than queries (flash-attn >= 2.1, and 4): query ``r`` sees the prefix and own keys
  ``0 .. r``. The prefix dK/dV are added into the stack's gradient buffers. It exists to
  measure flash-attn against the fused Triton kernel (``benchmarks/bench_flash_backend.py``);
  the gather costs a copy of every prefix per layer and call, which the Triton kernel
  avoids by reading the stack in place.

Implementations, the first importable one is used
(:func:`dtree.baselines.kernels.varlen_attention.flash_attn_impl`):

* ``"flash-attn-2"``: ``flash_attn.flash_attn_varlen_func`` (a compiled CUDA extension:
  a long source build unless a wheel matches the torch/CUDA pair);
* ``"flash-attn-4"``: ``flash_attn.cute.flash_attn_varlen_func`` (CuTe DSL, pure-Python
  wheels plus ``nvidia-cutlass-dsl``; sm_90 forward and backward, sm_100+). It returns
  ``(out, lse)``.

Both take CUDA float16/bfloat16 tensors, ``int32`` offsets, GQA/MQA natively.
"""

from __future__ import annotations

import numpy as np
import torch

from ...device.transfer import upload
from ...ops.stack_attention.options import PLAIN, AttentionOptions, StackSlots, check_packed_qkv
from ...ops.stack_attention.segment_layout import SegmentLayout
from ...ops.stack_ops import SlotRows
from ...ops.stack_ops.kv_stack import KVStack
from .varlen_attention import FLASH_DTYPES, VarlenLayout, flash_attn_impl, installed_flash_attn

__all__ = ["flash_attn_impl", "stack_attention_flash_attn", "varlen_attention_flash_attn"]

_INSTALL = "pip install flash-attn-4 (CuTe DSL wheels; Hopper/Blackwell) or flash-attn (FlashAttention-2)"


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """One causal (bottom-right) varlen call of the installed flash-attn."""
    found = installed_flash_attn()
    if found is None:
        raise RuntimeError(f"flash-attn is not installed: {_INSTALL}")
    if q.device.type != "cuda" or q.dtype not in FLASH_DTYPES:
        raise ValueError(
            f"flash-attn needs CUDA float16/bfloat16 tensors, got {q.dtype} on {q.device}; use attention='sdpa'"
        )
    name, fn = found
    if name == "flash-attn-2":
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=True)
    out = fn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
             softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def varlen_attention_flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float
) -> torch.Tensor:
    """Packed causal attention, one ``flash_attn_varlen_func`` call.

    Args:
        q: [T, Hq, D] packed queries; k, v: [T, Hkv, D] (``Hq`` a multiple of ``Hkv``);
            CUDA float16/bfloat16.
        layout: the sequences' row offsets.
        scale: softmax scale.

    Returns:
        [T, Hq, D]; row ``r`` of sequence ``i`` attends to rows ``cu_seqlens[i] .. r``.
    """
    check_packed_qkv(q, k, v, layout.num_tokens, "cu_seqlens")
    cu = layout.device_offsets(q.device)
    return _varlen(q, k, v, cu, cu, layout.max_len, layout.max_len, scale)


# --------------------------------------------------------------------------- over the stack
class _StackPrefix(torch.autograd.Function):
    """The gathered prefix K/V of a call: forward copies the stack slots ``rows.index``
    out; backward adds their gradients into the stack's gradient buffers. Sibling
    segments gather the same slots, so the backward sums repeated slots: a fixed-order
    segmented reduction (:func:`dtree.ops.stack_ops.segment_add`), deterministic.

    It takes the call's own (k, v) as inputs only to sit in their autograd graph (its
    outputs then require grad) and gives them no gradient."""

    @staticmethod
    def forward(ctx, k, v, stack: KVStack, layer: int, rows: SlotRows):
        ctx.stack, ctx.layer, ctx.rows = stack, layer, rows
        return stack.gather(layer, rows.index)

    @staticmethod
    def backward(ctx, gk, gv):
        if ctx.stack.has_grad and (gk is not None or gv is not None):
            n = ctx.rows.index.shape[0]
            stack = ctx.stack
            gk = gk if gk is not None else stack.grad_k.new_zeros((n, *stack.grad_k.shape[2:]))
            gv = gv if gv is not None else stack.grad_v.new_zeros((n, *stack.grad_v.shape[2:]))
            stack.accumulate(ctx.layer, ctx.rows, gk, gv)
        return None, None, None, None, None


def _plan(q_offsets: np.ndarray, prefix_ranges) -> tuple:
    """Host tables of a call: stack slots of every prefix (concatenated), the order that
    interleaves [prefix_i, own_i] from ``cat([prefixes, own])``, and the key offsets."""
    slots, order, k_offsets = [], [], [0]
    n_prefix = sum(hi - lo for ranges in prefix_ranges for lo, hi in ranges)
    p = 0
    for i, ranges in enumerate(prefix_ranges):
        seg = [np.arange(lo, hi) for lo, hi in ranges]
        length = sum(len(s) for s in seg)
        slots.extend(seg)
        order.append(np.arange(p, p + length))
        p += length
        a, b = int(q_offsets[i]), int(q_offsets[i + 1])
        order.append(n_prefix + np.arange(a, b))
        k_offsets.append(k_offsets[-1] + length + (b - a))
    slots = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    k_offsets = np.asarray(k_offsets, dtype=np.int64)
    return slots, np.concatenate(order), k_offsets


def _tables(layout: SegmentLayout, device: torch.device) -> dict:
    """Device tables of :func:`_plan`, built once per layout and device (every layer of a
    call reuses them)."""

    def build():
        q_off = np.asarray(layout.q_offsets, dtype=np.int64)
        slots, order, k_off = _plan(q_off, layout.prefix_ranges)
        return {
            "slots": SlotRows.from_numpy(slots, device),
            "order": upload(order.astype(np.int64), device),
            "cu_q": upload(q_off.astype(np.int32), device),
            "cu_k": upload(k_off.astype(np.int32), device),
            "max_q": int(np.diff(q_off).max()),
            "max_k": int(np.diff(k_off).max()),
        }

    return layout.cached(("flash_attn", device), build)


def stack_attention_packed(q, k, v, stack: KVStack, layer: int, layout: SegmentLayout, scale: float, varlen_fn):
    """Stack attention as one varlen call of ``varlen_fn(q, kk, vv, cu_q, cu_k, max_q,
    max_k, scale)`` over the gathered prefix + own K/V of every segment (causal,
    bottom-right). :func:`stack_attention_flash_attn` passes flash-attn; the tests pass a
    pure-torch varlen to check the gather, packing and stack gradients on CPU."""
    check_packed_qkv(q, k, v, int(layout.q_offsets[-1]), "layout.q_offsets")
    t = _tables(layout, q.device)
    if t["slots"].index.numel():
        pk, pv = _StackPrefix.apply(k, v, stack, layer, t["slots"])
        kk = torch.cat([pk, k]).index_select(0, t["order"])
        vv = torch.cat([pv, v]).index_select(0, t["order"])
    else:
        kk, vv = k, v
    return varlen_fn(q, kk, vv, t["cu_q"], t["cu_k"], t["max_q"], t["max_k"], scale)


def stack_attention_flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions = PLAIN
) -> torch.Tensor:
    """flash-attn over (gathered stack prefix + own K/V), one varlen call, with the stack
    backends' signature (:mod:`dtree.ops.stack_attention.options`; CUDA float16/bfloat16,
    no score options): the benchmarks' gathered stand-in for the ``flash-attn`` backend."""
    if not options.plain:
        raise ValueError("stack_attention_flash_attn takes no score options (softcap, sinks, ALiBi, window)")
    scale = options.softmax_scale(q.shape[-1])
    return stack_attention_packed(q, k, v, slots.stack, slots.layer, slots.layout, scale, _varlen)
