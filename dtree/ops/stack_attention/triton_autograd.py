"""Fused Triton stack attention: every segment of one call in one kernel launch,
reading the ancestors' K/V straight from the KV stack (no gather, no copy).

Contract: exactly :func:`dtree.ops.stack_attention.stack_attention_reference`. Query
row ``r`` of segment ``i`` sees, unmasked, the stack slots ``layout.prefix_ranges[i]``
(its ancestors), then its own keys ``0 .. r`` (read from the call's ``k, v``). The
backward returns ``dq`` and the own ``dk, dv`` and ADDS the prefix dK/dV into
``stack.grad_k[layer] / stack.grad_v[layer]``.

Work decomposition
------------------
*Runs.* Consecutive segments with identical prefix ranges (siblings: a GRPO group's
answers, the children of one tool call) are merged into one run of packed rows. A
query block may then span several short segments: all its rows see the same
ancestors, and the own keys are masked per row by ``seg_start[r] <= key <= r``
(varlen block-diagonal causal). Forty-token sibling tool results therefore share
128-row tiles instead of each wasting two thirds of one.

*Forward* (FlashAttention-2): one program per (query block of a run, q head); online
softmax in base 2 over the run's prefix ranges, then the own keys. Key blocks that
every row of the tile sees are processed without any mask; only range tails, the
cross-segment blocks and the diagonal pay for masking. Saves ``q, k, v, out`` and the
base-2 log-sum-exp ``lse`` (fp32, ``[Hq, T]``), never a copy of the prefix: the
ancestors stay on the stack until this call's backward has run.

*Backward*: a KV-centric kernel, one program per (work item, kv head), looping over
the q heads of its GQA group and over the query rows that see its keys; a work item is
either an own key block (dK/dV stored with plain stores; every own row belongs to
exactly one item) or a prefix chunk of at most ``BLOCK_N`` stack slots inside one
``BLOCK_N``-slot cell of the stack together with at most ``prefix_item_rows`` query
rows of the run (its dK/dV are added into the fp32 stack gradient). ``dq`` comes one
of two ways (``backward=``):

* ``"fused"`` (the default; FlashAttention-2's scheme): each row tile of the dK/dV
  kernel also adds its ``ds @ k`` into an fp32 accumulator with float atomics (zeroed
  by the small kernel that computes ``delta = rowsum(dO * O)`` first), cast to the
  input dtype at the end: 5 matmuls per visible (row, key) pair.
* ``"split"`` (always in deterministic mode: atomics add in a varying order): a
  query-centric kernel for ``dq`` with the forward's iteration structure, launched
  first, which also stores ``delta`` of its rows; it computes ``QK^T`` and ``dO V^T``
  again, 7 matmuls per pair, but writes ``dq`` once with plain stores.

*Prefix dK/dV: atomics, or ordered adds (``deterministic``).* A stack slot receives
one add per prefix work item covering it: ``ceil(run_rows / prefix_item_rows)`` per
run that reads it, plus one per other run of the call with the same ancestor. With
float atomics (``tl.atomic_add``) their order varies between runs (fp32, ~1e-7
relative; issue 21's RL users need bitwise-equal reruns). In deterministic mode the
items of one cell add one at a time in work-table order: each waits for the cell's
ticket to reach its ``turn``, adds (still with the atomic instructions, so no partial
tile is held in registers: a load-add-store version spilled 300 bytes at head dim
128), and passes the ticket on; so every slot sums its terms in one fixed order. The
prefix items are laid out split-major (every chunk's first row split, then the
second...), so the items of one cell sit apart in the cost-sorted table and rarely
wait. Measured on an H100 (``results/h100/kernel_session2``): the dK/dV kernel
+1-4% against the atomics; own dK/dV and the split backward's dq are deterministic
in both modes. A
segmented reduction (partial tiles to scratch, summed per slot by a second launch)
would cost scratch of (prefix items x BLOCK_N x Hkv x D x 2) fp32 per layer (67 MB for
8 x 512 answers under a 2048-token prompt with 8 kv heads of dim 128) and a write
plus a re-read of every partial: more than the ordered adds cost.

``prefix_item_rows`` (None: per call) is the most rows per item, from 1024 down to
128, that still gives the dK/dV launch four programs per SM: a short prompt under many
long answers, or few kv heads, would otherwise leave SMs idle (grpo under 2 kv heads:
192 programs at 1024 rows on 132 SMs). H100, dK/dV ms at 128 / 256 / 1024 / 4096 rows /
per call: grpo 12/2 heads 0.402 / 0.411 / 0.436 / 1.225 / 0.415, grpo 32/8 1.087 /
0.994 / 0.982 / 1.170 / 0.999.

*Options* (:class:`dtree.ops.stack_attention.AttentionOptions`), each a constexpr
flag, so a model that uses none compiles the plain kernels: ``softcap`` applies
``cap * tanh(s / cap)`` to the scores (the backward multiplies dS by ``1 - tanh^2``);
``sinks`` add ``exp(sink)`` to each row's denominator (folded into the saved
log-sum-exp, so the backward needs nothing else; dsinks = -sum_rows p_sink * delta,
in torch); ``alibi_slopes`` subtract ``slope * (pos_q - pos_k)``; ``window`` masks keys
at ``pos_q - pos_k >= window``. Positions are depths: a run's prefix ranges are its
segments' whole root path, so a prefix slot's depth is its offset in the ranges and a
query row's is ``prefix_len + row - segment_start``. Values may be narrower than keys
(MLA): ``V_DIM`` is its own constexpr.

*Windows read only the in-window stack.* A forward/dq block starts each prefix range
at the first slot its shallowest row can see and skips the ranges it cannot; the dK/dV
table drops the prefix items none of whose rows see their slots, and skips row tiles
out of the window of an item's keys. A path 4x the window reads about a quarter of
its prefix.

Tiles: the work tables depend on the q-block rows (forward/dq) and the kv-block
slots (dK/dV), chosen on the host from the head dims and dtype only (:func:`_tiles`),
so every forest of one model uses the same compiled kernels. The inner step,
``num_warps`` and ``num_stages`` are fixed per (kernel, tile, whether softcap or ALiBi
is on): the fastest of an H100 sweep for plain calls, the autotuner's H200 picks
otherwise, the first that fits the GPU's shared memory (``_CANDIDATES``;
``benchmarks/kernel_registers.py`` checks them for spills, ``bench_triton_tuning.py``
times them).

*One compile per kernel variant per process.* Triton compiles a kernel again for
every new *specialization* of its non-constexpr arguments: an integer equal to 1 or
divisible by 16, a pointer aligned to 16 bytes. Arguments that change from call to
call are therefore ``do_not_specialize``: the call length ``T`` and ``window`` (any
int), and the int32 work and row tables, which are slices of one upload at offsets
that follow the call's segment and range counts (``range_lo`` starts at
``4 * (3 S + 2)`` bytes, ``seg_end`` at ``4 T``): an H100 recompiled ``_fwd_kernel``
and ``_dq_kernel`` in the second step of a fresh process when a new forest moved
``range_lo`` off a 16-byte boundary. The tables are read a scalar or one int32 row
tile at a time, so alignment hints buy nothing there. Strides stay specialized: for
head dims that are multiples of 16 they are divisible by 16 at every ``T``, and they
let the tile loads vectorize. ``tests/test_stack_attention_triton.py`` checks that two
different calls give every kernel the same specialization.

Runs on CUDA (compute capability >= 8.0) or, for tests, on CPU tensors under the
Triton interpreter (``TRITON_INTERPRET=1`` set before this module is imported).
"""


