"""Attention of packed query segments over the KV stack.

One model call runs several query segments packed along the token axis (varlen).
Segment ``i`` holds rows ``[q_offsets[i], q_offsets[i+1])``; its keys are

* its ancestors' K/V, read from the stack at ``prefix_ranges[i]`` with no mask, then
* its own K/V (the call's ``k, v`` rows of the segment), read causally.

That is, query row ``r`` of a segment with ``P`` prefix keys sees prefix keys
``0 .. P-1`` and own keys ``0 .. r``: lower-right-aligned causal attention over
``P + len`` keys, the same as that token sees in its linearized path. The prefix
ranges hold the whole root-to-segment path, root first, so a key's index in
``[prefix ; own]`` is its depth (position) and the query's is ``P + r``.

Options, per call (HF passes them per layer, so layers that alternate sliding and
full attention pass different values): ``softcap`` (Gemma2), ``sinks`` (GPT-OSS),
``alibi_slopes`` (Bloom, MPT, Falcon), ``window`` (sliding window); their math is in
:mod:`dtree.ops.stack_attention_naive`. Values may be narrower than keys (MLA):
q, k ``[T, H, Dk]``, v ``[T, Hkv, Dv]``, output ``[T, Hq, Dv]``.

Gradients: ``dq``, the own ``dk, dv`` and ``dsinks`` flow back through autograd; the
prefix ``dk, dv`` are *added into the stack's gradient buffers* (they belong to
ancestor segments whose backward has not run yet). That includes ancestors in the
same call (``SegmentLayout.call_slots``), which the backends read through the stack
like any prefix. :func:`seed_from_stack` folds the stack's gradient slots of a call
back into its own ``dk, dv``: the runtime passes every call's ``k, v`` through it
before the attention, so the descendants' and the in-call contributions enter the
backward where K/V are consumed, whatever graph computed them.

Backends, all with the signature of :func:`stack_attention`:

* ``reference``: pure torch, float32 math, one segment at a time.
* ``sdpa``: ``F.scaled_dot_product_attention`` per segment with a lower-right causal
  mask over (prefix gathered from the stack + own K/V); windows, ALiBi and sinks
  become an additive mask, softcapping runs the ``reference`` math (SDPA has no hook
  for a score transform). Any device.
* ``triton``: one fused kernel for all segments, reading the stack in place
  (:mod:`dtree.ops.stack_attention_triton`, CUDA only).

They are registered in :mod:`dtree.ops.backends`, whose ``resolve_backend`` picks one
for a device (``auto``: ``triton`` on CUDA where it runs, else ``sdpa``).

Every backend is tested against :func:`dtree.ops.stack_attention_naive.stack_attention_naive`.
With a window, the reference and sdpa backends gather only the in-window part of
each segment's prefix.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..kv_stack import KVStack
from .attention_math import attend_math, attend_sdpa
from .attention_options import PLAIN, AttentionOptions, check_packed_qkv, check_stack_attention
from .backends import Target, backend_names, implementation
from .segment_layout import SegmentLayout
from .stack_glue import fold_seed

__all__ = [
    "BACKENDS",
    "PLAIN",
    "AttentionOptions",
    "SegmentLayout",
    "attend_math",
    "attend_sdpa",
    "check_packed_qkv",
    "check_stack_attention",
    "seed_from_stack",
    "stack_attention",
    "stack_attention_reference",
    "stack_attention_sdpa",
    "triton_unavailable",
]

BACKENDS = backend_names("stack_attention")


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
    def forward(ctx, q, k, v, sinks, stack: KVStack, layer: int, index, core, scale: float, options):
        ctx.stack, ctx.layer, ctx.index, ctx.core, ctx.scale, ctx.options = stack, layer, index, core, scale, options
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
            out = ctx.core(q_, kk, vv, ctx.scale, options)
            grads = torch.autograd.grad(out, inputs, grad_out)
        if index is not None and stack.has_grad:
            stack.accumulate(layer, index, grads[3], grads[4])
        dsinks = grads[-1] if sinks is not None else None
        return grads[0], grads[1], grads[2], dsinks, None, None, None, None, None, None


def _per_segment(q, k, v, stack, layer, layout: SegmentLayout, scale, core, options: AttentionOptions) -> torch.Tensor:
    outs = []
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, options.sinks)
    )
    for i in range(layout.num_segments):
        a, b = int(layout.q_offsets[i]), int(layout.q_offsets[i + 1])
        index = _in_window(layout.prefix_index(i, q.device), options.window)
        if needs_grad:
            outs.append(
                _SegmentAttention.apply(q[a:b], k[a:b], v[a:b], options.sinks, stack, layer, index, core, scale, options)
            )
        else:
            kk, vv = _gather_kv(k[a:b], v[a:b], stack, layer, index)
            outs.append(core(q[a:b], kk, vv, scale, options))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def stack_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stack: KVStack,
    layer: int,
    layout: SegmentLayout,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Pure-torch attention over the stack, float32 math, one segment at a time.

    Args:
        q: [T, Hq, Dk] packed queries of all segments.
        k: [T, Hkv, Dk], v: [T, Hkv, Dv] the segments' own keys/values.
        stack: the KV stack holding every ancestor's K/V for ``layer``.
        layout: segment offsets and prefix ranges.
        scale: softmax scale.
        softcap, sinks [Hq], alibi_slopes [Hq], window: see :class:`AttentionOptions`.

    Returns:
        [T, Hq, Dv] in ``q.dtype``. Backward adds the prefix dK/dV into
        ``stack.grad_k/grad_v`` and returns dsinks to ``sinks``.
    """
    options = AttentionOptions(softcap, sinks, alibi_slopes, window)
    check_stack_attention(q, k, v, stack, layout, options)
    return _per_segment(q, k, v, stack, layer, layout, scale, attend_math, options)


