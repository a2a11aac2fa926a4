"""KVStack: preallocated K/V of the current root-to-node path, with gradient buffers.

Layout (one tensor each, all layers):
    k, v:           [layers, capacity, kv_heads, head_dim] model dtype
    grad_k, grad_v: [layers, capacity, kv_heads, head_dim] float32

Token-major slots match the packed varlen layout of queries (``[tokens, heads, dim]``),
so pushing a group's K/V is one contiguous copy per layer. Gradients are kept in
float32 because a shared prefix receives one contribution per descendant segment
(a GRPO prompt gets G of them); summing those in bf16 would lose the exactness the
runtime promises.

Life of a slot range ``[lo, hi)`` (one group of the schedule):
    push      the group's forward writes its K/V (``write``) and zeroes its gradients
              (``zero_grad``);
    read      descendants attend to it; their backward adds dK/dV (``accumulate``);
    pop       the group's backward seeds autograd with ``grad_k[:, lo:hi]`` and the
              range is free for the next group (the next push zeroes it again).

``write``, ``accumulate`` and ``zero_grad`` run the ops of :mod:`dtree.kv_stack_ext`
(K and V in one kernel launch; pure-torch references when the extension is missing).
"""

from __future__ import annotations

import torch

from . import kv_stack_ext

__all__ = ["KVStack"]


class KVStack:
    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        grad_dtype: torch.dtype = torch.float32,
        with_grad: bool = True,
    ) -> None:
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.num_layers, self.capacity, self.num_kv_heads, self.head_dim = shape
        self.dtype = dtype
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.device = self.k.device  # with its index: "cuda" becomes "cuda:0"
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.grad_k = torch.empty(shape, dtype=grad_dtype, device=device) if with_grad else None
        self.grad_v = torch.empty(shape, dtype=grad_dtype, device=device) if with_grad else None

    @property
    def has_grad(self) -> bool:
        return self.grad_k is not None

    def fits(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, with_grad: bool) -> bool:
        return (
            self.num_layers == num_layers
            and self.capacity >= capacity
            and self.num_kv_heads == num_kv_heads
            and self.head_dim == head_dim
            and self.dtype == dtype
            and self.device == torch.empty(0, device=device).device
            and (self.has_grad or not with_grad)
        )

    def nbytes(self) -> int:
        total = self.k.nbytes + self.v.nbytes
        if self.has_grad:
            total += self.grad_k.nbytes + self.grad_v.nbytes
        return total

    def write(self, layer: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Push values: ``k, v`` are [T, kv_heads, head_dim] for slots ``[lo, lo+T)``."""
        kv_stack_ext.push(self.k, self.v, layer, k, v, start=lo)

    def zero_grad(self, lo: int, hi: int) -> None:
        """Clear the gradient slots ``[lo, hi)`` of every layer."""
        if self.has_grad:
            kv_stack_ext.zero_grad(self.grad_k, self.grad_v, lo, hi)

    def accumulate(self, layer: int, index: torch.Tensor | slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add dK/dV ([n, kv_heads, head_dim]) into the slots ``index`` (a slice or a
        LongTensor of n slots, which may repeat)."""
        if isinstance(index, slice):
            # explicit arithmetic instead of slice.indices(), which torch.compile cannot trace
            start = 0 if index.start is None else index.start
            stop = self.capacity if index.stop is None else index.stop
            step = 1 if index.step is None else index.step
            if step == 1 and 0 <= start and stop - start == dk.shape[0]:
                kv_stack_ext.accumulate(self.grad_k, self.grad_v, layer, dk, dv, start=start)
                return
            # a strided (or mis-sized) slice: as slots, which the op checks against dk
            index = torch.arange(start, stop, step, device=self.device)
        kv_stack_ext.accumulate(self.grad_k, self.grad_v, layer, dk, dv, index=index)
