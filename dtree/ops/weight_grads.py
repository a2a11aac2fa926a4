"""A weight's gradient added into ``param.grad`` by the matmul that computes it.

A dtree step runs a backward per model call, and every call's backward hands each weight
its gradient through autograd's ``AccumulateGrad`` node, which adds it into ``param.grad``
with a kernel of its own: the capped 64k agentic step launched 1,696 such adds, the most
launched kernel of the step (``benchmarks/results/h200/session_af/origins``), each with its
node's host work and a fresh ``[N, K]`` product allocated first. Where an op computes a
weight gradient as one matmul (:mod:`dtree.ops.shared_input_linear`, :mod:`dtree.ops.swiglu`),
:func:`add_product` has the matmul add into ``param.grad`` itself (cuBLAS with beta = 1: one
rounding where the product and the add made one each), as Megatron-LM's gradient-accumulation
fusion does, and the op returns no gradient for that weight. The first call of a step, whose
``param.grad`` is None, assigns the product as ``AccumulateGrad`` would.

Contract, for a weight ``w`` and ``a`` [N, M], ``b`` [M, K] (``w`` is [N, K])::

    w.grad = a @ b            (w.grad None)       in w's dtype
    w.grad += a @ b           (otherwise)         summed in the matmul

Only where autograd would have added into ``param.grad`` the same way and nothing could tell
the difference (:func:`accumulates_in_place`, on the tensor the op's forward received:
:func:`grad_target`): inside :func:`in_place_weight_grads` (entered by
each training step, :class:`dtree.engine.step.TokenStep`, for every method), in a plain
``.backward()`` (not ``torch.autograd.grad`` or ``.backward(inputs=...)``, which only return
gradients), without ``create_graph``, for a contiguous leaf ``nn.Parameter`` or tensor of no
subclass with no hook of its own on it and a ``.grad`` that is None or a plain contiguous tensor
of its shape, dtype and device. Hooks dtree marks with :data:`WAIT_BEFORE_WRITE` (the host
gradient guard's wait for its copy, :mod:`dtree.engine.grad_guard`) are run before the write
instead. Everywhere else the op returns the gradient to autograd as before. The weight's
``AccumulateGrad`` node still runs, with no gradient: a hook on that node (not on the tensor),
the kind DDP's reducer registers, is called with none while ``param.grad`` already holds the sum;
dtree runs DDP's walks under ``no_sync``, where the reducer does not read them
(:mod:`dtree.distributed.sync`).

Reductions (an RMSNorm's weight, a projection's bias: a column sum per call) follow the same contract
through :func:`grad_output`: their kernel writes ``param.grad`` itself, adding what it holds in float32
before one rounding, where ``AccumulateGrad`` rounded the sum and then the add.

Tiers: returning the product to autograd is the reference (what every op does outside the
scope, and what ``RuntimeConfig(weight_grads_in_matmul=False)`` runs); :func:`add_product`
is the fused path; an op's backward calls :func:`product_grad` (or :func:`summed_grad`), which
picks one; ``tests/test_weight_grads.py`` compares the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

__all__ = ["WAIT_BEFORE_WRITE", "GradOutput", "accumulates_in_place", "add_product", "add_sum", "grad_output",
           "grad_target", "in_place_weight_grads", "product_grad", "summed_grad"]

WAIT_BEFORE_WRITE = "dtree_wait_before_write"  # a tensor hook with this attribute only waits, then removes itself
_PLAIN = (torch.nn.Parameter, torch.Tensor)
_depth = 0  # a plain global, not thread-local: backward runs on autograd's device threads


@contextlib.contextmanager
def in_place_weight_grads(enabled: bool = True) -> Iterator[None]:
    """Within the block, ops may add weight gradients into ``param.grad`` themselves
    (see the module docstring); ``enabled=False`` leaves them to autograd."""
    global _depth
    if not enabled:
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def _hooks_allow(weight: torch.Tensor) -> bool:
    if getattr(weight, "_post_accumulate_grad_hooks", None):
        return False
    hooks = weight._backward_hooks
    return not hooks or all(getattr(h, WAIT_BEFORE_WRITE, False) for h in hooks.values())


def grad_target(weight: torch.Tensor) -> torch.Tensor | None:
    """At an op's forward: ``weight`` itself where its backward may add into its ``.grad``
    (a plain leaf that requires grad, contiguous), else None. An op keeps this, not the tensor
    its ``ctx.saved_tensors`` gives back: saved-tensor hooks (non-reentrant checkpointing,
    ``save_on_cpu``) give back another tensor, whose ``.grad`` no one reads."""
    if type(weight) not in _PLAIN or not (weight.is_leaf and weight.requires_grad and weight.is_contiguous()):
        return None  # (AccumulateGrad gives a strided parameter a gradient of its own strides)
    return weight


def accumulates_in_place(weight: torch.Tensor | None) -> bool:
    """Whether an op's backward should add the gradient of ``weight`` (its forward's
    :func:`grad_target`) into ``weight.grad`` itself (:func:`add_product`) instead of
    returning it (the conditions: the module docstring)."""
    if weight is None or not _depth or torch.is_grad_enabled() or not torch.autograd._is_checkpoint_valid():
        return False
    if not _hooks_allow(weight):
        return False
    grad = weight.grad
    return grad is None or (
        type(grad) is torch.Tensor and grad.shape == weight.shape and grad.dtype == weight.dtype
        and grad.device == weight.device and grad.is_contiguous() and not grad.requires_grad
    )


def _wait_for_writes(weight: torch.Tensor) -> None:
    hooks = weight._backward_hooks
    for hook in list(hooks.values()) if hooks else ():
        hook(weight)


def add_product(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``weight.grad`` set to (None before) or increased by ``a @ b`` (``a`` [N, M], ``b``
    [M, K], ``weight`` [N, K]), the sum inside the matmul. Call only where
    :func:`accumulates_in_place` said so."""
    _wait_for_writes(weight)
    grad = weight.grad
    if grad is None:
        product = a.mm(b)
        weight.grad = product if product.dtype == weight.dtype else product.to(weight.dtype)
    elif a.dtype == grad.dtype:
        grad.addmm_(a, b)
    else:  # the weight's dtype differs from the activations' (float32 weights run in half precision)
        grad.add_(a.mm(b))


