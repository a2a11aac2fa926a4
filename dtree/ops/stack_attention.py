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

Every backend is tested against :func:`dtree.ops.stack_attention_naive.stack_attention_naive`.
With a window, the reference and sdpa backends gather only the in-window part of
each segment's prefix.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from ..kv_stack import KVStack
from ..transfer import upload

__all__ = [
    "AttentionOptions",
    "SegmentLayout",
    "check_stack_attention",
    "seed_from_stack",
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
            ranges, so the backward adds gradients into them: pass the call's
            ``k, v`` through :func:`seed_from_stack` to get them back); None otherwise.
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


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """The score options of one call (all None: plain causal attention).

    Attributes:
        softcap: scores ``s -> softcap * tanh(s / softcap)`` after ``scale``.
        sinks: [Hq] a sink logit per query head in the softmax denominator only.
        alibi_slopes: [Hq] adds ``-slope_h * (pos_q - pos_k)`` to the scores.
        window: a query at depth ``i`` sees keys at depths ``i - window < j <= i``.
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    window: int | None = None

    @property
    def plain(self) -> bool:
        return self.softcap is None and self.sinks is None and self.alibi_slopes is None and self.window is None


PLAIN = AttentionOptions()


def _check_head_vector(name: str, x, q: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape [{q.shape[1]}] (one value per query head), got {type(x).__name__}")
    if x.shape != (q.shape[1],):
        raise ValueError(f"{name} must have shape [{q.shape[1]}] (one value per query head), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}; move it to {q.device}")


def check_stack_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stack: KVStack, layout: "SegmentLayout", options: AttentionOptions
) -> None:
    """Host-side checks every backend runs before anything launches: the shapes of
    q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] against each other, the stack and the
    layout, and the option values. Raises ValueError naming the fix."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"expected q [T, Hq, Dk], k [T, Hkv, Dk] and v [T, Hkv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or q.shape[2] != k.shape[2] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"expected q [T, Hq, Dk], k [T, Hkv, Dk] and v [T, Hkv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if (stack.num_kv_heads, stack.head_dim, stack.v_head_dim) != (k.shape[1], k.shape[2], v.shape[2]):
        raise ValueError(
            f"the stack holds {stack.num_kv_heads} kv heads with key dim {stack.head_dim} and value dim "
            f"{stack.v_head_dim}, the call has {k.shape[1]} with {k.shape[2]} and {v.shape[2]}; size the stack "
            "(ModelSpec num_kv_heads / head_dim / v_head_dim) from what the attention receives"
        )
    t = q.shape[0]
    if len(layout.q_offsets) < 2 or int(layout.q_offsets[0]) != 0 or int(layout.q_offsets[-1]) != t:
        raise ValueError(f"layout.q_offsets must run from 0 to T={t}, got {list(layout.q_offsets)}")
    cap = options.softcap
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not math.isfinite(cap) or cap <= 0
    ):
        raise ValueError(f"softcap must be a finite number > 0 (or None for no capping), got {cap!r}")
    if options.sinks is not None:
        _check_head_vector("sinks", options.sinks, q)
    if options.alibi_slopes is not None:
        _check_head_vector("alibi_slopes", options.alibi_slopes, q)
        if options.alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes must not require grad (ALiBi slopes are constants); pass slopes.detach()")
    w = options.window
    if w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 1):
        raise ValueError(f"window must be an int >= 1 (or None for full attention), got {w!r}")


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


def _distance(tq: int, tk: int, device) -> torch.Tensor:
    """[tq, tk] ``pos_q - pos_k`` for queries that are the last ``tq`` of ``tk`` keys."""
    rows = torch.arange(tq, device=device)[:, None] + (tk - tq)
    return rows - torch.arange(tk, device=device)[None, :]


