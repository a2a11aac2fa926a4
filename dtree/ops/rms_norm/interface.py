"""RMSNorm that keeps only its input for backward: no float32 copies.

Contract (transformers' Llama-style ``*RMSNorm.forward``: Llama, Qwen2, Qwen3, Mistral),
for rows ``x`` of width ``N``::

    r = rsqrt(mean(float32(x)^2) + eps)                 float32, one per row
    y = weight * cast(float32(x) * r, x.dtype)          in promote(weight, x) dtype

HF's eager version keeps, per row, a float32 copy of ``x`` (for ``pow`` and the
multiply by ``r``), the normalized row in ``x.dtype`` (for ``weight``'s gradient) and
hands its output to the next projection, which keeps it too: 14 bytes per element in
bf16. :class:`RMSNormFunction` keeps ``x`` (2 bytes) and ``r`` (4 bytes per *row*) and
recomputes the normalized row in backward; measured per layer and token in
``benchmarks/activation_bytes.py``. Inside a step, ``dweight`` is added into ``weight.grad`` by the
kernel that sums it (:mod:`dtree.ops.weight_grads`) rather than returned to autograd.

Backward, per row, with ``n = float32(x) * r`` and ``g = float32(dy * weight)``::

    dx = r * (g - n * mean(g * n))                      cast to x.dtype
    dweight = sum over rows of dy * cast(n, x.dtype)    float32 accumulation

Tiers (as flash-attention's rotary): :func:`rms_norm_reference` (plain autograd, HF's
formula, what everything is tested against), :class:`RMSNormFunction` (the lean
autograd function; its two kernels run in Triton on CUDA,
:mod:`dtree.ops.rms_norm.triton_kernels`, and in torch elsewhere: :func:`rms_norm_forward_torch`,
:func:`rms_norm_backward_torch`), :func:`rms_norm` (the functional entry point).
"""

from __future__ import annotations

import torch

from ..backends import triton_kernels_for
from ..weight_grads import grad_output, grad_target, summed_grad

__all__ = [
    "RMSNormFunction",
    "rms_norm",
    "rms_norm_backward_torch",
    "rms_norm_forward_torch",
    "rms_norm_reference",
    "load_triton_kernels",
]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama-style RMSNorm as plain autograd ops ([..., N] -> [..., N])."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_forward_torch(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] rows -> ([M, N] output, [M] float32 ``r``); torch ops, no autograd."""
    h = x2.to(torch.float32)
    r = torch.rsqrt(h.pow(2).mean(-1) + eps)
    return weight * (h * r[:, None]).to(x2.dtype), r


def rms_norm_backward_torch(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, r: torch.Tensor, need_dweight: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([M, N] dx in x's dtype, [N] float32 dweight or None) from the saved row stats."""
    n = x2.to(torch.float32) * r[:, None]
    g = (dy2 * weight).to(x2.dtype).to(torch.float32)  # HF rounds d(normalized row) to x's dtype
    dx = r[:, None] * (g - n * (g * n).mean(-1, keepdim=True))
    dw = (dy2.to(torch.float32) * n.to(x2.dtype).to(torch.float32)).sum(0) if need_dweight else None
    return dx.to(x2.dtype), dw


def load_triton_kernels(x: torch.Tensor):
    """The Triton module when ``x`` runs there (CUDA, or CPU under the interpreter; a
    kernel dtype), else None (the torch kernels)."""
    return triton_kernels_for(x, __package__)


class RMSNormFunction(torch.autograd.Function):
    """The lean RMSNorm: saves ``x``, ``weight`` and ``r`` ([M] float32) only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        kernels = load_triton_kernels(x2)
        if kernels is not None and weight.dtype == x2.dtype:
            y, r = kernels.rms_norm_forward(x2, weight, eps)
        else:
            y, r = rms_norm_forward_torch(x2, weight, eps)
        ctx.save_for_backward(x2, weight, r)
        ctx.shape = x.shape
        ctx.grad_target = grad_target(weight)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, r = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        need_dw = ctx.needs_input_grad[1]
        kernels = load_triton_kernels(x2)
        if kernels is not None and weight.dtype == x2.dtype == dy2.dtype:
            into = grad_output(ctx.grad_target) if need_dw else None
            dx, dw = kernels.rms_norm_backward(dy2, x2, weight, r, need_dw, into)
        else:
            dx, dw = rms_norm_backward_torch(dy2, x2, weight, r, need_dw)
            dw = summed_grad(dw, weight.dtype, ctx.grad_target) if dw is not None else None
        dx = dx.view(ctx.shape) if ctx.needs_input_grad[0] else None
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm over the last dim of ``x`` [..., N] with ``weight`` [N] (see
    the module docstring): :class:`RMSNormFunction`."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match rows of width {x.shape[-1]}")
    return RMSNormFunction.apply(x, weight, float(eps))
