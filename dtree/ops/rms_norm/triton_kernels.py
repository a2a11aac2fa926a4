"""Triton kernels of :mod:`dtree.ops.rms_norm` (forward and backward of the lean RMSNorm).

Forward: one program per row (``BLOCK_N`` = the row width rounded up to a power of
two): the row's float32 sum of squares gives ``r``, the normalized row is rounded to
the input dtype and multiplied by the weight (HF's two roundings). Backward: each
program walks a contiguous block of rows, writes ``dx`` per row and keeps its share of
``dweight`` in float32 registers; a second kernel sums the shares (``[programs, N]``
float32) column by column in float32 and writes ``dweight`` in the weight's dtype (or adds
it into the weight's ``.grad`` inside a step, :mod:`dtree.ops.weight_grads`): one
launch where torch's sum and cast took two (a norm's backward runs per layer and model
call, and short calls are host-bound). ``M`` (rows) and the rows per program are not
specialized, so calls of every size share one compiled kernel per row width and dtype.

Their torch twins are :func:`dtree.ops.rms_norm.rms_norm_forward_torch` and
:func:`dtree.ops.rms_norm.rms_norm_backward_torch`; ``tests/test_rms_norm.py`` runs these
kernels against them under the Triton interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..backends import sm_count, triton_runs_on as runs_on
from ..fast_launch import cdiv, fast_launch, next_power_of_2
from ..weight_grads import GradOutput

__all__ = ["rms_norm_backward", "rms_norm_forward", "runs_on"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_MAX_N = 65536


def _warps(block_n: int) -> int:
    return 1 if _INTERPRET else min(16, max(1, block_n // 256))


@triton.jit(do_not_specialize=["eps"])
def _rms_norm_fwd_kernel(X, W, Y, R, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    n = (x * r).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * n).to(Y.dtype.element_ty), mask=mask)
    tl.store(R + row, r)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _rms_norm_bwd_kernel(
    DY, X, W, R, DX, DW, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
    BLOCK_N: tl.constexpr, NEED_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        if row < M:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(R + row)
            n = x * r
            # HF rounds d(normalized row) = dy * weight to the input dtype
            g = (dy * w).to(X.dtype.element_ty).to(tl.float32)
            dx = r * (g - n * (tl.sum(g * n, axis=0) / N))
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            if NEED_DW:
                dw += dy * n.to(X.dtype.element_ty).to(tl.float32)
    if NEED_DW:
        tl.store(DW + pid * N + cols, dw, mask=mask)


@triton.jit(do_not_specialize=["programs"])
def _dweight_sum_kernel(P, DW, programs, N, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, ACCUMULATE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < programs) & cmask[None, :]
        acc += tl.sum(tl.load(P + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0), axis=0)
    if ACCUMULATE:  # into the weight's .grad: its value joins the float32 sum, one rounding
        acc += tl.load(DW + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(DW + cols, acc.to(DW.dtype.element_ty), mask=cmask)


_SUM_COLUMNS, _SUM_ROWS = 128, 32


def _block(n: int) -> int:
    if n > _MAX_N:
        raise ValueError(f"the Triton RMSNorm takes rows of at most {_MAX_N} elements, got {n}")
    return next_power_of_2(n)


def rms_norm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] contiguous rows -> ([M, N] output in x's dtype, [M] float32 ``r``)."""
    m, n = x2.shape
    y = torch.empty_like(x2)
    r = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m:
        block = _block(n)
        fast_launch(
            _rms_norm_fwd_kernel, (m,), x2, weight, y, r, x2.stride(0), y.stride(0), n, eps, BLOCK_N=block,
            num_warps=_warps(block),
        )
    return y, r


def _programs(m: int, device: torch.device) -> int:
    if _INTERPRET or device.type != "cuda":
        return max(1, min(m, 4))
    return max(1, min(m, 4 * sm_count(device)))


def rms_norm_backward(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, r: torch.Tensor, need_dweight: bool,
    dweight_out: GradOutput | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([M, N] dx in x's dtype, [N] dweight in the weight's dtype (summed in float32) or None).
    ``dweight_out``: write dweight there instead (the weight's ``.grad``, added to where its
    ``accumulate``; :func:`dtree.ops.weight_grads.grad_output`) and return None for it."""
    m, n = x2.shape
    dx = torch.empty_like(x2)
    programs = _programs(m, x2.device)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device) if need_dweight else r
    if m:
        block = _block(n)
        fast_launch(
            _rms_norm_bwd_kernel, (programs,),
            dy2, x2, weight, r, dx, partial, dy2.stride(0), x2.stride(0), dx.stride(0), m, n,
            cdiv(m, programs), BLOCK_N=block, NEED_DW=need_dweight, num_warps=_warps(block),
        )
    if not need_dweight:
        return dx, None
    dw = dweight_out.tensor if dweight_out is not None else torch.empty(n, dtype=weight.dtype, device=x2.device)
    accumulate = dweight_out is not None and dweight_out.accumulate
    if not m:
        if not accumulate:
            dw.zero_()
    else:
        fast_launch(
            _dweight_sum_kernel, (cdiv(n, _SUM_COLUMNS),), partial, dw, programs, n, BLOCK_C=_SUM_COLUMNS,
            BLOCK_P=_SUM_ROWS, ACCUMULATE=accumulate, num_warps=1 if _INTERPRET else 4,
        )
    return dx, (None if dweight_out is not None else dw)
