"""KVStack: preallocated K/V of the current root-to-node path, with gradient buffers.

Layout (one tensor each, all layers):
    k:              [layers, capacity, kv_heads, head_dim]    model dtype
    v:              [layers, capacity, kv_heads, v_head_dim]  model dtype
    grad_k, grad_v: [layers, grad_slots, ...] as k, v          float32 (float64 for a float64 model)

``v_head_dim`` differs from ``head_dim`` for multi-head latent attention (DeepSeek-V2/V3:
queries and keys 192 wide, values 128); it defaults to ``head_dim``.

Token-major slots match the packed varlen layout of queries (``[tokens, heads, dim]``),
so pushing a group's K/V is one contiguous copy per layer. Gradients are kept in
float32 because a shared prefix receives one contribution per descendant segment
(a GRPO prompt gets G of them); summing those in bf16 would lose the exactness the
runtime promises. A float64 model gets float64 gradient slots (the runtime passes
``grad_dtype``), or its gradients would stop at float32 accuracy.

Gradient slots can be fewer than K/V slots (``grad_slots``): with a backend whose call
returns its own K/V gradients whole (the flash-attn backend's one-call path), only the
slots of groups with children ever collect gradients, and those lie below every leaf
call's; the K/V of the leaf calls above them need no float32 twin (on the 64k agentic tree
at 16k-token calls, ~22k K/V slots and ~7k gradient slots: 0.8 GiB less on qwen2.5-1.5b).
The slots past ``grad_slots`` read as zero; an op that adds into them grows the gradient
buffers first (:meth:`KVStack.grad_slots_through`), so a call that takes another path
(a fallback inside the backend) stays exact. With every layer checkpointed, the same backends
run leaf calls in a one-layer window instead (:mod:`dtree.ops.stack_ops.kv_window`), and the
stack's K/V slots stop at the groups with children too.

Life of a slot range ``[lo, hi)`` (one group of the schedule):
    push      the walk clears the range's gradient slots (``zero_grad``, a separate
              call: pushing K/V never touches gradients), then every layer of the
              group's forward pushes its K/V there (``push``); a leaf group whose
              segments do not read each other does neither (its slots are never written,
              and the stack is sized by the slots a step writes);
    read      descendants attend to it; their backward adds dK/dV (``accumulate``);
    pop       the group's backward adds ``grad_k/grad_v[:, lo:hi]`` into its K/V
              gradients (``seed_grad``, from :func:`dtree.ops.stack_attention.seed_from_stack`) and the
              range is free for the next group.

The operations are those of :mod:`dtree.ops.stack_ops`: on a GPU with the CUDA
extension built (``csrc/``), one kernel each for K and V together, reading the slot
offset from device memory (``device_lo``) so that a call's stack ops can be captured
in a CUDA graph; otherwise plain torch ops on slices of the buffers (``copy_``,
``add_`` / ``index_add_``, ``zero_``), as gpt-fast's KV cache does, which trace under
``torch.compile``. Both give the same bits. On the CUDA fast path the fused Triton
kernel adds the prefix gradients into ``grad_k/grad_v`` itself; ``accumulate`` serves
the other backends, with a fixed-order (deterministic) sum where slots repeat.
"""

from __future__ import annotations

import torch

from . import interface as stack_ops
from . import reference as stack_ops_torch

__all__ = ["KVStack"]


