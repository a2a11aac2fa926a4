"""Triton kernels of :mod:`dtree.ops.shared_input_linear`: the column sums of up to three
``[M, N_i]`` gradients (the projections' bias gradients), summed in float32.

The rows are split as well as the columns: one program per ``BLOCK_C`` columns of one
tensor and per split of ``rows_per_split`` rows. The first version gave each program a
32-column strip of all ``M`` rows: 64 programs for qwen2.5-1.5b's q, k, v (132 SMs on an
H100/H200), each reading 64 bytes per row, ran at ~400 GB/s, 18.8 ms of the default 64k
step (``PERF_NOTES.md``, session AN). Here a program reads 128 columns (256 bytes per row
in bf16) of its row split, and the splits are chosen to give the GPU several programs per
SM. With more than one split each program writes its float32 partial sums into a
``[splits, N_0 + N_1 + N_2]`` buffer and a second launch sums them in split order, so
the result does not depend on scheduling (no atomics); with one split the first launch
writes the sums itself. The final value is rounded once into the bias dtype (or added
into the biases' ``.grad`` inside a step, :mod:`dtree.ops.weight_grads`). ``M`` is not
specialized, so calls of every length share the compiled kernels.

Its torch twin is :func:`dtree.ops.shared_input_linear.interface.bias_grads_torch`;
``tests/test_shared_input_linear.py`` runs these kernels against it under the Triton
interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..backends import triton_runs_on as runs_on
from ..fast_launch import cdiv, fast_launch
from ..weight_grads import GradOutput

__all__ = ["column_sums", "runs_on"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_BLOCK_C = 32 if _INTERPRET else 128
_BLOCK_R = 16 if _INTERPRET else 32
_ROWS_PER_PROGRAM = 32 if _INTERPRET else 512  # rows a split aims at: ~128 KB read per program in bf16
_MAX_SPLITS = 4 if _INTERPRET else 64


@triton.jit
def _store_sums(dst, cols, cmask, total, add):
    # into the bias's .grad where ``add``: its value joins the float32 sum, one rounding
    total += tl.load(dst + cols, mask=cmask & (add != 0), other=0.0).to(tl.float32)
    tl.store(dst + cols, total.to(dst.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def _column_sums_kernel(
    G0, G1, G2, S0, S1, S2, P, M, N0, N1, N2, stride0, stride1, stride2, rows_per_split,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ADD0: tl.constexpr, ADD1: tl.constexpr, ADD2: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    blocks0 = tl.cdiv(N0, BLOCK_C)
    blocks1 = tl.cdiv(N1, BLOCK_C)
    if pid < blocks0:
        src, dst, n, stride, first, column0 = G0, S0, N0, stride0, pid * BLOCK_C, 0
    elif pid < blocks0 + blocks1:
        src, dst, n, stride, first, column0 = G1, S1, N1, stride1, (pid - blocks0) * BLOCK_C, N0
    else:
        src, dst, n, stride, first, column0 = G2, S2, N2, stride2, (pid - blocks0 - blocks1) * BLOCK_C, N0 + N1
    # a runtime value: constexprs assigned in the branches above would not agree in type
    add = tl.where(pid < blocks0, ADD0, tl.where(pid < blocks0 + blocks1, ADD1, ADD2))
    cols = first + tl.arange(0, BLOCK_C)
    cmask = cols < n
    row0 = split.to(tl.int64) * rows_per_split
    stop = tl.minimum(row0 + rows_per_split, M)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(row0, stop, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < stop) & cmask[None, :]
        acc += tl.load(src + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if PARTIAL:
        tl.store(P + split.to(tl.int64) * (N0 + N1 + N2) + column0 + cols, total, mask=cmask)
    else:
        _store_sums(dst, cols, cmask, total, add)


@triton.jit(do_not_specialize=["splits"])
def _column_sums_finish_kernel(
    P, S0, S1, S2, splits, N0, N1, N2,
    BLOCK_C: tl.constexpr, ADD0: tl.constexpr, ADD1: tl.constexpr, ADD2: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks0 = tl.cdiv(N0, BLOCK_C)
    blocks1 = tl.cdiv(N1, BLOCK_C)
    if pid < blocks0:
        dst, n, first, column0 = S0, N0, pid * BLOCK_C, 0
    elif pid < blocks0 + blocks1:
        dst, n, first, column0 = S1, N1, (pid - blocks0) * BLOCK_C, N0
    else:
        dst, n, first, column0 = S2, N2, (pid - blocks0 - blocks1) * BLOCK_C, N0 + N1
    add = tl.where(pid < blocks0, ADD0, tl.where(pid < blocks0 + blocks1, ADD1, ADD2))
    cols = first + tl.arange(0, BLOCK_C)
    cmask = cols < n
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s in range(splits):  # in split order: the same bits whatever ran first
        total += tl.load(P + s * (N0 + N1 + N2) + column0 + cols, mask=cmask, other=0.0)
    _store_sums(dst, cols, cmask, total, add)


def _row_splits(m: int) -> tuple[int, int]:
    """(splits, rows per split) for ``m`` rows: about :data:`_ROWS_PER_PROGRAM` rows each, at
    most :data:`_MAX_SPLITS` splits, each a whole number of ``_BLOCK_R``-row tiles."""
    splits = max(1, min(_MAX_SPLITS, cdiv(m, _ROWS_PER_PROGRAM)))
    rows = cdiv(cdiv(m, splits), _BLOCK_R) * _BLOCK_R
    return cdiv(m, rows) if m else 1, rows


def column_sums(
    grads: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], into: Sequence[GradOutput | None] | None = None,
) -> list[torch.Tensor | None]:
    """One to three ``[M, N_i]`` tensors (one dtype, unit column stride, one device) ->
    their column sums ``[N_i]`` in ``dtypes[i]``, summed in float32. ``into[i]``: write sum ``i``
    there instead (a bias's ``.grad``, added to where its ``accumulate``;
    :func:`dtree.ops.weight_grads.grad_output`), None in its place in the result."""
    if not 1 <= len(grads) <= 3:
        raise ValueError(f"column_sums takes one to three tensors, got {len(grads)}")
    into = list(into) if into is not None else [None] * len(grads)
    m = grads[0].shape[0]
    sums = [o.tensor if o is not None else torch.empty(g.shape[1], dtype=dtype, device=g.device)
            for g, dtype, o in zip(grads, dtypes, into)]
    adds = [o is not None and o.accumulate for o in into]
    if m == 0:
        for s, add in zip(sums, adds):
            if not add:
                s.zero_()
    else:
        _launch(list(grads), sums, adds, m)
    return [None if o is not None else s for s, o in zip(sums, into)]


def _launch(grads: list[torch.Tensor], sums: list[torch.Tensor], adds: list[bool], m: int) -> None:
    padded = grads + [grads[0]] * (3 - len(grads))
    outs = sums + [sums[0]] * (3 - len(sums))
    widths = [g.shape[1] for g in grads] + [0] * (3 - len(grads))
    flags = dict(zip(("ADD0", "ADD1", "ADD2"), (int(a) for a in adds + [False] * (3 - len(adds)))))
    blocks = sum(cdiv(n, _BLOCK_C) for n in widths)
    if not blocks:
        return
    splits, rows = _row_splits(m)
    partial = torch.empty((splits, sum(widths)), dtype=torch.float32, device=grads[0].device) if splits > 1 else None
    warps = 1 if _INTERPRET else 4
    fast_launch(
        _column_sums_kernel, (blocks, splits), *padded, *outs, partial if partial is not None else outs[0], m,
        *widths, *(g.stride(0) for g in padded), rows, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, **flags,
        PARTIAL=partial is not None, num_warps=warps,
    )
    if partial is not None:
        fast_launch(_column_sums_finish_kernel, (blocks,), partial, *outs, splits, *widths, BLOCK_C=_BLOCK_C, **flags,
                    num_warps=warps)
