"""KVStack: preallocated K/V of the current root-to-node path, with gradient buffers.

Layout (one tensor each, all layers):
    k:              [layers, capacity, kv_heads, head_dim]    model dtype
    v:              [layers, capacity, kv_heads, v_head_dim]  model dtype
    grad_k, grad_v: same shapes as k, v                        float32

``v_head_dim`` differs from ``head_dim`` for multi-head latent attention (DeepSeek-V2/V3:
queries and keys 192 wide, values 128); it defaults to ``head_dim``.

Token-major slots match the packed varlen layout of queries (``[tokens, heads, dim]``),
so pushing a group's K/V is one contiguous copy per layer. Gradients are kept in
float32 because a shared prefix receives one contribution per descendant segment
(a GRPO prompt gets G of them); summing those in bf16 would lose the exactness the
runtime promises.

Life of a slot range ``[lo, hi)`` (one group of the schedule):
    push      the runtime clears the range's gradient slots (``zero_grad``, a separate
              call: storing K/V never touches gradients), then every layer of the
              group's forward stores its K/V in its :meth:`slots` (the runtime with
              :func:`dtree.ops.stack_glue.push_kv`, one launch; ``store_kv`` is the plain
              copy); a leaf group whose segments do not read each other does neither;
    read      descendants attend to it; their backward adds dK/dV (``accumulate``);
    pop       the group's backward adds ``grad_k/grad_v[:, lo:hi]`` into its K/V
              gradients (:func:`dtree.ops.stack_attention.seed_from_stack`) and the
              range is free for the next group.

The three operations are plain torch ops on slices of the buffers (``copy_``,
``add_`` / ``index_add_``, ``zero_``), as gpt-fast's KV cache does, so they trace
under ``torch.compile``. On the CUDA fast path the fused Triton kernel adds the prefix
gradients into ``grad_k/grad_v`` itself; ``accumulate`` serves the other backends.
"""

from __future__ import annotations

import torch

__all__ = ["KVStack"]


class KVStack:
    """The KV stack's buffers and its store / accumulate / zero operations.

    Args:
        num_layers, capacity, num_kv_heads, head_dim: the shape of ``k``.
        v_head_dim: the last dim of ``v`` (None: ``head_dim``).
        dtype: of ``k`` and ``v`` (the model's).
        device: where the buffers live.
        grad_dtype: of ``grad_k`` and ``grad_v``.
        with_grad: allocate the gradient buffers (not needed for log-prob passes).
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        dtype: torch.dtype,
        device: torch.device | str,
        grad_dtype: torch.dtype = torch.float32,
        with_grad: bool = True,
    ) -> None:
        self.num_layers, self.capacity, self.num_kv_heads, self.head_dim = num_layers, capacity, num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.dtype = dtype
        k_shape = (num_layers, capacity, num_kv_heads, head_dim)
        v_shape = (num_layers, capacity, num_kv_heads, self.v_head_dim)
        self.k = torch.empty(k_shape, dtype=dtype, device=device)
        self.device = self.k.device  # with its index: "cuda" becomes "cuda:0"
        self.v = torch.empty(v_shape, dtype=dtype, device=device)
        self.grad_k = torch.empty(k_shape, dtype=grad_dtype, device=device) if with_grad else None
        self.grad_v = torch.empty(v_shape, dtype=grad_dtype, device=device) if with_grad else None

    @property
    def has_grad(self) -> bool:
        return self.grad_k is not None

    def fits(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        with_grad: bool,
        v_head_dim: int | None = None,
    ) -> bool:
        """Whether this stack can serve a step that needs these shapes (a larger
        capacity serves a smaller one)."""
        return (
            self.num_layers == num_layers
            and self.capacity >= capacity
            and self.num_kv_heads == num_kv_heads
            and self.head_dim == head_dim
            and self.v_head_dim == (head_dim if v_head_dim is None else v_head_dim)
            and self.dtype == dtype
            and self.device == torch.empty(0, device=device).device
            and (self.has_grad or not with_grad)
        )

    def nbytes(self) -> int:
        total = self.k.nbytes + self.v.nbytes
        if self.has_grad:
            total += self.grad_k.nbytes + self.grad_v.nbytes
        return total

    def slots(self, layer: int, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V slots ``[lo, lo + n)`` of ``layer``: contiguous ``[n, kv_heads, dim]``
        views a push writes into (:func:`dtree.ops.stack_glue.push_kv`, the runtime's:
        one launch for both on CUDA)."""
        return self.k[layer, lo : lo + n], self.v[layer, lo : lo + n]

    def store_kv(self, layer: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy ``k`` [T, kv_heads, head_dim] and ``v`` [T, kv_heads, v_head_dim] (any
        strides, any float dtype) into the K/V slots ``[lo, lo + T)`` of ``layer``
        (values only: the gradient slots are :meth:`zero_grad`'s)."""
        k_slots, v_slots = self.slots(layer, lo, k.shape[0])
        k_slots.copy_(k)
        v_slots.copy_(v)

    def zero_grad(self, lo: int, hi: int) -> None:
        """Clear the gradient slots ``[lo, hi)`` of every layer."""
        if self.has_grad:
            self.grad_k[:, lo:hi].zero_()
            self.grad_v[:, lo:hi].zero_()

    def accumulate(self, layer: int, index: torch.Tensor | slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add ``dk`` [n, kv_heads, head_dim] and ``dv`` [n, kv_heads, v_head_dim] into
        the gradient slots ``index`` of ``layer``: a slice, or a LongTensor of n slots
        (repeats allowed: every one is added)."""
        if isinstance(index, slice):
            # explicit arithmetic instead of slice.indices(), which torch.compile cannot trace
            start = 0 if index.start is None else index.start
            stop = self.capacity if index.stop is None else index.stop
            step = 1 if index.step is None else index.step
            if step == 1:
                if dk.shape[0] != stop - start or dv.shape[0] != stop - start:  # add_ would broadcast one row
                    raise ValueError(f"{dk.shape[0]} rows of dK/dV for the {stop - start} slots [{start}, {stop})")
                self.grad_k[layer, start:stop].add_(dk.to(self.grad_k.dtype))
                self.grad_v[layer, start:stop].add_(dv.to(self.grad_v.dtype))
                return
            index = torch.arange(start, stop, step, device=self.device)
        self.grad_k[layer].index_add_(0, index, dk.to(self.grad_k.dtype))
        self.grad_v[layer].index_add_(0, index, dv.to(self.grad_v.dtype))
