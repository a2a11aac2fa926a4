"""The per-segment backends of stack attention, ``reference`` (float32 math) and ``sdpa``
(``F.scaled_dot_product_attention``): one segment at a time over (its prefix gathered
from the stack + its own K/V), with a backward that re-reads the prefix from the stack
(activation memory never holds a copy of it) and adds the prefix dK/dV into the stack's
gradient slots. With a window, only the in-window part of each prefix is gathered.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .. import determinism
from .attention_math import attend_math, attend_sdpa
from .options import PLAIN, AttentionOptions, StackSlots, check_stack_attention

if TYPE_CHECKING:  # kv_stack imports dtree.ops (its stack ops): no import at run time
    from ..stack_ops.kv_stack import KVStack

__all__ = ["stack_attention_reference", "stack_attention_sdpa"]


def _gather_kv(k_seg, v_seg, stack: KVStack, layer: int, index):
    """``cat(stack[prefix], own)`` for K and V: [P + len, kv_heads, Dk] and [.., Dv]."""
    if index is None:
        return k_seg, v_seg
    return torch.cat([stack.k[layer, index], k_seg]), torch.cat([stack.v[layer, index], v_seg])


def _in_window(index, window: int | None):
    """The part of a prefix index (slice or LongTensor of P slots, root first) that the
    segment's first query can see with ``window``: the last ``window - 1`` slots.
    Later queries see fewer, which the mask handles."""
    if index is None or window is None:
        return index
    if isinstance(index, slice):
        lo = max(index.start, index.stop - (window - 1))
        return slice(lo, index.stop) if lo < index.stop else None
    return index[-(window - 1) :] if window > 1 else None


class _SegmentAttention(torch.autograd.Function):
    """One segment's attention over (stack prefix + own K/V).

    Saves only the segment's own q/k/v: the prefix is re-read from the stack in
    backward (ancestors stay on the stack until this segment pops), so activation
    memory never holds a copy of the prefix. The backward recomputes the attention
    with autograd, sends the own dK/dV (and dsinks) back through autograd and adds the
    prefix dK/dV into the stack's gradient buffers.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, stack: KVStack, layer: int, index, core, scale: float, options, deterministic):
        ctx.stack, ctx.layer, ctx.index, ctx.core, ctx.scale, ctx.options = stack, layer, index, core, scale, options
        ctx.deterministic = deterministic
        ctx.save_for_backward(q, k, v, sinks)
        kk, vv = _gather_kv(k, v, stack, layer, index)
        return core(q, kk, vv, scale, options)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks = ctx.saved_tensors
        stack, layer, index = ctx.stack, ctx.layer, ctx.index
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_(True) for x in (q, k, v))
            inputs = [q_, k_, v_]
            options = ctx.options
            if sinks is not None:
                sinks_ = sinks.detach().requires_grad_(True)
                options = replace(options, sinks=sinks_)
            if index is not None:
                pk = stack.k[layer, index].detach().requires_grad_(True)
                pv = stack.v[layer, index].detach().requires_grad_(True)
                inputs += [pk, pv]
                kk, vv = torch.cat([pk, k_]), torch.cat([pv, v_])
            else:
                kk, vv = k_, v_
            if sinks is not None:
                inputs.append(sinks_)
            # torch's fused SDPA backward on CUDA sums dQ with atomics unless torch's own
            # deterministic mode is on (which would also demand CUBLAS_WORKSPACE_CONFIG of
            # every matmul): in dtree's deterministic mode the backward differentiates the
            # float32 math instead (the same function; no atomics, no global setting)
            core = attend_math if ctx.deterministic and q.is_cuda else ctx.core
            out = core(q_, kk, vv, ctx.scale, options)
            grads = torch.autograd.grad(out, inputs, grad_out)
        if index is not None and stack.has_grad:
            stack.accumulate(layer, index, grads[3], grads[4])
        dsinks = grads[-1] if sinks is not None else None
        return grads[0], grads[1], grads[2], dsinks, None, None, None, None, None, None, None


def _per_segment(q, k, v, slots: StackSlots, core, options: AttentionOptions) -> torch.Tensor:
    stack, layer, layout = slots.stack, slots.layer, slots.layout
    scale = options.softmax_scale(q.shape[-1])
    deterministic = determinism.requested(options.deterministic)
    outs = []
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, options.sinks)
    )
    for i in range(layout.num_segments):
        a, b = int(layout.q_offsets[i]), int(layout.q_offsets[i + 1])
        index = _in_window(layout.prefix_index(i, q.device), options.window)
        if needs_grad:
            outs.append(
                _SegmentAttention.apply(
                    q[a:b], k[a:b], v[a:b], options.sinks, stack, layer, index, core, scale, options, deterministic
                )
            )
        else:
            kk, vv = _gather_kv(k[a:b], v[a:b], stack, layer, index)
            outs.append(core(q[a:b], kk, vv, scale, options))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def stack_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions = PLAIN
) -> torch.Tensor:
    """Pure-torch attention over the stack, float32 math, one segment at a time (the
    ``reference`` backend; shapes, arguments and gradients in :mod:`.options`). The
    prefix gradients are added segment after segment, in a fixed order."""
    check_stack_attention(q, k, v, slots, options)
    return _per_segment(q, k, v, slots, attend_math, options)


def stack_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions = PLAIN
) -> torch.Tensor:
    """``scaled_dot_product_attention`` per segment over (stack prefix + own K/V),
    lower-right causal (the ``sdpa`` backend; see :func:`attend_sdpa` for the options).
    Shapes, arguments and gradients as :func:`stack_attention_reference`."""
    check_stack_attention(q, k, v, slots, options)
    return _per_segment(q, k, v, slots, attend_sdpa, options)
