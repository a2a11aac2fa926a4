"""What every part of the fused ``triton`` stack-attention backend shares: the Triton
import (a clear ImportError naming the install command where it is missing), the
interpreter switch, the dtypes and head dims the kernels take, the tuning knobs of one
call, :func:`require_triton`, and the ``@triton.jit`` helpers of the forward and
backward kernels. The design is in :mod:`dtree.ops.stack_attention.triton_autograd`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the runtime's "auto" backend catches this and falls back to sdpa
    raise ImportError(
        "the fused 'triton' stack attention backend needs Triton: pip install triton "
        "(or pip install 'dtree[triton]'); attention='sdpa' works without it"
    ) from e



__all__ = ["BACKWARDS", "DEFAULT_BACKWARD", "DTYPES", "MAX_HEAD_DIM", "PREFIX_ITEM_ROWS", "InterpreterTiles", "require_triton"]

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
    :func:`dtree.ops.stack_attention.triton_launch._auto_item_rows`. ``configs``: ``((kernel, (inner, warps, stages)), ...)``
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
