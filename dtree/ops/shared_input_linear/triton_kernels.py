"""Triton kernel of :mod:`dtree.ops.shared_input_linear`: the column sums of up to three
``[M, N_i]`` gradients (the projections' bias gradients) in one launch.

One program per ``BLOCK_C`` columns of one tensor: the grid covers the three tensors'
column blocks one after the other, and each program walks all ``M`` rows in
``BLOCK_R``-row tiles, summing in float32 registers, then writes its columns once in
the bias dtype (or adds them into the biases' ``.grad`` inside a step,
:mod:`dtree.ops.weight_grads`). Where torch's sum took a memset and a reduction per bias (six launches
for q, k, v), this is one; ``M`` is not specialized, so calls of every length share the
compiled kernel.

Its torch twin is :func:`dtree.ops.shared_input_linear.interface.bias_grads_torch`;
``tests/test_shared_input_linear.py`` runs this kernel against it under the Triton
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
_BLOCK_C = 32
_BLOCK_R = 16 if _INTERPRET else 128


@triton.jit(do_not_specialize=["M"])
def _column_sums_kernel(
    G0, G1, G2, S0, S1, S2, M, N0, N1, N2, stride0, stride1, stride2,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ADD0: tl.constexpr, ADD1: tl.constexpr, ADD2: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks0 = tl.cdiv(N0, BLOCK_C)
    blocks1 = tl.cdiv(N1, BLOCK_C)
    if pid < blocks0:
        src, dst, n, stride, first = G0, S0, N0, stride0, pid * BLOCK_C
    elif pid < blocks0 + blocks1:
        src, dst, n, stride, first = G1, S1, N1, stride1, (pid - blocks0) * BLOCK_C
    else:
        src, dst, n, stride, first = G2, S2, N2, stride2, (pid - blocks0 - blocks1) * BLOCK_C
    # a runtime value: constexprs assigned in the branches above would not agree in type
    add = tl.where(pid < blocks0, ADD0, tl.where(pid < blocks0 + blocks1, ADD1, ADD2))
    cols = first + tl.arange(0, BLOCK_C)
    cmask = cols < n
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(0, M, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < M) & cmask[None, :]
        acc += tl.load(src + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # into the bias's .grad where ``add``: its value joins the float32 sum, one rounding
    total = tl.sum(acc, axis=0) + tl.load(dst + cols, mask=cmask & (add != 0), other=0.0).to(tl.float32)
    tl.store(dst + cols, total.to(dst.dtype.element_ty), mask=cmask)


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
        padded = list(grads) + [grads[0]] * (3 - len(grads))
        outs = sums + [sums[0]] * (3 - len(sums))
        widths = [g.shape[1] for g in grads] + [0] * (3 - len(grads))
        flags = adds + [False] * (3 - len(adds))
        blocks = sum(cdiv(n, _BLOCK_C) for n in widths)
        if blocks:
            fast_launch(
                _column_sums_kernel, (blocks,), *padded, *outs, m, *widths, *(g.stride(0) for g in padded),
                BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, ADD0=int(flags[0]), ADD1=int(flags[1]), ADD2=int(flags[2]),
                num_warps=1 if _INTERPRET else 4,
            )
    return [None if o is not None else s for s, o in zip(sums, into)]