from __future__ import annotations

import torch

from ..backends import sm_count
from ..fast_launch import cdiv, fast_launch, next_power_of_2
from ..stack_ops.kv_stack import KVStack
from .options import PLAIN, AttentionOptions, StackSlots, check_stack_attention
from .output_memo import kept_or_computed
from .segment_layout import SegmentLayout
from .triton_backward import _delta_kernel
from .triton_common import (
    _INTERPRET,
    _LOG2E,
    BACKWARDS,
    DEFAULT_BACKWARD,
    DTYPES,
    MAX_HEAD_DIM,
    PREFIX_ITEM_ROWS,
    InterpreterTiles,
    _Tuning,
    require_triton,
)
from .triton_launch import _FLAGS, _auto_item_rows, _kv_items, _launch, _q_blocks, _row_tables, _runs, _tiles

__all__ = [
    "BACKWARDS", "DEFAULT_BACKWARD", "DTYPES", "MAX_HEAD_DIM", "PREFIX_ITEM_ROWS", "InterpreterTiles", "require_triton",
    "stack_attention_triton",
    "stack_attention_triton_tuned",
]


# --------------------------------------------------------------------------- autograd
def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with unit stride; other strides are free."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _common_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    return {
        "GROUP": q.shape[1] // k.shape[1],
        "HEAD_DIM": k.shape[-1],
        "BLOCK_D": max(16, next_power_of_2(k.shape[-1])),
        "V_DIM": v.shape[-1],
        "BLOCK_DV": max(16, next_power_of_2(v.shape[-1])),
        # fp32 inputs: true fp32 products, as torch's default matmul (no TF32)
        "DOT_PREC": "ieee" if q.dtype == torch.float32 else "tf32",
    }


