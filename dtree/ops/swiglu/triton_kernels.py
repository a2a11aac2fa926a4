"""Triton kernels of :mod:`dtree.ops.swiglu`: ``silu(gate) * up`` and its backward, one
elementwise pass each over the flattened ``[..., I]`` tensors (float32 math, HF's
roundings to the model dtype). The element count ``n`` is specialized the way Triton
does by default (divisible by 16 or not: two compiled kernels per dtype at most): the
tail mask ``offs < n`` is then known constant over 16 elements, and the loads and
stores are 16-byte vectors. Left unspecialized, they were 2-byte scalar accesses
(``tests/test_kernel_vectorization.py`` reads the PTX), which ran these kernels at
40-55% of the H100's memory bandwidth.

The backward may write ``dgate`` over ``dp`` (each element is read before it is
written) and ``dup`` into a spare buffer, when the caller owns them:
:class:`dtree.ops.swiglu.SwiGLUDownFunction` computes ``dp`` itself and has the
recomputed product, no longer needed once the down projection's weight gradient is
formed, so its backward holds two ``[T, I]`` temporaries instead of four. In a
checkpointed layer's re-run, where ``gate`` and ``up`` belong to the backward alone,
:func:`silu_mul_backward_in_place` writes ``dgate`` and ``dup`` over them and the
product over ``dp``, one row chunk at a time.

Their torch twins are :func:`dtree.ops.swiglu.silu_mul_forward_torch` and
:func:`dtree.ops.swiglu.silu_mul_backward_torch`; ``tests/test_swiglu.py`` runs these
kernels against them under the Triton interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..backends import triton_runs_on as runs_on
from ..fast_launch import cdiv, fast_launch

__all__ = ["runs_on", "silu_mul_backward", "silu_mul_backward_in_place", "silu_mul_forward"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_BLOCK = 128 if _INTERPRET else 2048


@triton.jit
def _silu_mul_fwd_kernel(G, U, P, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(P.dtype.element_ty).to(tl.float32)
    tl.store(P + offs, (s * u).to(P.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(DP, G, U, DG, DU, n, BLOCK: tl.constexpr, PRODUCT: tl.constexpr):
    # every element is read before any is written, so DG, DU may be DP, G or U; PRODUCT: the
    # product silu(g) * u over DP besides (a re-run's backward: DG is G, DU is U)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dp = tl.load(DP + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    s = (g * sig).to(G.dtype.element_ty).to(tl.float32)
    ds = (dp * u).to(G.dtype.element_ty).to(tl.float32)
    if PRODUCT:
        tl.store(DP + offs, (s * u).to(DP.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dp * s).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (ds * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Contiguous ``gate``, ``up`` (one shape and dtype) -> ``silu(gate) * up``."""
    p = torch.empty_like(gate)
    n = gate.numel()
    if n:
        grid = (cdiv(n, _BLOCK),)
        fast_launch(_silu_mul_fwd_kernel, grid, gate, up, p, n, BLOCK=_BLOCK, num_warps=1 if _INTERPRET else 8)
    return p


def silu_mul_backward(
    dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, reuse_dp: bool = False, spare: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) for contiguous inputs of one shape and dtype. ``reuse_dp``: ``dgate``
    is written over ``dp`` (the caller owns it); ``spare``: a buffer the caller no longer
    needs (contiguous, same size and dtype) that receives ``dup``."""
    n = gate.numel()
    dgate = dp if reuse_dp else torch.empty_like(dp)
    usable = spare is not None and spare.is_contiguous() and spare.dtype == dp.dtype and spare.numel() == n
    dup = spare.view(dp.shape) if usable else torch.empty_like(dp)
    if n:
        fast_launch(
            _silu_mul_bwd_kernel, (cdiv(n, _BLOCK),),
            dp, gate, up, dgate, dup, n, BLOCK=_BLOCK, PRODUCT=False, num_warps=1 if _INTERPRET else 8
        )
    return dgate, dup


def silu_mul_backward_in_place(dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """Contiguous ``dp``, ``gate``, ``up`` of one shape and dtype, overwritten with
    (the product ``silu(gate) * up``, dgate, dup): one pass, no new buffer."""
    n = gate.numel()
    if n:
        fast_launch(
            _silu_mul_bwd_kernel, (cdiv(n, _BLOCK),), dp, gate, up, gate, up, n, BLOCK=_BLOCK, PRODUCT=True,
            num_warps=1 if _INTERPRET else 8,
        )