def add_sum(weight: torch.Tensor, summed: torch.Tensor) -> None:
    """``weight.grad`` set to or increased by ``summed`` (a float32 sum of chunks' products,
    [N, K]), rounded once into the gradient's dtype. Call only where
    :func:`accumulates_in_place` said so."""
    _wait_for_writes(weight)
    if weight.grad is None:
        weight.grad = summed.to(weight.dtype)
    else:
        weight.grad.add_(summed)


class GradOutput(NamedTuple):
    """Where a kernel writes a weight's gradient: ``tensor`` (the weight's ``.grad``), and whether it adds
    what ``tensor`` holds (False: the step's first call, ``tensor`` new and unwritten)."""

    tensor: torch.Tensor
    accumulate: bool


def grad_output(target: torch.Tensor | None) -> GradOutput | None:
    """For an op whose kernel can write a weight gradient itself (a reduction's): ``target.grad`` to add
    into, or a new tensor set as ``target.grad`` that the kernel must fill, where
    :func:`accumulates_in_place` says so (``target``: the forward's :func:`grad_target`); else None, and
    the op returns the gradient to autograd. The caller must write every element before anything reads
    the gradient (kernels on the current stream do)."""
    if not accumulates_in_place(target):
        return None
    _wait_for_writes(target)
    if target.grad is None:
        target.grad = torch.empty_like(target, memory_format=torch.contiguous_format)
        return GradOutput(target.grad, False)
    return GradOutput(target.grad, True)


def product_grad(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, target: torch.Tensor | None
                 ) -> torch.Tensor | None:
    """An op's weight gradient ``a @ b`` ([N, K]): added into ``target.grad`` (``target``: the forward's
    :func:`grad_target`) and None where :func:`accumulates_in_place` says so, else returned in ``dtype``
    for autograd to accumulate."""
    if accumulates_in_place(target):
        add_product(target, a, b)
        return None
    return a.mm(b).to(dtype)


def summed_grad(summed: torch.Tensor, dtype: torch.dtype, target: torch.Tensor | None) -> torch.Tensor | None:
    """As :func:`product_grad`, for a weight gradient already summed (in float32, over chunks)."""
    if accumulates_in_place(target):
        add_sum(target, summed)
        return None
    return summed.to(dtype)