def stack_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stack: KVStack,
    layer: int,
    layout: SegmentLayout,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` per segment over (stack prefix + own K/V),
    lower-right causal (see :func:`attend_sdpa` for the options). Shapes and gradients
    as :func:`stack_attention_reference`."""
    options = AttentionOptions(softcap, sinks, alibi_slopes, window)
    check_stack_attention(q, k, v, stack, layout, options)
    return _per_segment(q, k, v, stack, layer, layout, scale, attend_sdpa, options)


class _StackGradSeed(torch.autograd.Function):
    """Identity on a call's own (k, v) whose backward adds the stack's gradient slots
    ``[lo, hi)`` of ``layer`` (float32) to the incoming dk, dv.

    Autograd runs a node's backward only once every consumer of its outputs has sent
    its gradient, so this runs after the attention backward of the same call at this
    layer: the slots then hold what the call's descendants added (their backward ran
    earlier, depth first) plus what the call's own segments sent their in-call
    ancestors. The sum is formed in float32 and rounded once."""

    @staticmethod
    def forward(ctx, k, v, stack: KVStack, layer: int, lo: int, hi: int):
        ctx.stack, ctx.layer, ctx.lo, ctx.hi = stack, layer, lo, hi
        ctx.dtypes = (k.dtype, v.dtype)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        sk = ctx.stack.grad_k[ctx.layer, ctx.lo : ctx.hi]
        sv = ctx.stack.grad_v[ctx.layer, ctx.lo : ctx.hi]
        gk, gv = fold_seed(sk, sv, gk, gv, ctx.dtypes)  # one launch on CUDA
        return gk, gv, None, None, None, None


def seed_from_stack(
    k: torch.Tensor, v: torch.Tensor, stack: KVStack, layer: int, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` unchanged, with a backward that adds ``stack.grad_k/grad_v[layer, lo:hi]``
    to their gradients.

    Args:
        k: [T, Hkv, Dk], v: [T, Hkv, Dv] the call's own K/V, held in stack slots
            ``[lo, hi)`` (``hi - lo == T``).

    Pass them through this before :func:`stack_attention` and the gradient slots the
    attention backward (of this call: in-call ancestors) and earlier backwards (of the
    call's descendants) filled are added exactly once. Nothing is added where neither
    requires grad (nothing trainable computes them)."""
    if hi - lo != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v have {k.shape[0]} and {v.shape[0]} rows for the {hi - lo} slots [{lo}, {hi})")
    if not stack.has_grad or not torch.is_grad_enabled() or not (k.requires_grad or v.requires_grad):
        return k, v
    return _StackGradSeed.apply(k, v, stack, layer, lo, hi)


def stack_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stack: KVStack,
    layer: int,
    layout: SegmentLayout,
    scale: float,
    backend: str = "sdpa",
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the packed segments over the stack, by backend name (see the
    module docstring and :mod:`dtree.ops.backends`; :func:`dtree.ops.backends.resolve_backend`
    picks one for a device); arguments as :func:`stack_attention_reference`. Gradients of
    in-call ancestors stay in the stack's slots (see :func:`seed_from_stack`)."""
    attend = implementation("stack_attention", backend)
    return attend(
        q, k, v, stack, layer, layout, scale, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, window=window
    )


def triton_unavailable(target: Target) -> str | None:
    """Why the ``triton`` backend cannot run on ``target`` (None: it runs): Triton
    missing, not a CUDA device of compute capability >= 8.0 (and no interpreter), a
    dtype or head dim the kernels do not take."""
    try:
        from . import stack_attention_triton as sat

        sat.require_triton(target.device)
    except (ImportError, RuntimeError) as e:
        return f"cannot run here: {e}"
    if target.dtype is not None and target.dtype not in sat.DTYPES:
        return f"runs {sat.DTYPES}, this model is {target.dtype}; use attention='sdpa'"
    if target.head_dim is not None and target.head_dim > sat.MAX_HEAD_DIM:
        return f"supports head dims up to {sat.MAX_HEAD_DIM}, this model has {target.head_dim}; use attention='sdpa'"
    return None
