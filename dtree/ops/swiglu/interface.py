"""The SwiGLU activation ``silu(gate) * up`` and the down projection after it, keeping
neither the SiLU output nor the product for backward.

Contract (transformers' ``LlamaMLP``/``Qwen2MLP``/``MistralMLP``/``Qwen3MLP`` with
``hidden_act="silu"``), in the model dtype with HF's roundings::

    p = cast(cast(silu(float32(gate))) * up)            [..., I]
    y = p @ down_weight.T + down_bias                   [..., H]

HF's eager MLP keeps four ``[T, I]`` tensors per layer for backward: ``gate`` (SiLU's
input), its SiLU, ``up``, and the product (the down projection's input): 8 bytes per
intermediate element in bf16, 71.7 KB per token per layer on qwen2.5-1.5b.
:class:`SiluMulFunction` keeps ``gate`` and ``up`` (Liger's SwiGLU does the same; the
product is still kept by the down projection after it); :class:`SwiGLUDownFunction`
owns the down projection too and keeps ``gate``, ``up`` and the weight only: it
recomputes the product in backward (one elementwise pass, no matmul), 4 bytes per
intermediate element, 35.8 KB per token per layer.

Backward, with ``s = silu(gate)``, ``sig = sigmoid(gate)`` (float32) and ``dp`` the
product's gradient::

    dup   = cast(dp * cast(s))
    dgate = cast(float32(cast(dp * up)) * sig * (1 + gate * (1 - sig)))

Tiers: :func:`silu_mul_reference` (plain autograd, HF's ops), the autograd functions,
whose elementwise kernels run in Triton on CUDA (:mod:`dtree.ops.swiglu.triton_kernels`) and in
torch elsewhere (:func:`silu_mul_forward_torch`, :func:`silu_mul_backward_torch`), and
:func:`silu_mul` / :func:`swiglu_down`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends import triton_kernels_for

__all__ = [
    "SiluMulFunction",
    "SwiGLUDownFunction",
    "silu_mul",
    "silu_mul_backward_torch",
    "silu_mul_forward_torch",
    "silu_mul_reference",
    "swiglu_down",
    "swiglu_down_reference",
]


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's ``act_fn(gate_proj(x)) * up_proj(x)`` as plain autograd ops."""
    return F.silu(gate) * up


def swiglu_down_reference(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """HF's ``down_proj(act_fn(gate) * up)`` as plain autograd ops."""
    return F.linear(silu_mul_reference(gate, up), weight, bias)


def silu_mul_forward_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul_backward_torch(
    dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in the model dtype (see the module docstring; the math in float32,
    or float64 for float64 inputs, as torch's SiLU)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(acc)
    sig = torch.sigmoid(g)
    dup = dp * F.silu(gate)
    dgate = ((dp * up).to(acc) * sig * (1 + g * (1 - sig))).to(gate.dtype)
    return dgate, dup


def _kernels(x: torch.Tensor):
    """The Triton module when ``x`` runs there, else None (the torch kernels)."""
    return triton_kernels_for(x, __package__)


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    kernels = _kernels(gate)
    if kernels is not None and gate.dtype == up.dtype and gate.is_contiguous() and up.is_contiguous():
        return kernels.silu_mul_forward(gate, up)
    return silu_mul_forward_torch(gate, up)


def _backward(
    dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, owned: bool = False, spare: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup). ``owned``: the caller made ``dp`` and the Triton kernel may write
    ``dgate`` over it; ``spare``: a ``[..., I]`` buffer it no longer needs, for ``dup``."""
    kernels = _kernels(gate)
    if kernels is not None and gate.dtype == up.dtype == dp.dtype and all(
        t.is_contiguous() for t in (dp, gate, up)
    ):
        return kernels.silu_mul_backward(dp, gate, up, reuse_dp=owned, spare=spare)
    return silu_mul_backward_torch(dp, gate, up)


class SiluMulFunction(torch.autograd.Function):
    """``silu(gate) * up`` keeping ``gate`` and ``up`` (not the SiLU output)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dp: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = _backward(dp.contiguous(), gate, up)
        return dgate, dup


class SwiGLUDownFunction(torch.autograd.Function):
    """``linear(silu(gate) * up, weight, bias)`` keeping ``gate``, ``up`` and ``weight``;
    the product is recomputed in backward (for ``weight``'s gradient)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, output_unused: bool = False):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        if output_unused:  # a checkpointed layer's re-run (dtree.ops.rerun): only the saved tensors count
            return gate.new_zeros(()).expand(*gate.shape[:-1], weight.shape[0])
        return F.linear(_forward(gate, up), weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_w, need_b = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = db = dgate = dup = None
        product = None
        if need_w:
            product = _forward(gate, up)
            dw = dy2.t().mm(product.reshape(-1, product.shape[-1])).to(weight.dtype)
        if need_b and ctx.has_bias:
            db = dy2.sum(0)
        if need_gate or need_up:
            dp = dy2.mm(weight.to(dy2.dtype)).view(gate.shape)
            dgate, dup = _backward(dp, gate, up, owned=True, spare=product)
        return (dgate if need_gate else None), (dup if need_up else None), dw, db, None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ([..., I] each) that keeps its two inputs only."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return SiluMulFunction.apply(gate, up)


def swiglu_down(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    output_unused: bool = False,
) -> torch.Tensor:
    """``linear(silu(gate) * up, weight, bias)``: gate, up [..., I], weight [H, I], bias
    [H] or None -> [..., H]; keeps gate, up and the weight only. ``output_unused``: the
    caller drops the output (a checkpointed layer's re-run, :mod:`dtree.ops.rerun`):
    the same saved tensors, a zero view returned, no matmul."""
    if gate.shape != up.shape or weight.dim() != 2 or weight.shape[1] != gate.shape[-1]:
        raise ValueError(
            f"swiglu_down: gate {tuple(gate.shape)}, up {tuple(up.shape)} and weight {tuple(weight.shape)} do not match"
        )
    return SwiGLUDownFunction.apply(gate, up, weight, bias, output_unused)
