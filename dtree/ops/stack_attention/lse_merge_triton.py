"""The log-sum-exp merge of region outputs in one Triton kernel.

Contract: exactly :func:`dtree.ops.stack_attention.regions.lse_merge_reference`.
``outs [C, T, H, Dv]`` (16-bit) and ``lses [C, H, T]`` (float32, natural log; -inf where a
region does not cover a row) become ``out [T, H, Dv]`` and ``lse [H, T]``: one read of
every region's rows and one write, instead of the reference's float32 temporaries.
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (tests).

The region count ``C`` is a runtime argument, not a constexpr: it is one more than the
call's prefix levels, which varies from call to call (5 to 13 on 64k agentic trees), and
as a constexpr each new count compiled the kernel again inside a training step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fast_launch import cdiv, fast_launch, next_power_of_2

__all__ = ["lse_merge_triton"]


@triton.jit(do_not_specialize=["T", "C", "stride_oc", "stride_lc"])
def _lse_merge_kernel(
    OUTS, LSES, OUT, LSE, T, C, stride_oc, stride_ot, stride_oh, stride_lc, stride_mt, stride_mh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T), H). ``LSE`` is contiguous [H, T]."""
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    offs = tl.arange(0, BLOCK_DV)
    # region c's rows start at OUTS + c * stride_oc: advanced one region at a time, so the
    # product never overflows int32 (calls of 2^31 / 13 elements per region and more)
    lse_ptrs = LSES + head * T + rows
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    for _ in range(C):
        m = tl.maximum(m, tl.load(lse_ptrs, mask=row_ok, other=float("-inf")))
        lse_ptrs += stride_lc
    m = tl.where(m == float("-inf"), 0.0, m)  # rows past T (every real row has a finite region)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_DV], dtype=tl.float32)
    lse_ptrs = LSES + head * T + rows
    ptrs = OUTS + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs[None, :]
    for _ in range(C):
        lse_c = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        w = tl.exp(lse_c - m)  # 0 where the region does not cover the row
        covered = row_ok & (lse_c > float("-inf"))
        o = tl.load(ptrs, mask=covered[:, None] & (offs < DV)[None, :], other=0.0)
        acc += w[:, None] * o.to(tl.float32)
        total += w
        lse_ptrs += stride_lc
        ptrs += stride_oc
    total = tl.where(row_ok, total, 1.0)
    out_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_mt + head * stride_mh + offs[None, :]
    tl.store(out_ptrs, (acc / total[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs < DV)[None, :])
    tl.store(LSE + head * T + rows, m + tl.log(total), mask=row_ok)


def lse_merge_triton(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``C`` region outputs: outs [C, T, H, Dv] (unit last stride), lses [C, H, T]
    contiguous float32 -> (out [T, H, Dv] in ``outs.dtype``, lse [H, T] float32)."""
    c, t, h, dv = outs.shape
    if outs.stride(-1) != 1:
        outs = outs.contiguous()
    lses = lses.contiguous()
    out = torch.empty((t, h, dv), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((h, t), dtype=lses.dtype, device=lses.device)
    block_t = 64
    fast_launch(
        _lse_merge_kernel, (cdiv(t, block_t), h),
        outs, lses, out, lse, t, c, outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0),
        out.stride(0), out.stride(1),
        DV=dv, BLOCK_DV=max(16, next_power_of_2(dv)), BLOCK_T=block_t, num_warps=4,
    )
    return out, lse