class _Options:
    """The kernels' view of :class:`AttentionOptions`: constexpr flags, runtime
    scalars, and fp32 per-head vectors pre-multiplied by log2(e) (``placeholder``, any
    fp32 tensor, stands in for an absent one: the flag keeps it unread)."""

    def __init__(self, options: AttentionOptions, scale: float, placeholder: torch.Tensor):
        cap = options.softcap
        self.flags = {
            "HAS_SOFTCAP": cap is not None,
            "HAS_SINKS": options.sinks is not None,
            "HAS_ALIBI": options.alibi_slopes is not None,
            "HAS_WINDOW": options.window is not None,
        }
        self.qk_scale = scale * _LOG2E
        self.cap_in = scale / cap if cap is not None else 0.0
        self.cap_out = cap * _LOG2E if cap is not None else 0.0
        self.window = int(options.window) if options.window is not None else 0
        self.sinks2 = (
            options.sinks.detach().float().contiguous() * _LOG2E if options.sinks is not None else placeholder
        )
        slopes = options.alibi_slopes
        self.slopes2 = slopes.detach().float().contiguous() * _LOG2E if slopes is not None else placeholder

    def flags_for(self, kernel: str) -> dict:
        return {name: self.flags[name] for name in _FLAGS[kernel]}


class _StackAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, sinks, stack: KVStack, layer: int, layout: SegmentLayout, scale: float, options, tuning: _Tuning
    ):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        t, hq, _ = q.shape
        sk, sv = stack.k[layer], stack.v[layer]
        tiles = tuning.interpreter_tiles
        block_m, block_n = _tiles(k.shape[-1], v.shape[-1], q.dtype, tiles)
        out, lse = kept_or_computed(lambda: _forward(q, k, v, sk, sv, layout, scale, options, tuning, block_m),
                                    (t, hq, v.shape[-1]), (hq, t), q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.stack, ctx.layer, ctx.layout, ctx.scale, ctx.options = stack, layer, layout, scale, options
        ctx.tuning, ctx.blocks = tuning, (block_m, block_n)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        do = _unit_last(grad_out)
        t, hq, _ = q.shape
        opts = _Options(ctx.options, ctx.scale, lse)
        delta = torch.empty((hq, t), dtype=torch.float32, device=q.device)
        dq = dq_acc = None
        if ctx.needs_input_grad[0] and ctx.tuning.backward == "split":  # the dq kernel also stores delta
            dq = _backward_dq(ctx, q, k, v, out, do, lse, delta, opts)
        else:
            if ctx.needs_input_grad[0]:  # fused: the dK/dV kernel adds dq into dq_acc, which the delta kernel zeroes
                dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            _delta(q, k, v, out, do, delta, dq_acc)
        dk, dv = _backward_dkdv(ctx, q, k, v, do, lse, delta, opts, dq_acc)
        if dq_acc is not None:
            dq = dq_acc.to(q.dtype)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d out_r / d sink = -p_sink(r) * out_r, so dL/dsink = -sum_r p_sink(r) * delta_r
            p_sink = torch.exp2(opts.sinks2[:, None] - lse)
            dsinks = -(p_sink * delta).sum(1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def _forward(q, k, v, sk, sv, layout: SegmentLayout, scale: float, options, tuning: _Tuning, block_m: int):
    """(out [T, Hq, Dv], lse [Hq, T] float32, base 2) of the forward kernel."""
    t, hq, _ = q.shape
    tables = layout.device_tables(q.device)
    seg_start, _ = _row_tables(layout, q.device)
    q_blocks = _q_blocks(layout, q.device, block_m)
    out = torch.empty((t, hq, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, t), dtype=torch.float32, device=q.device)
    opts = _Options(options, scale, lse)
    meta = _common_meta(q, k, v)
    args = (
        q, k, v, sk, sv, out, lse, q_blocks, tables["range_lo"], tables["range_hi"], seg_start, opts.sinks2,
        opts.slopes2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        sk.stride(0), sk.stride(1), sv.stride(0), sv.stride(1), out.stride(0), out.stride(1),
        t, opts.qk_scale, opts.cap_in, opts.cap_out, opts.window,
    )
    _launch("fwd", block_m, q.dtype, (q_blocks.shape[0], hq), args,
            {"BLOCK_M": block_m, **meta, **opts.flags_for("fwd")}, tuning)
    return out, lse


def _delta(q, k, v, out, do, delta, dq_acc: torch.Tensor | None) -> None:
    """``delta`` [Hq, T] of the backward; zeroes ``dq_acc`` [T, Hq, Dk] (fp32) unless None."""
    t, hq, _ = q.shape
    meta = _common_meta(q, k, v)
    acc = delta if dq_acc is None else dq_acc  # unread without ZERO_DQ: any fp32 tensor
    strides = (0, 0) if dq_acc is None else (dq_acc.stride(0), dq_acc.stride(1))
    fast_launch(
        _delta_kernel, (cdiv(t, 64), hq),
        out, do, delta, acc, out.stride(0), out.stride(1), do.stride(0), do.stride(1), *strides, t,
        HEAD_DIM=meta["HEAD_DIM"], BLOCK_D=meta["BLOCK_D"], V_DIM=meta["V_DIM"], BLOCK_DV=meta["BLOCK_DV"],
        BLOCK_M=64, ZERO_DQ=dq_acc is not None,
    )


def _backward_dq(ctx, q, k, v, out, do, lse, delta, opts: _Options) -> torch.Tensor:
    """dq (and ``delta``, which the dq kernel stores) of :class:`_StackAttention`."""
    stack, layer, layout = ctx.stack, ctx.layer, ctx.layout
    block_m, _ = ctx.blocks
    device = q.device
    tables = layout.device_tables(device)
    seg_start, _ = _row_tables(layout, device)
    q_blocks = _q_blocks(layout, device, block_m)
    sk, sv = stack.k[layer], stack.v[layer]
    dq = torch.empty(q.shape, dtype=q.dtype, device=device)
    args = (
        q, k, v, sk, sv, out, do, lse, delta, dq, q_blocks, tables["range_lo"], tables["range_hi"], seg_start,
        opts.slopes2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        sk.stride(0), sk.stride(1), sv.stride(0), sv.stride(1), out.stride(0), out.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        q.shape[0], opts.qk_scale, ctx.scale, opts.cap_in, opts.cap_out, opts.window,
    )
    _launch("dq", block_m, q.dtype, (q_blocks.shape[0], q.shape[1]), args,
            {"BLOCK_M": block_m, **_common_meta(q, k, v), **opts.flags_for("dq")}, ctx.tuning)
    return dq


def _backward_dkdv(
    ctx, q, k, v, do, lse, delta, opts: _Options, dq_acc: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The own dk, dv of :class:`_StackAttention`; adds the prefix dK/dV into the stack,
    and, unless ``dq_acc`` is None (the fused backward), dq into ``dq_acc``."""
    stack, layer, layout, tuning = ctx.stack, ctx.layer, ctx.layout, ctx.tuning
    _, block_n = ctx.blocks
    device, hkv = q.device, k.shape[1]
    sk, sv = stack.k[layer], stack.v[layer]
    fused, stack_grad = dq_acc is not None, stack.has_grad
    with_prefix = stack_grad or fused  # prefix items: for the stack's dK/dV, or for dq
    if stack_grad:
        stack.grad_slots_through(_runs(layout)["slots_end"])  # the kernel adds into slots up to there
        gk, gv = stack.grad_k[layer], stack.grad_v[layer]
    else:  # nothing is added into the stack; any fp32 tensors stand in for the pointers
        gk = torch.empty((1, hkv, k.shape[-1]), dtype=torch.float32, device=device)
        gv = torch.empty((1, hkv, v.shape[-1]), dtype=torch.float32, device=device)
    seg_start, seg_end = _row_tables(layout, device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=device)
    item_rows = tuning.prefix_item_rows or layout.cached(
        ("triton", "item_rows", device, block_n, hkv),
        lambda: _auto_item_rows(_runs(layout), block_n, hkv, _sm_count(device)),
    )
    items = _kv_items(layout, device, block_n, with_prefix, ctx.options.window, item_rows)
    deterministic = tuning.deterministic and stack_grad
    # one ticket per stack cell of BLOCK_N slots and kv head, zero at launch
    if deterministic:
        cells = max(1, -(-_runs(layout)["slots_end"] // block_n))
        tickets = torch.zeros((cells, hkv), dtype=torch.int32, device=device)
    else:  # unread: any int32 tensor
        tickets = items
    dq_ptr = dq_acc if fused else gk  # unread without FUSED_DQ: any fp32 tensor
    args = (
        q, k, v, sk, sv, do, lse, delta, dk, dv, gk, gv, dq_ptr, items, seg_start, seg_end, opts.slopes2, tickets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        sk.stride(0), sk.stride(1), sv.stride(0), sv.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        gk.stride(0), gk.stride(1), gv.stride(0), gv.stride(1), dq_ptr.stride(0), dq_ptr.stride(1),
        q.shape[0], opts.qk_scale, ctx.scale, opts.cap_in, opts.cap_out, opts.window,
    )
    meta = {"BLOCK_N": block_n, **_common_meta(q, k, v), **opts.flags_for("dkdv"), "DETERMINISTIC": deterministic,
            "FUSED_DQ": fused, "STACK_GRAD": stack_grad or not fused}  # split: one variant (no prefix items without)
    _launch("fused" if fused else "dkdv", block_n, q.dtype, (items.shape[0], hkv), args, meta, tuning)
    return dk, dv


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 under the interpreter)."""
    if _INTERPRET or device.type != "cuda":
        return 8
    return sm_count(device)


def _check(q, k, v, slots: StackSlots, options: AttentionOptions) -> None:
    check_stack_attention(q, k, v, slots, options)
    stack, layout = slots.stack, slots.layout
    require_triton(q.device)
    if q.dtype not in DTYPES:
        raise TypeError(f"the 'triton' backend supports {DTYPES}, got {q.dtype}; use attention='sdpa'")
    if not (q.dtype == k.dtype == v.dtype == stack.dtype):
        raise TypeError(f"q, k, v and the stack must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {stack.dtype}")
    if max(k.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(
            f"the 'triton' backend supports head dims up to {MAX_HEAD_DIM}, got {k.shape[-1]} (keys) and "
            f"{v.shape[-1]} (values); use attention='sdpa'"
        )
    if not (q.device == k.device == v.device == stack.device):
        raise ValueError(
            f"q, k, v and the stack must be on one device, got {q.device}, {k.device}, {v.device}, {stack.device}"
        )
    if not (stack.k.is_contiguous() and stack.v.is_contiguous()) or (
        stack.has_grad and not (stack.grad_k.is_contiguous() and stack.grad_v.is_contiguous())
    ):
        raise ValueError("the stack buffers must be contiguous")
    if q.shape[0] == 0:
        raise ValueError("stack attention needs at least one query row")
    # the kernels index the stack without bounds checks
    slots_end = _runs(layout)["slots_end"]
    if slots_end > stack.capacity:
        raise ValueError(f"prefix ranges reach slot {slots_end}, past the stack capacity {stack.capacity}")


def _check_tuning(tuning: _Tuning) -> None:
    if tuning.backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS} (or None), got {tuning.backward!r}")
    if tuning.backward == "fused" and tuning.deterministic:
        raise ValueError(
            "backward='fused' adds dq with float atomics, whose order varies between runs; deterministic "
            "calls take backward='split' (or None)"
        )
    rows = tuning.prefix_item_rows
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"prefix_item_rows must be an int >= 1 (or None: chosen per call), got {rows!r}")
    tiles = tuning.interpreter_tiles
    if not isinstance(tiles, InterpreterTiles):
        raise ValueError(f"interpreter_tiles must be an InterpreterTiles, got {type(tiles).__name__}")
    for name in ("q_block", "kv_block", "inner"):
        t = getattr(tiles, name)
        if isinstance(t, bool) or not isinstance(t, int) or t < 16 or t & (t - 1):
            raise ValueError(f"interpreter_tiles.{name} must be a power of two >= 16, got {t!r}")


def stack_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions = PLAIN
) -> torch.Tensor:
    """Fused attention of all packed segments over (stack prefix + own K/V): the
    ``triton`` backend (shapes, arguments and gradients in
    :mod:`dtree.ops.stack_attention.options`; any q/k/v strides, a unit last stride is
    fastest). ``stack.k/v[layer]`` hold the ancestors at ``layout.prefix_ranges``; other
    slots may hold anything and are not read. ``options.deterministic`` adds the prefix
    dK/dV in a fixed order (bitwise-reproducible gradients) instead of with float atomics.
    The prefix dK/dV go into ``stack.grad_k/grad_v[layer]`` in float32."""
    return stack_attention_triton_tuned(q, k, v, slots, options)


def stack_attention_triton_tuned(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: StackSlots,
    options: AttentionOptions = PLAIN,
    *,
    prefix_item_rows: int | None = None,
    interpreter_tiles: InterpreterTiles = InterpreterTiles(),
    configs: tuple = (),
    backward: str | None = None,
) -> torch.Tensor:
    """:func:`stack_attention_triton` with the knobs that tests and benchmarks vary
    (``benchmarks/bench_triton_tuning.py``); not a public entry point.

    Args:
        prefix_item_rows: query rows per prefix dK/dV work item (see the module
            docstring; None: chosen per call for the GPU's SMs).
        interpreter_tiles: the tiles under the Triton interpreter.
        configs: ``((kernel, (inner, num_warps, num_stages)), ...)`` forced for "fwd",
            "dq", "dkdv", "fused" instead of the fixed ones.
        backward: "fused" (dq added by the dK/dV kernel with float atomics) or "split"
            (a dq kernel of its own); None: "split" when deterministic, else
            :data:`DEFAULT_BACKWARD`. "fused" with ``deterministic`` raises.
    """
    _check(q, k, v, slots, options)
    deterministic = options.deterministic
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if backward is None:
        backward = "split" if deterministic else DEFAULT_BACKWARD
    tuning = _Tuning(prefix_item_rows, interpreter_tiles, bool(deterministic), tuple(configs), backward)
    _check_tuning(tuning)
    scale = options.softmax_scale(q.shape[-1])
    return _StackAttention.apply(
        q, k, v, options.sinks, slots.stack, slots.layer, slots.layout, scale, options, tuning
    )
