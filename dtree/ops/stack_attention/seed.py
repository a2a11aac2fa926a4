"""Folding the stack's gradient slots of a call back into its own K/V gradients.

The attention backward of a call adds the prefix dK/dV of its in-call ancestors into the
stack's gradient slots, as the backwards of its descendants did before it;
:func:`seed_from_stack` adds those slots to the call's own ``dk, dv`` where K/V are
consumed, whatever graph computed them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kv_stack imports dtree.ops (its stack ops): no import at run time
    from ..stack_ops.kv_stack import KVStack

__all__ = ["seed_from_stack"]


class _StackGradSeed(torch.autograd.Function):
    """Identity on a call's own (k, v) whose backward adds the stack's gradient slots
    ``[lo, hi)`` of ``layer`` (float32, float64 for a float64 model) to the incoming dk, dv.

    Autograd runs a node's backward only once every consumer of its outputs has sent
    its gradient, so this runs after the attention backward of the same call at this
    layer: the slots then hold what the call's descendants added (their backward ran
    earlier, depth first) plus what the call's own segments sent their in-call
    ancestors. The sum is formed in the slots' dtype (float32; float64 for a float64
    model) and rounded once (:meth:`KVStack.seed_grad`: one kernel with the CUDA extension)."""

    @staticmethod
    def forward(ctx, k, v, stack: KVStack, layer: int, lo: int, hi: int, device_lo):
        ctx.stack, ctx.layer, ctx.lo, ctx.hi, ctx.device_lo = stack, layer, lo, hi, device_lo
        ctx.dtypes = (k.dtype, v.dtype)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        gk, gv = ctx.stack.seed_grad(ctx.layer, ctx.lo, ctx.hi, gk, gv, ctx.dtypes, device_lo=ctx.device_lo)
        return gk, gv, None, None, None, None, None


def seed_from_stack(
    k: torch.Tensor,
    v: torch.Tensor,
    stack: KVStack,
    layer: int,
    lo: int,
    hi: int,
    *,
    device_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` unchanged, with a backward that adds ``stack.grad_k/grad_v[layer, lo:hi]``
    to their gradients.

    Args:
        k: [T, Hkv, Dk], v: [T, Hkv, Dv] the call's own K/V, held in stack slots
            ``[lo, hi)`` (``hi - lo == T``).
        device_lo: ``lo`` as a one-element int64 tensor on the stack's device (the CUDA
            extension reads it there; None: made when needed).

    Pass them through this before :func:`stack_attention` and the gradient slots the
    attention backward (of this call: in-call ancestors) and earlier backwards (of the
    call's descendants) filled are added exactly once. Nothing is added where neither
    requires grad (nothing trainable computes them)."""
    if hi - lo != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v have {k.shape[0]} and {v.shape[0]} rows for the {hi - lo} slots [{lo}, {hi})")
    if not stack.has_grad or not torch.is_grad_enabled() or not (k.requires_grad or v.requires_grad):
        return k, v
    return _StackGradSeed.apply(k, v, stack, layer, lo, hi, device_lo)
