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

import os
from dataclasses import dataclass

import numpy as np
import torch

from ...kv_stack import KVStack
from ...transfer import upload
from .options import PLAIN, AttentionOptions, StackSlots, check_stack_attention
from .segment_layout import SegmentLayout

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the runtime's "auto" backend catches this and falls back to sdpa
    raise ImportError(
        "the fused 'triton' stack attention backend needs Triton: pip install triton "
        "(or pip install 'dtree[triton]'); attention='sdpa' works without it"
    ) from e

__all__ = [
    "BACKWARDS", "DEFAULT_BACKWARD", "DTYPES", "MAX_HEAD_DIM", "PREFIX_ITEM_ROWS", "InterpreterTiles", "require_triton",
    "stack_attention_triton",
    "stack_attention_triton_tuned",
]

# Read once, like triton.jit does when it decorates the kernels below.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _patch_interpreter_for_numpy() -> None:
    """Triton 3.6's interpreter calls int() on (1,)-shaped arrays, which NumPy >= 2.4
    refuses: give its tensors an ``__index__`` (a no-op where NumPy still allows it)."""
    try:
        int(np.ones(1))
    except TypeError:
        from triton.runtime import interpreter

        original = interpreter._patch_lang_tensor
        if getattr(original, "_dtree_patched", False):
            return

        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        patched._dtree_patched = True
        interpreter._patch_lang_tensor = patched


if _INTERPRET:
    _patch_interpreter_for_numpy()

# what the kernels run (the registry checks a model against these)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634

# Query rows per prefix dK/dV work item, the default of ``prefix_item_rows`` (see the
# module docstring).
PREFIX_ITEM_ROWS = 1024

# The backward schemes (``backward=``): "fused" adds dq from the dK/dV kernel with
# float atomics (5 matmuls per visible pair), "split" runs a dq kernel of its own (7
# matmuls, no float atomics on dq). Deterministic calls always run "split".
BACKWARDS = ("fused", "split")
# The scheme of calls that name none (and are not deterministic). Predicted faster on
# an H100 (benchmarks/PERF_NOTES.md, issue 17 kernel session 4); kernel_session.sh
# times both, and this line follows the measurement.
DEFAULT_BACKWARD = "fused"


@dataclass(frozen=True)
class InterpreterTiles:
    """Tiles under the Triton interpreter (powers of two >= 16): small, so that tests
    with ~60-row segments cross many tile boundaries. ``q_block``/``kv_block`` size
    the work tables; ``inner`` is the loop step. Compiled kernels ignore them."""

    q_block: int = 16
    kv_block: int = 16
    inner: int = 16


@dataclass(frozen=True)
class _Tuning:
    """The knobs of one call, for the autograd function. ``prefix_item_rows`` None:
    :func:`_auto_item_rows`. ``configs``: ``((kernel, (inner, warps, stages)), ...)``
    forced instead of the fixed candidates (benchmarks sweep them). ``backward``: one of
    :data:`BACKWARDS`, already resolved."""

    prefix_item_rows: int | None = None
    interpreter_tiles: InterpreterTiles = InterpreterTiles()
    deterministic: bool = False
    configs: tuple = ()
    backward: str = "split"

# Work item kinds of the dK/dV kernel.
_OWN, _PREFIX = 0, 1


def require_triton(device: torch.device | str) -> None:
    """Raise unless the fused kernels can run on ``device``.

    Importing this module already raised ImportError (naming ``pip install triton``)
    if Triton is missing.

    Raises:
        RuntimeError: ``device`` is not a CUDA device (and the Triton interpreter is not
            enabled), or the GPU is older than compute capability 8.0.
    """
    if _INTERPRET:
        return
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(
            f"the 'triton' stack attention backend runs on CUDA devices, got {device}; "
            "use attention='sdpa' (or set TRITON_INTERPRET=1 to run the kernels on CPU for testing)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("the 'triton' stack attention backend needs CUDA, but torch.cuda.is_available() is False")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise RuntimeError(
            f"the 'triton' stack attention backend needs compute capability >= 8.0, "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}; use attention='sdpa'"
        )


# --------------------------------------------------------------------------- kernels
# Conventions: rows/slots index the token axis; the key/query head dim HEAD_DIM is
# padded to BLOCK_D and the value head dim V_DIM to BLOCK_DV (powers of two) with
# masked loads; scores are kept in base 2 (qk_scale = softmax scale * log2(e); the
# sinks and ALiBi slopes arrive multiplied by log2(e)) and lse is base 2 too. Every
# load of a partial tile uses other=0 and every score outside the visible set is -inf
# (forward) or its probability is replaced by 0 (backward), so stack slots outside the
# ranges are never read and no 0 * NaN or inf * 0 can reach a stored value.
#
# Each loop visits its keys (or rows) once, and masks a tile only when a runtime test
# says some of it is invisible (a range tail, a tile crossing segments, the
# diagonal, the window's edge). One loop with a uniform branch instead of separate
# masked/unmasked loops keeps one copy of the pipelined body: the dK/dV kernel at head
# dim 128 otherwise spills registers (ptxas, sm_90: 240 registers and no spill for
# BLOCK_N=128, BLOCK_M=32, 8 warps, against 328 bytes of spill with three loops).
#
# Positions (ALiBi, window): ``dist`` = pos_q - pos_k. For prefix keys it is the
# query's depth minus the slot's; for own keys, which a row sees only in its own
# segment, it is row - key.


