"""Triton kernels of :mod:`dtree.ops.stack_ops` for a GPU without the CUDA extension
(a plain ``pip install`` does not build it): the push of a call's K and V into the stack
in one launch (two copies in torch), and the fold of the stack's float32 gradient slots
into dK and dV with the cast in one launch (four ops in torch). Their contract and test
reference are :func:`dtree.ops.stack_ops.reference.push_kv` and ``seed_grad``. Row counts
are not specialized: calls of every size share one compiled kernel per head shape and
dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..fast_launch import cdiv, fast_launch, next_power_of_2

__all__ = ["fold_seed", "push_kv", "runs_on"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_ROWS = 16  # tokens per program of the push
_BLOCK = 128 if _INTERPRET else 4096  # elements per program of the fold


def runs_on(t: torch.Tensor) -> bool:
    return _INTERPRET or t.device.type == "cuda"


@triton.jit(do_not_specialize=["T"])
def _push_kernel(
    K, V, KS, VS, T, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
    HKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ck = tl.arange(0, BK)
    mk = (rows[:, None] < T) & (ck[None, :] < HKV * DK)
    src = K + rows[:, None] * sk_t + (ck // DK)[None, :] * sk_h + (ck % DK)[None, :] * sk_d
    tl.store(KS + rows[:, None] * (HKV * DK) + ck[None, :], tl.load(src, mask=mk), mask=mk)
    cv = tl.arange(0, BV)
    mv = (rows[:, None] < T) & (cv[None, :] < HKV * DV)
    src = V + rows[:, None] * sv_t + (cv // DV)[None, :] * sv_h + (cv % DV)[None, :] * sv_d
    tl.store(VS + rows[:, None] * (HKV * DV) + cv[None, :], tl.load(src, mask=mv), mask=mv)


def push_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``k`` [T, Hkv, Dk], ``v`` [T, Hkv, Dv] (any strides) into the contiguous stack
    slices ``k_slots``, ``v_slots``."""
    t, hkv, dk = k.shape
    dv = v.shape[-1]
    if not (k_slots.is_contiguous() and v_slots.is_contiguous()):
        raise ValueError("the stack slices must be contiguous")
    fast_launch(
        _push_kernel, (cdiv(t, _ROWS),),
        k, v, k_slots, v_slots, t, *k.stride(), *v.stride(), HKV=hkv, DK=dk, DV=dv, ROWS=_ROWS,
        BK=next_power_of_2(hkv * dk), BV=next_power_of_2(hkv * dv), num_warps=1 if _INTERPRET else 4,
    )


@triton.jit  # nk, nv specialized (% 16): vector loads (see dtree.ops.swiglu.triton_kernels)
def _fold_kernel(SK, SV, GK, GV, OK, OV, nk, nv, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blocks_k = tl.cdiv(nk, BLOCK)
    if pid < blocks_k:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < nk
        s = tl.load(SK + offs, mask=m, other=0.0)
        if HAS_GK:
            s += tl.load(GK + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(OK + offs, s.to(OK.dtype.element_ty), mask=m)
    else:
        offs = (pid - blocks_k) * BLOCK + tl.arange(0, BLOCK)
        m = offs < nv
        s = tl.load(SV + offs, mask=m, other=0.0)
        if HAS_GV:
            s += tl.load(GV + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(OV + offs, s.to(OV.dtype.element_ty), mask=m)


def fold_seed(
    k_slots: torch.Tensor, v_slots: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_slots + gk).to(dtypes[0])`` and the same for V, in one launch."""
    gk = gk.contiguous() if gk is not None else None
    gv = gv.contiguous() if gv is not None else None
    dk = torch.empty(k_slots.shape, dtype=dtypes[0], device=k_slots.device)
    dv = torch.empty(v_slots.shape, dtype=dtypes[1], device=v_slots.device)
    nk, nv = k_slots.numel(), v_slots.numel()
    grid = (cdiv(nk, _BLOCK) + cdiv(nv, _BLOCK),)
    fast_launch(
        _fold_kernel, grid,
        k_slots, v_slots, gk if gk is not None else k_slots, gv if gv is not None else v_slots, dk, dv, nk, nv,
        HAS_GK=gk is not None, HAS_GV=gv is not None, BLOCK=_BLOCK, num_warps=1 if _INTERPRET else 8,
    )
    return dk, dv
