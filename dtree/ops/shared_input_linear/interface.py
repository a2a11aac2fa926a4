"""Linear projections that read one input, as one autograd op: attention's q, k and v,
the MLP's gate and up.

Contract, for ``x`` [..., H] and projections ``(weight_i [N_i, H], bias_i [N_i] or None)``::

    y_i = x @ weight_i.T + bias_i                       [..., N_i], as F.linear

Backward, with ``dy_i`` the outputs' gradients (rows flattened to ``[M, N_i]``)::

    dx       = dy_0 @ weight_0  (+)  dy_1 @ weight_1  (+) ...   chained matmuls, beta = 1
    dweight_i = dy_i.T @ x                              added into weight_i.grad by the matmul
                                                        inside a step (dtree.ops.weight_grads)
    dbias_i  = sum over rows of dy_i                    float32 accumulation, added into bias_i.grad
                                                        by the summing kernel inside a step

Why one op: called as separate ``nn.Linear`` modules, each projection's backward hands
autograd its own ``dx``, and autograd adds them (two add kernels for q, k, v; one for
gate, up), and each bias gradient is a torch sum (a memset and a reduction each). Here
the later products accumulate into the first one's output in the matmul itself (cuBLAS
with beta = 1: one rounding where the adds made one per term), and the bias gradients
are one Triton launch on CUDA (:mod:`dtree.ops.shared_input_linear.triton_kernels`;
:func:`bias_grads_torch` elsewhere). The forward is the same ``F.linear`` calls; what it
keeps for backward is the same too (``x`` once, and the weights).

Tiers: :func:`shared_input_linear_reference` (plain ``F.linear`` calls, what it is
tested against), :class:`SharedInputLinearFunction`, :func:`shared_input_linear`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..backends import triton_kernels_for
from ..weight_grads import grad_output, grad_target, product_grad, summed_grad

__all__ = [
    "SharedInputLinearFunction",
    "bias_grads_torch",
    "shared_input_linear",
    "shared_input_linear_reference",
]

Projection = tuple[torch.Tensor, "torch.Tensor | None"]
MAX_BIASED = 3  # bias gradients one Triton launch sums


def shared_input_linear_reference(x: torch.Tensor, projections: Sequence[Projection]) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weight, bias)`` per projection, as plain autograd ops."""
    return tuple(F.linear(x, w, b) for w, b in projections)


def _column_sums_torch(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [g.sum(0, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]


def bias_grads_torch(grads: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """``[M, N_i]`` gradients -> their column sums ``[N_i]`` in ``dtypes[i]``, summed in
    float32 (float64 for float64) and rounded once."""
    return [s.to(dtype) for s, dtype in zip(_column_sums_torch(grads), dtypes)]


def _bias_grads(grads: list[torch.Tensor], dtypes: list[torch.dtype], targets: list[torch.Tensor | None]
                ) -> list[torch.Tensor | None]:
    """The biases' gradients for autograd, None for those added into ``.grad`` here (``targets``: the
    forward's :func:`grad_target` of each bias)."""
    kernels = triton_kernels_for(grads[0], __package__)
    if kernels is not None and len(grads) <= MAX_BIASED and all(
        g.dtype == grads[0].dtype and g.stride(-1) == 1 for g in grads
    ):
        return kernels.column_sums(grads, dtypes, [grad_output(t) for t in targets])
    return [summed_grad(s, dtype, t) for s, dtype, t in zip(_column_sums_torch(grads), dtypes, targets)]


class SharedInputLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight_i, bias_i)`` for each projection; keeps ``x`` and the weights.
    Arguments after ``x``: the weights, then the biases (None where absent)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        count = len(params) // 2
        weights, biases = params[:count], params[count:]
        ctx.save_for_backward(x, *weights)
        ctx.grad_targets = [grad_target(w) for w in weights]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        ctx.bias_targets = [None if b is None else grad_target(b) for b in biases]
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        x, *weights = ctx.saved_tensors
        count = len(weights)
        need = ctx.needs_input_grad
        dy2 = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
        x2 = x.reshape(-1, x.shape[-1])
        dx = None
        if need[0]:
            dx = dy2[0].mm(weights[0].to(dy2[0].dtype))
            for dy, w in zip(dy2[1:], weights[1:]):
                dx.addmm_(dy, w.to(dy.dtype))  # accumulates in the matmul: no separate add kernel
            dx = dx.view(x.shape)
        dweights = [product_grad(dy.t(), x2.to(dy.dtype), w.dtype, ctx.grad_targets[i]) if need[1 + i] else None
                    for i, (dy, w) in enumerate(zip(dy2, weights))]
        wanted = [i for i, dtype in enumerate(ctx.bias_dtypes) if dtype is not None and need[1 + count + i]]
        dbiases: list[torch.Tensor | None] = [None] * count
        if wanted:
            sums = _bias_grads([dy2[i] for i in wanted], [ctx.bias_dtypes[i] for i in wanted],
                               [ctx.bias_targets[i] for i in wanted])
            for i, s in zip(wanted, sums):
                dbiases[i] = s
        return (dx, *dweights, *dbiases)


def shared_input_linear(x: torch.Tensor, projections: Sequence[Projection]) -> tuple[torch.Tensor, ...]:
    """``x`` [..., H] through each ``(weight [N_i, H], bias [N_i] or None)`` -> a tuple of
    ``[..., N_i]``, as ``F.linear`` each; one autograd node (see the module docstring).

    Raises:
        ValueError: no projection, or a weight or bias whose shape does not fit ``x``.
    """
    if not projections:
        raise ValueError("shared_input_linear: no projection given")
    for i, (w, b) in enumerate(projections):
        if w.dim() != 2 or w.shape[1] != x.shape[-1] or (b is not None and tuple(b.shape) != (w.shape[0],)):
            raise ValueError(
                f"shared_input_linear: projection {i} (weight {tuple(w.shape)}, bias "
                f"{None if b is None else tuple(b.shape)}) does not fit an input of width {x.shape[-1]}"
            )
    if not torch.is_grad_enabled():  # a checkpointed layer's first forward: no graph, so no autograd node's host cost
        return shared_input_linear_reference(x, projections)
    weights = [w for w, _ in projections]
    biases = [b for _, b in projections]
    return SharedInputLinearFunction.apply(x, *weights, *biases)