@triton.jit
def _load_tile(base, idx, stride, idx_ok, offs_d, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """[len(idx), BLOCK] tile of rows ``idx`` (row stride ``stride``, unit dim stride);
    rows with ``idx_ok`` False and dims past DIM read as 0."""
    ptrs = base + idx.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if BLOCK == DIM:
        tile = tl.load(ptrs, mask=idx_ok[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=idx_ok[:, None] & (offs_d < DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _store_tile(base, idx, stride, idx_ok, offs_d, value, DIM: tl.constexpr):
    ptrs = base + idx.to(tl.int64)[:, None] * stride + offs_d[None, :]
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=idx_ok[:, None] & (offs_d < DIM)[None, :])


@triton.jit
def _tanh(x):
    """tanh through exp2 (libdevice's tanh does not run under the interpreter):
    (1 - e) / (1 + e) with e = exp(-2|x|), within ~1e-7 of tanh."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _logits(dot, dist, qk_scale, cap_in, cap_out, slope, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Base-2 logits of the raw products ``dot`` = q . k, and the ``tanh`` the softcap
    backward needs (``dot`` itself without softcap). Softcap: ``cap_in`` = scale / cap,
    ``cap_out`` = cap * log2(e). ALiBi: ``slope`` = the head's slope * log2(e)."""
    if HAS_SOFTCAP:
        t = _tanh(dot * cap_in)
        s = t * cap_out
    else:
        t = dot
        s = dot * qk_scale
    if HAS_ALIBI:
        s = s - slope * dist.to(tl.float32)
    return s, t


@triton.jit
def _visible(cols, col_ok, rows, row_seg_start, dist, window, OWN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] mask of the keys ``cols`` that query ``rows`` see: prefix
    keys (OWN False) are seen by every row; own keys by rows of their segment at or
    after them; with a window, only at ``dist < window``."""
    if OWN:
        mask = col_ok[None, :] & (cols[None, :] >= row_seg_start[:, None]) & (cols[None, :] <= rows[:, None])
    else:
        mask = col_ok[None, :] & (rows[:, None] >= 0)
    if HAS_WINDOW:
        mask = mask & (dist < window)
    return mask


@triton.jit
def _q_block(QBLOCKS, SEG_START, blk):
    """Work item ``blk`` of the forward/dq table: rows ``[r0, r1)`` of one run, its
    prefix ranges ``[g0, g1)`` of ``plen`` slots, and its own keys ``[ss_min, r1)`` of
    which ``[ss_max, r0 + 1)`` are seen by every row (at or after every row's segment
    start, at or before every row). Rows' depths lie in ``[q_min, q_max]``: a block
    holding a segment start has a row at depth ``plen``; ``q_max`` is an upper bound."""
    r0 = tl.load(QBLOCKS + 5 * blk)
    r1 = tl.load(QBLOCKS + 5 * blk + 1)
    g0 = tl.load(QBLOCKS + 5 * blk + 2)
    g1 = tl.load(QBLOCKS + 5 * blk + 3)
    plen = tl.load(QBLOCKS + 5 * blk + 4)
    ss_min = tl.load(SEG_START + r0)
    ss_max = tl.load(SEG_START + r1 - 1)
    q_min = plen + tl.where(ss_min == ss_max, r0 - ss_min, 0)
    q_max = plen + r1 - 1 - ss_min
    return r0, r1, g0, g1, plen, ss_min, ss_max, q_min, q_max


@triton.jit
def _prefix_span(lo, hi, depth, q_min, q_max, window, HAS_WINDOW: tl.constexpr):
    """(first slot to read, first slot every row sees) of the prefix range ``[lo, hi)``
    whose slot ``lo`` is at ``depth``: with a window, slots at depth <= q_min - window
    are seen by no row of the block and are not read at all."""
    first = lo
    full = lo
    if HAS_WINDOW:
        first = tl.maximum(lo, lo - depth + q_min - window + 1)
        full = tl.maximum(lo, lo - depth + q_max - window + 1)
    return first, full


@triton.jit
def _own_span(ss_min, ss_max, r0, r1, window, HAS_WINDOW: tl.constexpr):
    """(first own key to read, first own key every row sees) of a q block."""
    first = ss_min
    full = ss_max
    if HAS_WINDOW:
        first = tl.maximum(ss_min, r0 - window + 1)
        full = tl.maximum(ss_max, r1 - window)
    return first, full


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, stride_kt, stride_vt, kv_lo, kv_hi, full_lo, full_hi, rows, row_seg_start, qpos, kshift,
    offs_d, offs_dv, qk_scale, cap_in, cap_out, slope, window,
    OWN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Online-softmax update over keys ``[kv_lo, kv_hi)`` of ``K, V`` (already offset to
    the kv head), at positions ``cols + kshift``. Key tiles inside ``[full_lo, full_hi)``
    are seen whole by every row and skip the mask."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_hi
        k = _load_tile(K, cols, stride_kt, col_ok, offs_d, HEAD_DIM, BLOCK_D)
        dist = qpos[:, None] - (cols + kshift)[None, :]
        s, _ = _logits(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), dist, qk_scale, cap_in, cap_out, slope,
                       HAS_SOFTCAP, HAS_ALIBI)
        if (start < full_lo) | (start + BLOCK_N > full_hi):
            s = tl.where(_visible(cols, col_ok, rows, row_seg_start, dist, window, OWN, HAS_WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V, cols, stride_vt, col_ok, offs_dv, V_DIM, BLOCK_DV)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["T", "window", "QBLOCKS", "RANGE_LO", "RANGE_HI", "SEG_START"])
def _fwd_kernel(
    Q, K, V, SK, SV, O, LSE, QBLOCKS, RANGE_LO, RANGE_HI, SEG_START, SINK_LOGITS, ALIBI_SLOPES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_skt, stride_skh, stride_svt, stride_svh,
    stride_ot, stride_oh,
    T, qk_scale, cap_in, cap_out, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Grid (q blocks, q heads). QBLOCKS[b] = (r0, r1, g0, g1, plen): rows ``[r0, r1)`` of
    one run and its prefix ranges ``RANGE_LO/HI[g0:g1]`` of ``plen`` slots."""
    blk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    r0, r1, g0, g1, plen, ss_min, ss_max, q_min, q_max = _q_block(QBLOCKS, SEG_START, blk)

    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + head * stride_qh, rows, stride_qt, row_ok, offs_d, HEAD_DIM, BLOCK_D)
    row_seg_start = tl.load(SEG_START + rows, mask=row_ok, other=0)
    qpos = plen + rows - row_seg_start
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI_SLOPES + head)

    # Finite start for the running max: a row that sees nothing in the first tiles
    # (a later segment of a packed tile) keeps alpha = exp2(0) and p = exp2(-inf) = 0
    # instead of exp2(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    SKh = SK + kv_head * stride_skh
    SVh = SV + kv_head * stride_svh
    depth = g0 * 0
    for g in range(g0, g1):
        lo = tl.load(RANGE_LO + g)
        hi = tl.load(RANGE_HI + g)
        first, full = _prefix_span(lo, hi, depth, q_min, q_max, window, HAS_WINDOW)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, SKh, SVh, stride_skt, stride_svt, first, hi, full, hi, rows,
                                   row_seg_start, qpos, depth - lo, offs_d, offs_dv, qk_scale, cap_in, cap_out, slope,
                                   window, False, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, DOT_PREC, HAS_SOFTCAP,
                                   HAS_ALIBI, HAS_WINDOW)
        depth += hi - lo
    first, full = _own_span(ss_min, ss_max, r0, r1, window, HAS_WINDOW)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + kv_head * stride_kh, V + kv_head * stride_vh, stride_kt,
                               stride_vt, first, r1, full, r0 + 1, rows, row_seg_start, rows, 0, offs_d, offs_dv,
                               qk_scale, cap_in, cap_out, slope, window, True, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                               BLOCK_N, DOT_PREC, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
    if HAS_SINKS:  # one more term of the denominator, with no value
        sink = tl.load(SINK_LOGITS + head)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new

    # every valid row sees at least its own key, so l_i > 0 there
    _store_tile(O + head * stride_oh, rows, stride_ot, row_ok, offs_dv, acc / l_i[:, None], V_DIM)
    tl.store(LSE + head * T + rows, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit(do_not_specialize=["T"])
def _delta_kernel(
    O, DO, DELTA, DQ_ACC, stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh, T,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    """delta[h, r] = sum_d O[r, h, d] * dO[r, h, d] in fp32. Grid (cdiv(T, BLOCK_M), Hq).
    ZERO_DQ: also zero the fp32 dq accumulator ``DQ_ACC [T, Hq, HEAD_DIM]`` of the fused
    backward (its rows are visited here anyway: no memset launch of its own)."""
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _load_tile(O + head * stride_oh, rows, stride_ot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    do = _load_tile(DO + head * stride_doh, rows, stride_dot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    tl.store(DELTA + head * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_D)
        _store_tile(DQ_ACC + head * stride_dqh, rows, stride_dqt, row_ok, offs_d,
                    tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), HEAD_DIM)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Q, DO, LSE, DELTA, DQ, head, rows, row_ok, cols, col_ok, col_seg_end, is_prefix, dist_t, masked,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh, T, offs_d, offs_dv, qk_scale, sm_scale,
    cap_in, cap_out, slope, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    """dK/dV (transposed: keys x rows) of one row tile of query head ``head``.
    ``col_seg_end`` is 0 for prefix keys, whose mask is only the window. FUSED_DQ: also
    add this tile's dq (ds @ k, scaled) into the fp32 accumulator ``DQ`` with atomics."""
    q = _load_tile(Q + head * stride_qh, rows, stride_qt, row_ok, offs_d, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + head * stride_doh, rows, stride_dot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    lse = tl.load(LSE + head * T + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + head * T + rows, mask=row_ok, other=0.0)
    s_t, t_t = _logits(tl.dot(k, tl.trans(q), input_precision=DOT_PREC), dist_t, qk_scale, cap_in, cap_out, slope,
                       HAS_SOFTCAP, HAS_ALIBI)
    p_t = tl.math.exp2(s_t - lse[None, :])
    if masked:
        visible = (rows[None, :] >= cols[:, None]) & (rows[None, :] < col_seg_end[:, None])
        # prefix items (col_seg_end 0) are masked only for a window or ALiBi's last tile;
        # the plain kernel keeps the two terms out of its registers
        if FUSED_DQ:
            # dq reads every key column of the tile: columns past the item's keys (k = 0,
            # so p = exp2(-lse) there, which may overflow: inf * 0 in ds @ k) must be 0
            visible = (visible | is_prefix) & col_ok[:, None]
            if HAS_WINDOW:
                visible = visible & row_ok[None, :] & (dist_t < window)
            elif HAS_ALIBI:
                visible = visible & row_ok[None, :]
        elif HAS_WINDOW:
            visible = (visible | (col_seg_end[:, None] == 0)) & row_ok[None, :] & (dist_t < window)
        elif HAS_ALIBI:
            visible = (visible | (col_seg_end[:, None] == 0)) & row_ok[None, :]
        p_t = tl.where(visible, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PREC)
    if FUSED_DQ:
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PREC)
        dq_ptrs = DQ + head * stride_dqh + rows.to(tl.int64)[:, None] * stride_dqt + offs_d[None, :]
        tl.atomic_add(dq_ptrs, dq * sm_scale, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["T", "window", "ITEMS", "SEG_START", "SEG_END"])
def _dkdv_kernel(
    Q, K, V, SK, SV, DO, LSE, DELTA, DK, DV, GK, GV, DQ, ITEMS, SEG_START, SEG_END, ALIBI_SLOPES, TICKETS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_skt, stride_skh, stride_svt, stride_svh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_gkt, stride_gkh, stride_gvt,
    stride_gvh, stride_dqt, stride_dqh,
    T, qk_scale, sm_scale, cap_in, cap_out, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, DETERMINISTIC: tl.constexpr,
    FUSED_DQ: tl.constexpr, STACK_GRAD: tl.constexpr,
):
    """Grid (work items, kv heads). ITEMS[i] = (kind, c0, c1, q0, q1, kshift, plen, turn):
    keys ``[c0, c1)`` (at most BLOCK_N; own rows of ``K, V`` or stack slots of ``SK, SV``
    at depths ``c + kshift``, inside one BLOCK_N cell of the stack) and the query rows
    ``[q0, q1)`` that may see them (of a run with ``plen`` prefix slots). Own items store
    dK/dV into ``DK, DV``; prefix items add them into ``GK, GV`` with atomics. dK/dV
    are accumulated transposed (keys x rows), as in FlashAttention-2.

    FUSED_DQ (the fused backward): every row tile also adds its dq = ds @ k into the
    fp32 accumulator ``DQ [T, Hq, HEAD_DIM]`` (zeroed by the delta kernel) with float
    atomics, as FlashAttention-2 does: 5 matmuls per (row, key) pair in one kernel
    instead of the split backward's 4 here and 3 in the dq kernel, whose QK^T and
    dO V^T are this kernel's again. Every tile with fewer than BLOCK_N keys is masked
    then (see :func:`_dkdv_tile`). Without STACK_GRAD (a stack without gradient
    buffers) the prefix items run only for their dq.

    DETERMINISTIC: the prefix items of one stack cell add one at a time, in their
    ``turn`` (0, 1, ... in work-table order): each waits until the cell's ticket in
    ``TICKETS`` ([cells, kv heads] int32, zero at launch) equals its turn, adds, and
    passes the ticket on, so every slot sums its terms in the table's order: bitwise
    reproducible. No deadlock: turns follow the program ids and blocks start in
    program-id order, so the item a block waits for has started (FlashAttention-2/3's
    deterministic backward relies on the same order)."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    kind = tl.load(ITEMS + 8 * item)
    c0 = tl.load(ITEMS + 8 * item + 1)
    c1 = tl.load(ITEMS + 8 * item + 2)
    q0 = tl.load(ITEMS + 8 * item + 3)
    q1 = tl.load(ITEMS + 8 * item + 4)
    kshift = tl.load(ITEMS + 8 * item + 5)
    plen = tl.load(ITEMS + 8 * item + 6)
    is_prefix = kind == 1
    is_own = kind == 0

    cols = c0 + tl.arange(0, BLOCK_N)
    col_ok = cols < c1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # a select of base and stride rather than an if/else around two loads: one copy of
    # the load keeps the tile's registers down
    k_base = tl.where(is_prefix, SK + kv_head * stride_skh, K + kv_head * stride_kh)
    v_base = tl.where(is_prefix, SV + kv_head * stride_svh, V + kv_head * stride_vh)
    k = _load_tile(k_base, cols, tl.where(is_prefix, stride_skt, stride_kt), col_ok, offs_d, HEAD_DIM, BLOCK_D)
    v = _load_tile(v_base, cols, tl.where(is_prefix, stride_svt, stride_vt), col_ok, offs_dv, V_DIM, BLOCK_DV)
    # own key c is seen by rows [c, seg_end[c]); 0 for prefix items and columns past c1
    col_seg_end = tl.load(SEG_END + cols, mask=col_ok & is_own, other=0)
    kpos = cols + kshift  # own items: kshift = 0 and positions are rows

    # Row tiles start on the grid q0 + j * BLOCK_M (q0 = c0 for own items). A tile
    # starting at s is unmasked when s >= c1 - 1 (every row is at or after every key),
    # s + BLOCK_M <= seg_end[c0] (every row is in the segment of every key) and, with
    # a window, s + BLOCK_M <= c0 + window: the tiles in [fa, fb). Own rows past
    # c1 - 1 + window see none of the keys. Prefix items see every row: [fa, fb) =
    # [q0, q1), and their padded rows past q1 read q = dO = lse = delta = 0, so
    # p = exp2(-slope * dist) <= 1 there (dist > 0) and both products below vanish;
    # with ALiBi the tile holding q1 is masked anyway, against negative slopes.
    # Columns past c1 read k = v = 0; whatever they accumulate stays in their own rows
    # of dk/dv, which are never stored.
    se_min = tl.load(SEG_END + c0, mask=is_own, other=0)
    fb_end = se_min
    if HAS_WINDOW:
        q1 = tl.where(is_own, tl.minimum(q1, c1 - 1 + window), q1)
        fb_end = tl.minimum(se_min, c0 + window)
    fa = tl.where(is_prefix, q0, tl.minimum(c0 + (c1 - 1 - c0 + BLOCK_M - 1) // BLOCK_M * BLOCK_M, q1))
    fb = tl.where(is_prefix, q1, tl.maximum(fa, c0 + (fb_end - c0) // BLOCK_M * BLOCK_M))
    k_first = c0 + kshift
    k_last = c1 - 1 + kshift
    partial = c1 - c0 < BLOCK_N  # fused: masked tiles (unused otherwise)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI_SLOPES + head)
        for start in range(q0, q1, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < q1
            row_seg_start = tl.load(SEG_START + rows, mask=row_ok & is_prefix, other=0)
            qpos = tl.where(is_prefix, plen + rows - row_seg_start, rows)
            dist_t = qpos[None, :] - kpos[:, None]
            masked = (start < fa) | (start >= fb)
            if FUSED_DQ:
                masked = masked | partial
            if HAS_ALIBI:
                masked = masked | (start + BLOCK_M > q1)
            if HAS_WINDOW:
                # a run's rows restart at depth plen in every segment, so bound each tile
                q_lo = tl.min(tl.where(row_ok, qpos, 1 << 30), 0)
                q_hi = tl.max(tl.where(row_ok, qpos, -(1 << 30)), 0)
                masked = masked | (q_hi - k_first >= window)
                if q_lo - k_last < window:  # some row of the tile sees some key
                    dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, DQ, head, rows, row_ok, cols, col_ok,
                                        col_seg_end, is_prefix, dist_t, masked, stride_qt, stride_qh, stride_dot,
                                        stride_doh, stride_dqt, stride_dqh, T, offs_d, offs_dv, qk_scale, sm_scale,
                                        cap_in, cap_out, slope, window, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                                        DOT_PREC, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW, FUSED_DQ)
            else:
                dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, DQ, head, rows, row_ok, cols, col_ok, col_seg_end,
                                    is_prefix, dist_t, masked, stride_qt, stride_qh, stride_dot, stride_doh,
                                    stride_dqt, stride_dqh, T, offs_d, offs_dv, qk_scale, sm_scale, cap_in, cap_out,
                                    slope, window, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, DOT_PREC, HAS_SOFTCAP,
                                    HAS_ALIBI, HAS_WINDOW, FUSED_DQ)
    dk = dk * sm_scale

    if is_prefix:
        if STACK_GRAD:
            _add_prefix_grads(GK, GV, TICKETS, ITEMS, item, c0, cols, col_ok, kv_head, offs_d, offs_dv, dk, dv,
                              stride_gkt, stride_gkh, stride_gvt, stride_gvh, HEAD_DIM, V_DIM, BLOCK_N, DETERMINISTIC)
    else:
        _store_tile(DK + kv_head * stride_dkh, cols, stride_dkt, col_ok, offs_d, dk, HEAD_DIM)
        _store_tile(DV + kv_head * stride_dvh, cols, stride_dvt, col_ok, offs_dv, dv, V_DIM)


@triton.jit
def _add_prefix_grads(
    GK, GV, TICKETS, ITEMS, item, c0, cols, col_ok, kv_head, offs_d, offs_dv, dk, dv,
    stride_gkt, stride_gkh, stride_gvt, stride_gvh,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DETERMINISTIC: tl.constexpr,
):
    """Add a prefix item's dK/dV into the stack's fp32 gradients (see :func:`_dkdv_kernel`)."""
    # Other runs of this call, and later calls' descendants, add into the same slots.
    gk_offs = cols.to(tl.int64)[:, None] * stride_gkt + kv_head * stride_gkh + offs_d[None, :]
    gv_offs = cols.to(tl.int64)[:, None] * stride_gvt + kv_head * stride_gvh + offs_dv[None, :]
    gk_mask = col_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    gv_mask = col_ok[:, None] & (offs_dv < V_DIM)[None, :]
    if DETERMINISTIC:  # wait for this item's turn among the prefix items of its stack cell
        ticket = TICKETS + (c0 // BLOCK_N) * tl.num_programs(1) + kv_head
        turn = tl.load(ITEMS + 8 * item + 7)
        while tl.atomic_cas(ticket, turn, turn, sem="acquire") != turn:
            pass
    tl.atomic_add(GK + gk_offs, dk.to(GK.dtype.element_ty), mask=gk_mask, sem="relaxed")
    tl.atomic_add(GV + gv_offs, dv.to(GV.dtype.element_ty), mask=gv_mask, sem="relaxed")
    if DETERMINISTIC:
        tl.debug_barrier()  # every thread's adds are issued before the ticket moves on
        tl.atomic_xchg(ticket, turn + 1, sem="release")


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, K, V, stride_kt, stride_vt, kv_lo, kv_hi, full_lo, full_hi, rows, row_seg_start, qpos,
    kshift, offs_d, offs_dv, qk_scale, cap_in, cap_out, slope, window,
    OWN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """dQ (unscaled) over keys ``[kv_lo, kv_hi)``, tiles as :func:`_fwd_inner`. Masked
    probabilities are replaced by 0 after exp2, which also drops an overflow from a
    zero-filled column (ds * k would be inf * 0)."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_hi
        k = _load_tile(K, cols, stride_kt, col_ok, offs_d, HEAD_DIM, BLOCK_D)
        v = _load_tile(V, cols, stride_vt, col_ok, offs_dv, V_DIM, BLOCK_DV)
        dist = qpos[:, None] - (cols + kshift)[None, :]
        s, t = _logits(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), dist, qk_scale, cap_in, cap_out, slope,
                       HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse[:, None])
        if (start < full_lo) | (start + BLOCK_N > full_hi):
            p = tl.where(_visible(cols, col_ok, rows, row_seg_start, dist, window, OWN, HAS_WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit(do_not_specialize=["T", "window", "QBLOCKS", "RANGE_LO", "RANGE_HI", "SEG_START"])
def _dq_kernel(
    Q, K, V, SK, SV, O, DO, LSE, DELTA, DQ, QBLOCKS, RANGE_LO, RANGE_HI, SEG_START, ALIBI_SLOPES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_skt, stride_skh, stride_svt, stride_svh,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    T, qk_scale, sm_scale, cap_in, cap_out, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Grid (q blocks, q heads), same work table and key tiles as :func:`_fwd_kernel`.
    Also stores ``DELTA`` = rowsum(O * dO) of its rows, which the dK/dV kernel (launched
    after it) reads: no launch of its own. Sinks need nothing here: they are in ``LSE``."""
    blk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    r0, r1, g0, g1, plen, ss_min, ss_max, q_min, q_max = _q_block(QBLOCKS, SEG_START, blk)

    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + head * stride_qh, rows, stride_qt, row_ok, offs_d, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + head * stride_doh, rows, stride_dot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    lse = tl.load(LSE + head * T + rows, mask=row_ok, other=0.0)
    o = _load_tile(O + head * stride_oh, rows, stride_ot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + head * T + rows, delta, mask=row_ok)
    row_seg_start = tl.load(SEG_START + rows, mask=row_ok, other=0)
    qpos = plen + rows - row_seg_start
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI_SLOPES + head)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    SKh = SK + kv_head * stride_skh
    SVh = SV + kv_head * stride_svh
    depth = g0 * 0
    for g in range(g0, g1):
        lo = tl.load(RANGE_LO + g)
        hi = tl.load(RANGE_HI + g)
        first, full = _prefix_span(lo, hi, depth, q_min, q_max, window, HAS_WINDOW)
        dq = _dq_inner(dq, q, do, lse, delta, SKh, SVh, stride_skt, stride_svt, first, hi, full, hi, rows,
                       row_seg_start, qpos, depth - lo, offs_d, offs_dv, qk_scale, cap_in, cap_out, slope, window,
                       False, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, DOT_PREC, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
        depth += hi - lo
    first, full = _own_span(ss_min, ss_max, r0, r1, window, HAS_WINDOW)
    dq = _dq_inner(dq, q, do, lse, delta, K + kv_head * stride_kh, V + kv_head * stride_vh, stride_kt, stride_vt,
                   first, r1, full, r0 + 1, rows, row_seg_start, rows, 0, offs_d, offs_dv, qk_scale, cap_in, cap_out,
                   slope, window, True, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, DOT_PREC, HAS_SOFTCAP, HAS_ALIBI,
                   HAS_WINDOW)
    _store_tile(DQ + head * stride_dqh, rows, stride_dqt, row_ok, offs_d, dq * sm_scale, HEAD_DIM)


# --------------------------------------------------------------------------- tuning
# Candidates as (inner tile, num_warps, num_stages), per kernel and per work-table tile
# (chosen on the host by _tiles). The inner tile is BLOCK_N (keys per step) for the
# forward and dq, BLOCK_M (rows per step) for dK/dV. The first candidate that fits the
# GPU's shared memory runs (fp32: the smallest first).
#
# 128-row/key tables (16-bit, head dims up to 128): first come the configs the
# autotuner picked on an H200 (bf16, 32/8 heads of 128, every layout of
# benchmarks/bench_stack_attention.py: benchmarks/results/stack_attention_nvidia_h200.md).
# They compile for sm_90 without register spills at head dims 64 and 128, with and
# without options (benchmarks/kernel_registers.py: ptxas through triton.compile, no GPU
# needed; the dK/dV kernel keeps 240 registers plain, 247-254 with options). The forward's 128-key step needs 224 KB of shared
# memory at head dim 128: an A100 (164 KB) falls through to the next candidate.
# 64 tables (fp32, head dims above 128): 8 warps first, the only configs found
# without spills at head dims 192/128 (MLA) and 256 in bf16 and 64/128 in fp32
# (4 warps spill 300-1700 bytes in dq and dK/dV there; 88 bytes remain in the MLA
# dK/dV kernel with every option on).
# Dropped for spilling at 128: 4 warps on 128-row tiles (forward and dq 136-352 bytes,
# dK/dV over 1 KB), 64-row inner tiles in dK/dV (16-1720 bytes) and 32-row ones with 3
# stages. (A timed autotuning path, DTREE_TRITON_AUTOTUNE=1, was removed: its first
# call compiled and timed every candidate and gave different results from the second.)
#
# Calls without softcap or ALiBi (the flags that add score transforms to the backward)
# first try _PLAIN_FIRST, the fastest configs of an H100 sweep (bf16, head dim 128,
# 12/2 and 32/8 heads, grpo and agentic: benchmarks/bench_triton_tuning.py,
# results/h100/kernel_session2): dq 128-key steps -22 to -26% against 64-key ones,
# dK/dV 64-row steps -12 to -21% against 32-row ones; the same winner on every layout
# and head count, so one config serves all. They run near the register limit (dq 255
# registers, no spill; dK/dV 192 bytes of spill at head dim 128, which cost less than
# the smaller step's extra passes over the keys); with softcap or ALiBi they would
# spill 340-620 bytes, so those calls keep the candidates below (dq's 64-key step with
# 3 stages, no spill with every option, came second in the sweep).
#
# The fused backward's dK/dV kernel ("fused": FUSED_DQ, not yet timed on a GPU) takes the
# dK/dV candidates, and the same 64-row step first for plain calls (ptxas, sm_90, head
# dim 128: 255 registers and 220 bytes of spill, against 192 for the split one); the
# 32-row step spills nothing (238 registers) but its dq product, 32 rows tall, is below
# the warpgroup MMA's 64 and runs on mma.sync. bench_triton_tuning.py times both.
_CANDIDATES = {
    ("fwd", 128): [(128, 8, 3), (64, 8, 3), (64, 8, 2), (32, 8, 2)],
    ("fwd", 64): [(64, 8, 2), (64, 4, 3), (32, 8, 2), (32, 4, 2)],
    ("dq", 128): [(64, 8, 3), (64, 8, 2), (32, 8, 3), (32, 8, 2)],
    ("dq", 64): [(32, 8, 2), (32, 4, 3), (64, 4, 3), (32, 4, 2)],
    ("dkdv", 128): [(32, 8, 2), (16, 8, 2), (16, 8, 3)],
    ("dkdv", 64): [(16, 8, 2), (16, 4, 2), (16, 4, 3), (32, 8, 2)],
    ("fused", 128): [(32, 8, 2), (16, 8, 2), (16, 8, 3)],
    ("fused", 64): [(16, 8, 2), (16, 4, 2), (16, 4, 3), (32, 8, 2)],
}
_PLAIN_FIRST = {("dq", 128): (128, 8, 2), ("dkdv", 128): (64, 8, 2), ("fused", 128): (64, 8, 2)}
_INNER_NAME = {"fwd": "BLOCK_N", "dq": "BLOCK_N", "dkdv": "BLOCK_M", "fused": "BLOCK_M"}
_TABLE_NAME = {"fwd": "BLOCK_M", "dq": "BLOCK_M", "dkdv": "BLOCK_N", "fused": "BLOCK_N"}
_FLAGS = {
    "fwd": ["HAS_SOFTCAP", "HAS_SINKS", "HAS_ALIBI", "HAS_WINDOW"],
    "dq": ["HAS_SOFTCAP", "HAS_ALIBI", "HAS_WINDOW"],
    "dkdv": ["HAS_SOFTCAP", "HAS_ALIBI", "HAS_WINDOW"],
    "fused": ["HAS_SOFTCAP", "HAS_ALIBI", "HAS_WINDOW"],
}


_KEYED_FLAGS = ("DETERMINISTIC", "STACK_GRAD")  # besides HAS_*: constexprs that change the config that fits
# "fused" is the dK/dV kernel with FUSED_DQ (the fused backward), tuned on its own
_KERNELS = {"fwd": _fwd_kernel, "dq": _dq_kernel, "dkdv": _dkdv_kernel, "fused": _dkdv_kernel}
# (kernel, table tile, dtype, device, head dims, group, flags) -> index of the first
# candidate that launched, so the fall-through below runs once per key
_FITTING: dict = {}


def _fixed_candidates(
    kernel: str, table: int, dtype: torch.dtype, score_transform: bool = False
) -> list[tuple[int, int, int]]:
    """The configs to try in order; ``score_transform``: the call has softcap or ALiBi."""
    candidates = _CANDIDATES[(kernel, table)]
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory: smallest first, 8 warps first
        return sorted(candidates, key=lambda c: (c[0], c[2], -c[1]))
    first = _PLAIN_FIRST.get((kernel, table))
    return candidates if first is None or score_transform else [first, *candidates]


def _launch(kernel: str, table: int, dtype: torch.dtype, grid: tuple, args: tuple, meta: dict, tuning: _Tuning) -> None:
    """Launch ``kernel`` ("fwd", "dq", "dkdv") on ``grid``: under the interpreter with
    its small tiles, else the config ``tuning`` forces, else the first fixed candidate
    that fits the device (a launch that runs out of shared memory raises before the
    kernel starts, so trying the next one adds nothing twice)."""
    name = _INNER_NAME[kernel]
    if _INTERPRET:
        _KERNELS[kernel][grid](*args, **meta, **{name: tuning.interpreter_tiles.inner})
        return
    forced = dict(tuning.configs).get(kernel)
    if forced is not None:
        inner, warps, stages = forced
        _KERNELS[kernel][grid](*args, **meta, **{name: inner}, num_warps=warps, num_stages=stages)
        return
    flags = tuple(sorted((f, v) for f, v in meta.items() if f.startswith("HAS_") or f in _KEYED_FLAGS))
    key = (kernel, table, dtype, args[0].device, meta["HEAD_DIM"], meta["V_DIM"], meta["GROUP"], *flags)
    transform = meta.get("HAS_SOFTCAP", False) or meta.get("HAS_ALIBI", False)
    candidates = _fixed_candidates(kernel, table, dtype, transform)
    for i in range(_FITTING.get(key, 0), len(candidates)):
        inner, warps, stages = candidates[i]
        try:
            _KERNELS[kernel][grid](*args, **meta, **{name: inner}, num_warps=warps, num_stages=stages)
        except triton.runtime.errors.OutOfResources:
            continue
        _FITTING[key] = i
        return
    raise RuntimeError(
        f"no config of the {kernel} kernel fits this GPU's shared memory (head dims {meta['HEAD_DIM']}/"
        f"{meta['V_DIM']}, {dtype}); use attention='sdpa'"
    )


def _tiles(head_dim: int, v_head_dim: int, dtype: torch.dtype, tiles: InterpreterTiles) -> tuple[int, int]:
    """(q-block rows of the forward/dq work items, kv-block keys of the dK/dV items).

    128 for 16-bit inputs; 64 for fp32 (shared memory) and for head dims above 128
    (registers of the [tile, 256] fp32 accumulators). The forest plays no part: a tile
    that followed the forest (it used to drop to 64 for short runs) compiled a second
    set of kernels whenever a later step's forest crossed the threshold."""
    if _INTERPRET:
        return tiles.q_block, tiles.kv_block
    if dtype == torch.float32 or max(head_dim, v_head_dim) > 128:
        return 64, 64
    return 128, 128


# --------------------------------------------------------------------------- tables
def _split(lo: np.ndarray, hi: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every ``[lo[i], hi[i])`` into pieces of at most ``step``: (owner i, start, end)."""
    n = -(-(hi - lo) // step)
    owner = np.repeat(np.arange(len(lo)), n)
    first = np.repeat(np.cumsum(n) - n, n)
    start = lo[owner] + (np.arange(int(n.sum())) - first) * step
    return owner, start, np.minimum(start + step, hi[owner])


def _split_on_grid(lo: np.ndarray, hi: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every non-empty ``[lo[i], hi[i])`` at the multiples of ``step``: (owner i,
    start, end), each piece inside one cell ``[j * step, (j + 1) * step)``."""
    first = lo // step
    n = np.where(hi > lo, -(-hi // step) - first, 0)
    owner = np.repeat(np.arange(len(lo)), n)
    cell = first[owner] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return owner, np.maximum(lo[owner], cell * step), np.minimum(hi[owner], (cell + 1) * step)


def _turns(table: np.ndarray, block_n: int) -> np.ndarray:
    """Each prefix item's turn among the prefix items of its stack cell (c0 // block_n),
    in table order (0 for own items)."""
    turn = np.zeros(len(table), dtype=np.int64)
    idx = np.flatnonzero(table[:, 0] == _PREFIX)
    if len(idx):
        cells = table[idx, 1] // block_n
        order = np.argsort(cells, kind="stable")
        sorted_cells = cells[order]
        starts = np.r_[0, np.flatnonzero(np.diff(sorted_cells)) + 1]
        group_start = np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        turn[idx[order]] = np.arange(len(order)) - group_start
    return turn


def _by_cost(table: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Most expensive work items first, so that the longest programs start early and
    the short ones fill the tail."""
    return np.ascontiguousarray(table[np.argsort(-cost, kind="stable")], dtype=np.int32)


def _runs(layout: SegmentLayout) -> dict:
    """Host description of the call: runs of consecutive non-empty segments with the
    same prefix ranges, and per-row segment bounds."""
    return layout.cached(("triton", "runs"), lambda: _build_runs(layout))


def _build_runs(layout: SegmentLayout) -> dict:
    q_off = np.asarray(layout.q_offsets, dtype=np.int64)
    lens = np.diff(q_off)
    flat = [(int(lo), int(hi)) for r in layout.prefix_ranges for lo, hi in r]
    bad = [(lo, hi) for lo, hi in flat if not 0 <= lo <= hi]
    if bad:
        raise ValueError(f"prefix ranges must satisfy 0 <= lo <= hi, got {bad[0]}")
    runs = layout.runs()
    ranges = [r.ranges for r in runs]
    # the run's ranges in the device tables (flattened per segment): its first segment's
    range_offsets = np.concatenate([[0], np.cumsum([len(r) for r in layout.prefix_ranges])]).astype(np.int64)
    first = np.asarray([r.segment for r in runs], dtype=np.int64)
    seg_start = np.repeat(q_off[:-1], lens)
    return {
        "row_lo": np.asarray([r.row_lo for r in runs], dtype=np.int64),
        "row_hi": np.asarray([r.row_hi for r in runs], dtype=np.int64),
        "range_begin": range_offsets[first],
        "range_end": range_offsets[first + 1],
        "prefix_len": np.asarray([sum(hi - lo for lo, hi in r) for r in ranges], dtype=np.int64),
        "ranges": ranges,
        "slots_end": max((hi for _, hi in flat), default=0),
        "seg_start": seg_start,
        "seg_end": np.repeat(q_off[1:], lens),
        "row_depth": np.arange(int(q_off[-1]), dtype=np.int64) - seg_start,  # minus the run's prefix_len
    }


def _row_tables(layout: SegmentLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``seg_start [T]`` and ``seg_end [T]`` of every row's segment."""

    def build():
        runs = _runs(layout)
        t = upload(np.stack([runs["seg_start"], runs["seg_end"]]).astype(np.int32), device)
        return t[0], t[1]

    return layout.cached(("triton", "rows", device), build)


def _q_blocks(layout: SegmentLayout, device: torch.device, block_m: int) -> torch.Tensor:
    """[NB, 5] int32 forward/dq work items: (r0, r1, range_begin, range_end, prefix_len)."""

    def build():
        runs = _runs(layout)
        run, r0, r1 = _split(runs["row_lo"], runs["row_hi"], block_m)
        plen = runs["prefix_len"][run]
        table = np.stack([r0, r1, runs["range_begin"][run], runs["range_end"][run], plen], axis=1)
        cost = (r1 - r0) * (plen + r1 - runs["seg_start"][r0])
        return upload(_by_cost(table, cost), device)

    return layout.cached(("triton", "q", device, block_m), build)


def _kv_items(
    layout: SegmentLayout,
    device: torch.device,
    block_n: int,
    with_prefix: bool,
    window: int | None = None,
    prefix_item_rows: int = PREFIX_ITEM_ROWS,
) -> torch.Tensor:
    """[NI, 8] int32 dK/dV work items: (kind, c0, c1, q0, q1, kshift, plen, turn).

    Own items: keys ``[c0, c1)`` of a run, queries ``[c0, seg_end[c1 - 1])``. Prefix
    items (only ``with_prefix``): stack slots ``[c0, c1)`` of one of the run's ranges
    inside one ``block_n`` cell of the stack (at depths ``c + kshift``), and at most
    ``prefix_item_rows`` of the run's rows; ``turn``: the item's place among the prefix
    items of its cell, in table order (the deterministic add's order). With a window,
    the ranges are cut from the first slot the run's shallowest row sees (no item
    reads a slot that no row of its run sees), and only the items some of whose rows
    see some of their slots are kept."""

    def build():
        runs = _runs(layout)
        run, c0, c1 = _split(runs["row_lo"], runs["row_hi"], block_n)
        q1 = runs["seg_end"][c1 - 1] if len(c1) else c1
        zeros = np.zeros_like(c0)
        tables = [np.stack([np.full_like(c0, _OWN), c0, c1, c0, q1, zeros, runs["prefix_len"][run]], axis=1)]
        costs = [(c1 - c0) * (q1 - c0)]
        if with_prefix:
            prefix = _prefix_items(runs, block_n, window, prefix_item_rows)
            if prefix is not None:
                tables.append(prefix)
                costs.append((prefix[:, 2] - prefix[:, 1]) * (prefix[:, 4] - prefix[:, 3]))
        table = np.concatenate(tables)
        table = table[np.argsort(-np.concatenate(costs), kind="stable")]
        table = np.concatenate([table, _turns(table, block_n)[:, None]], axis=1)
        return upload(np.ascontiguousarray(table, dtype=np.int32), device)

    return layout.cached(("triton", "kv", device, block_n, with_prefix, prefix_item_rows, window), build)


def _auto_item_rows(runs: dict, block_n: int, kv_heads: int, sms: int) -> int:
    """``prefix_item_rows`` for a call: the most rows per prefix item (1024, 512, 256,
    128) at which the dK/dV launch still has four programs per SM (one fits an SM at
    a time). Fewer rows per item only add ordered adds or atomics per slot, which
    cost little; too few programs leave SMs idle (a 2048-slot prompt under 8 x 512
    answers with 2 kv heads: 64 own + 64 prefix programs at 1024 rows on 132 SMs)."""
    own = int(np.sum(-(-(runs["row_hi"] - runs["row_lo"]) // block_n)))
    chunks = np.zeros(len(runs["row_lo"]), dtype=np.int64)
    for r, ranges in enumerate(runs["ranges"]):
        for lo, hi in ranges:
            if hi > lo:
                chunks[r] += -(-hi // block_n) - lo // block_n
    rows = runs["row_hi"] - runs["row_lo"]
    for item_rows in (1024, 512, 256):
        if (own + int(np.sum(chunks * -(-rows // item_rows)))) * kv_heads >= 4 * sms:
            return item_rows
    return 128


def _prefix_items(runs: dict, block_n: int, window: int | None, prefix_item_rows: int) -> np.ndarray | None:
    """[NP, 7] int64 prefix work items of :func:`_kv_items` (None when no run reads a
    prefix slot): every run's prefix ranges cut at the multiples of ``block_n``, times
    its rows cut into ``prefix_item_rows``."""
    flat = []  # (run, first slot to read, hi, kshift: depth of slot s is s + kshift)
    for r, ranges in enumerate(runs["ranges"]):
        depth, plen = 0, int(runs["prefix_len"][r])
        for lo, hi in ranges:
            # with a window, a run's shallowest row (depth plen) sees the deepest slots
            first = lo if window is None else max(lo, lo - depth + plen - window + 1)
            if first < hi:
                flat.append((r, first, hi, depth - lo))
            depth += hi - lo
    if not flat:
        return None
    f_run, f_lo, f_hi, f_shift = (np.asarray(x, dtype=np.int64) for x in zip(*flat))
    owner, s0, s1 = _split_on_grid(f_lo, f_hi, block_n)
    c_run, c_shift = f_run[owner], f_shift[owner]
    split_run, qa, qb = _split(runs["row_lo"], runs["row_hi"], prefix_item_rows)
    split_starts = qa
    n_splits = np.bincount(split_run, minlength=len(runs["row_lo"]))
    first_split = np.cumsum(n_splits) - n_splits
    rep = n_splits[c_run]
    chunk = np.repeat(np.arange(len(s0)), rep)
    rank = np.arange(int(rep.sum())) - np.repeat(np.cumsum(rep) - rep, rep)  # the split's place in its run
    # Split-major order (every chunk's first row split, then every chunk's second...):
    # the items of one stack cell, equal in cost, then sit apart in the cost-sorted
    # table, so the ordered adds of the deterministic mode rarely wait on each other.
    order = np.lexsort((chunk, rank))
    chunk, rank = chunk[order], rank[order]
    split = first_split[c_run[chunk]] + rank
    s0, s1, shift, qa, qb = s0[chunk], s1[chunk], c_shift[chunk], qa[split], qb[split]
    plen = runs["prefix_len"][split_run[split]]
    if window is not None and len(qa):
        # the splits tile the rows in order, so reduceat gives each one's shallowest row
        split_min = np.minimum.reduceat(runs["row_depth"], split_starts)
        keep = plen + split_min[split] - (s1 - 1 + shift) < window
        s0, s1, shift, qa, qb, plen = (x[keep] for x in (s0, s1, shift, qa, qb, plen))
    return np.stack([np.full_like(s0, _PREFIX), s0, s1, qa, qb, shift, plen], axis=1)


# --------------------------------------------------------------------------- autograd
def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with unit stride; other strides are free."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _common_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    return {
        "GROUP": q.shape[1] // k.shape[1],
        "HEAD_DIM": k.shape[-1],
        "BLOCK_D": max(16, triton.next_power_of_2(k.shape[-1])),
        "V_DIM": v.shape[-1],
        "BLOCK_DV": max(16, triton.next_power_of_2(v.shape[-1])),
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


def _delta(q, k, v, out, do, delta, dq_acc: torch.Tensor | None) -> None:
    """``delta`` [Hq, T] of the backward; zeroes ``dq_acc`` [T, Hq, Dk] (fp32) unless None."""
    t, hq, _ = q.shape
    meta = _common_meta(q, k, v)
    acc = delta if dq_acc is None else dq_acc  # unread without ZERO_DQ: any fp32 tensor
    strides = (0, 0) if dq_acc is None else (dq_acc.stride(0), dq_acc.stride(1))
    _delta_kernel[(triton.cdiv(t, 64), hq)](
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


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 under the interpreter)."""
    if _INTERPRET or device.type != "cuda":
        return 8
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


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