def attend_math(
    q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float, options: AttentionOptions | None = None
) -> torch.Tensor:
    """Float32 (float64 for float64 inputs) attention of one segment.

    q: [Tq, Hq, Dk]; kk: [Tk, Hkv, Dk], vv: [Tk, Hkv, Dv], the keys at consecutive
    depths ending at the last query's (prefix first): row r sees keys ``0 .. Tk - Tq + r``
    (and, with a window, only the last ``window`` of those). Returns [Tq, Hq, Dv].
    """
    opts = options or PLAIN
    group = q.shape[1] // kk.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    tq, tk = q.shape[0], kk.shape[0]
    qf = q.to(compute)
    kf = kk.to(compute).repeat_interleave(group, dim=1)
    vf = vv.to(compute).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if opts.softcap is not None:
        scores = opts.softcap * torch.tanh(scores / opts.softcap)
    dist = _distance(tq, tk, q.device)
    if opts.alibi_slopes is not None:
        scores = scores - opts.alibi_slopes.to(compute)[:, None, None] * dist.to(compute)
    hidden = dist < 0
    if opts.window is not None:
        hidden = hidden | (dist >= opts.window)
    scores = scores.masked_fill(hidden, float("-inf"))
    if opts.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = opts.sinks.to(compute)[:, None, None].expand(-1, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def _sdpa_mask(q: torch.Tensor, tq: int, tk: int, opts: AttentionOptions) -> torch.Tensor:
    """[Hq or 1, tq, tk (+1 sink column)] mask for SDPA: bool (True = attend) for a
    window alone, else additive in q's dtype (0 / -inf, ALiBi bias, the sink logits)."""
    dist = _distance(tq, tk, q.device)
    visible = dist >= 0
    if opts.window is not None:
        visible = visible & (dist < opts.window)
    if opts.alibi_slopes is None and opts.sinks is None:
        return visible[None]
    bias = torch.zeros((1, tq, tk), dtype=q.dtype, device=q.device)
    if opts.alibi_slopes is not None:
        bias = -opts.alibi_slopes.to(q.dtype)[:, None, None] * dist.to(q.dtype)
    bias = bias.masked_fill(~visible, float("-inf"))
    if opts.sinks is not None:
        sink = opts.sinks.to(q.dtype)[:, None, None].expand(-1, tq, 1)
        bias = torch.cat([bias.expand(sink.shape[0], -1, -1), sink], dim=-1)
    return bias


def attend_sdpa(
    q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float, options: AttentionOptions | None = None
) -> torch.Tensor:
    """Same contract as :func:`attend_math`, through ``scaled_dot_product_attention``
    (FlashAttention-2 inside on CUDA for plain causal attention). A window, ALiBi and
    sinks become a mask (a sink is one more key with zero K and V whose mask entry is
    the sink logit, so its gradient flows through the mask); softcapping needs a
    transform of the scores that SDPA cannot apply, so it runs :func:`attend_math`."""
    from torch.nn.attention.bias import causal_lower_right

    opts = options or PLAIN
    if opts.softcap is not None:
        return attend_math(q, kk, vv, scale, opts)
    tq, tk = q.shape[0], kk.shape[0]
    if opts.sinks is not None:
        kk = torch.cat([kk, kk.new_zeros((1, *kk.shape[1:]))])
        vv = torch.cat([vv, vv.new_zeros((1, *vv.shape[1:]))])
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, kk, vv))
    if not opts.plain:
        mask = _sdpa_mask(q, tq, tk, opts)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None], scale=scale, enable_gqa=True)
    elif tq == tk:
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
        gk = sk.to(ctx.dtypes[0]) if gk is None else (sk + gk).to(ctx.dtypes[0])
        gv = sv.to(ctx.dtypes[1]) if gv is None else (sv + gv).to(ctx.dtypes[1])
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
    module docstring); arguments as :func:`stack_attention_reference`. Gradients of
    in-call ancestors stay in the stack's slots (see :func:`seed_from_stack`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    options = dict(softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, window=window)
    if backend == "reference":
        return stack_attention_reference(q, k, v, stack, layer, layout, scale, **options)
    if backend == "sdpa":
        return stack_attention_sdpa(q, k, v, stack, layer, layout, scale, **options)
    from .stack_attention_triton import stack_attention_triton

    return stack_attention_triton(q, k, v, stack, layer, layout, scale, **options)