class KVStack:
    """The KV stack's buffers and its push / seed_grad (pop) / accumulate / zero_grad operations.

    Args:
        num_layers, capacity, num_kv_heads, head_dim: the shape of ``k``.
        v_head_dim: the last dim of ``v`` (None: ``head_dim``).
        dtype: of ``k`` and ``v`` (the model's).
        device: where the buffers live.
        grad_dtype: of ``grad_k`` and ``grad_v``.
        with_grad: allocate the gradient buffers (not needed for log-prob passes).
        grad_slots: gradient slots (None: ``capacity``; at most ``capacity``).
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
        grad_slots: int | None = None,
    ) -> None:
        grad_slots = capacity if grad_slots is None else grad_slots
        if not 0 <= grad_slots <= capacity:
            raise ValueError(f"grad_slots must be in [0, capacity={capacity}], got {grad_slots}")
        self.num_layers, self.capacity, self.num_kv_heads, self.head_dim = num_layers, capacity, num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.dtype = dtype
        k_shape = (num_layers, capacity, num_kv_heads, head_dim)
        v_shape = (num_layers, capacity, num_kv_heads, self.v_head_dim)
        self.k = torch.empty(k_shape, dtype=dtype, device=device)
        self.device = self.k.device  # with its index: "cuda" becomes "cuda:0"
        self.v = torch.empty(v_shape, dtype=dtype, device=device)
        g_shape = (num_layers, grad_slots)
        self.grad_k = torch.empty(g_shape + k_shape[2:], dtype=grad_dtype, device=device) if with_grad else None
        self.grad_v = torch.empty(g_shape + v_shape[2:], dtype=grad_dtype, device=device) if with_grad else None

    @property
    def has_grad(self) -> bool:
        return self.grad_k is not None

    @property
    def grad_slots(self) -> int:
        """Slots ``[0, grad_slots)`` have gradient buffers (0 without them)."""
        return self.grad_k.shape[1] if self.grad_k is not None else 0

    def grad_slots_through(self, end: int) -> None:
        """Make the gradient buffers hold slots ``[0, end)`` (``end`` clipped to the
        capacity): a larger buffer, the old slots copied and the new ones zero, when they
        are short. Called by every op that adds into gradient slots, before it takes a view
        of them: the slots past the old end read as zero (:meth:`seed_grad`), which the new
        ones are."""
        end = min(end, self.capacity)
        if not self.has_grad or end <= self.grad_slots:
            return
        for name in ("grad_k", "grad_v"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], end, *old.shape[2:]))
            new[:, : old.shape[1]].copy_(old)
            setattr(self, name, new)

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
        grad_slots: int | None = None,
    ) -> bool:
        """Whether this stack can serve a step that needs these shapes (a larger
        capacity serves a smaller one; ``grad_slots`` None: ``capacity``)."""
        return (
            self.num_layers == num_layers
            and self.capacity >= capacity
            and self.num_kv_heads == num_kv_heads
            and self.head_dim == head_dim
            and self.v_head_dim == (head_dim if v_head_dim is None else v_head_dim)
            and self.dtype == dtype
            and self.device == torch.empty(0, device=device).device
            and (self.has_grad or not with_grad)
            and (not with_grad or self.grad_slots >= (capacity if grad_slots is None else grad_slots))
        )

    def nbytes(self) -> int:
        total = self.k.nbytes + self.v.nbytes
        if self.has_grad:
            total += self.grad_k.nbytes + self.grad_v.nbytes
        return total

    def push(
        self,
        layer: int,
        lo: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        device_lo: torch.Tensor | None = None,
    ) -> None:
        """Copy ``k`` [T, kv_heads, head_dim] and ``v`` [T, kv_heads, v_head_dim] (any
        strides, any float dtype) into the K/V slots ``[lo, lo + T)`` of ``layer``
        (values only: the gradient slots are :meth:`zero_grad`'s). ``cos``/``sin``
        [T, R]: rotate ``k`` first (HF's ``rotate_half`` convention, float32 math).
        ``device_lo``: ``lo`` as a one-element int64 tensor on the stack's device (the
        extension reads the offset there; :func:`dtree.ops.stack_ops.push_kv`)."""
        stack_ops.push_kv(self.k[layer], self.v[layer], lo, k, v, cos=cos, sin=sin, device_lo=device_lo)

    def zero_grad(self, lo: int, hi: int, *, device_lo: torch.Tensor | None = None) -> None:
        """Clear the gradient slots ``[lo, hi)`` of every layer (those past
        :attr:`grad_slots` are zero already)."""
        hi = min(hi, self.grad_slots)
        if self.has_grad and hi > lo:
            stack_ops.zero_slots(self.grad_k, self.grad_v, lo, hi - lo, device_lo=device_lo)

    def seed_grad(
        self,
        layer: int,
        lo: int,
        hi: int,
        gk: torch.Tensor | None,
        gv: torch.Tensor | None,
        dtypes: tuple[torch.dtype, torch.dtype],
        *,
        device_lo: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_k[layer, lo:hi] + gk, grad_v[layer, lo:hi] + gv)`` rounded to ``dtypes``
        (a missing ``gk``/``gv`` adds nothing): a call's K/V gradients completed with the
        slots' (:func:`dtree.ops.stack_ops.seed_grad`); slots past :attr:`grad_slots` add
        nothing (no op wrote them)."""
        kept = max(0, min(hi, self.grad_slots) - lo)  # the rows whose slots have buffers
        if kept == hi - lo:
            return stack_ops.seed_grad(
                self.grad_k[layer], self.grad_v[layer], lo, gk, gv, hi - lo, *dtypes, device_lo=device_lo
            )
        seeded = (None, None)
        if kept:
            seeded = stack_ops.seed_grad(self.grad_k[layer], self.grad_v[layer], lo, None if gk is None else gk[:kept],
                                         None if gv is None else gv[:kept], kept, *dtypes, device_lo=device_lo)
        out = []
        for head, g, slots, dtype in zip(seeded, (gk, gv), (self.grad_k, self.grad_v), dtypes):
            rest = hi - lo - kept  # slots no op wrote: the call's own gradient alone
            tail = g[kept:].to(dtype) if g is not None else slots.new_zeros((rest, *slots.shape[2:]), dtype=dtype)
            out.append(tail if head is None else torch.cat([head, tail]))
        return out[0], out[1]

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k[layer, index], v[layer, index])`` for an int64 ``index`` [n] of slots."""
        return stack_ops.gather_slots(self.k[layer], self.v[layer], index)

    def accumulate(
        self, layer: int, index: torch.Tensor | slice | stack_ops.SlotRows, dk: torch.Tensor, dv: torch.Tensor
    ) -> None:
        """Add ``dk`` [n, kv_heads, head_dim] and ``dv`` [n, kv_heads, v_head_dim] into
        the gradient slots ``index`` of ``layer``: a slice, a LongTensor of n slots, or a
        :class:`~dtree.ops.stack_ops.SlotRows` (its host-built order tables). Repeated
        slots are summed in row order by a fixed-order segmented reduction
        (:func:`dtree.ops.stack_ops.segment_add`): the same bits in every run."""
        if isinstance(index, slice):
            self.grad_slots_through(self.capacity if index.stop is None else index.stop)
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
        self.grad_slots_through(self.capacity)  # the rows' largest slot is on the device
        if isinstance(index, torch.Tensor):
            if not stack_ops.uses_extension(self.grad_k):  # the torch op of the fallback, traceable
                stack_ops_torch.segment_add(self.grad_k[layer], self.grad_v[layer], index, dk, dv)
                return
            index = stack_ops.SlotRows.from_tensor(index)
        stack_ops.segment_add(self.grad_k[layer], self.grad_v[layer], index, dk, dv)
