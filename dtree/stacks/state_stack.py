"""StateStack: the recurrent states of the current root-to-node path, with gradient buffers.

The KV stack's counterpart for recurrent layers (gated DeltaNet, Mamba, short
convolutions, linear attention). Such a layer carries a state along the sequence instead
of K/V: a conv window (the last ``kernel - 1`` inputs) and a recurrent or SSM state. At
the end of a segment whose children run in later model calls, each recurrent layer
stores the segment's final state in one slot here; each child call reads it as its
initial state. Every state is a named buffer of its own layer:

    value[(layer, name)]: [capacity, *shape]  float32
    grad[(layer, name)]:  [capacity, *shape]  float32 (training walks)

Float32 for both, whatever the model's dtype: the states of the reference torch paths
are float32, and a parent's state gradient is the sum of one contribution per child
(a GRPO prompt gets G of them), which bf16 would not keep exact.

Life of a slot (one segment with children in later calls, docs/design.md section 4):
    push      the segment's call zeroes the slot's gradient (``zero_grad``, with the
              call's other slots) and stores the final state (``store``);
    read      each child call reads it (``read``); its backward adds d(loss)/d(state)
              (``accumulate``);
    pop       the segment's backward adds the slot's gradient to its final state's
              (:mod:`dtree.ops.segment_states`), after every child's backward ran.

Whether a child's read takes a gradient is decided per layer by what is trainable (see
``LayerStates``), not by the stored value: a recomputed parent stores its states
without grad and computes them with grad only at its backward, after its children ran.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

__all__ = ["StateStack"]

StateKey = tuple[int, str]


class StateStack:
    """Preallocated recurrent-state slots of every recurrent layer.

    Args:
        states: ``(layer, name, shape)`` of every state (``ModelSpec.recurrent_states``).
        capacity: slots per state.
        device: where the buffers live.
        with_grad: allocate the gradient buffers (not needed for log-prob passes).
        dtype: of the values and gradients (float32; float64 for float64 models).
    """

    def __init__(
        self,
        states: Iterable[tuple[int, str, tuple[int, ...]]],
        capacity: int,
        *,
        device,
        with_grad: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.capacity, self.dtype = capacity, dtype
        self.shapes: dict[StateKey, tuple[int, ...]] = {(layer, name): tuple(shape) for layer, name, shape in states}
        self.value = {
            key: torch.zeros((capacity, *shape), dtype=dtype, device=device) for key, shape in self.shapes.items()
        }
        self.grad = (
            {key: torch.zeros_like(v) for key, v in self.value.items()} if with_grad else None
        )
        self.device = torch.empty(0, device=device).device

    @property
    def has_grad(self) -> bool:
        return self.grad is not None

    def nbytes(self) -> int:
        total = sum(v.nbytes for v in self.value.values())
        return total * 2 if self.has_grad else total

    def fits(self, states, capacity: int, device, with_grad: bool, dtype: torch.dtype = torch.float32) -> bool:
        """Whether this stack serves a step with these states and at least ``capacity`` slots."""
        return (
            self.shapes == {(layer, name): tuple(shape) for layer, name, shape in states}
            and self.dtype == dtype
            and self.capacity >= capacity
            and self.device == torch.empty(0, device=device).device
            and (self.has_grad or not with_grad)
        )

    def _key(self, layer: int, name: str, shape: tuple[int, ...] | None = None) -> StateKey:
        key = (layer, name)
        if key not in self.shapes:
            raise KeyError(f"layer {layer} has no recurrent state {name!r} (the stack holds {sorted(self.shapes)})")
        if shape is not None and tuple(shape) != self.shapes[key]:
            raise ValueError(
                f"layer {layer}'s state {name!r} has shape {tuple(shape)} but the state stack was sized for "
                f"{self.shapes[key]} (ModelSpec.recurrent_states)"
            )
        return key

    def index(self, slots: np.ndarray) -> torch.Tensor:
        """``slots`` as a LongTensor on the stack's device (what the methods below take as
        ``index``; callers that use the same slots in every layer make it once)."""
        return torch.as_tensor(np.asarray(slots, dtype=np.int64)).to(self.device)

    def store(self, layer: int, name: str, slots: np.ndarray, states: torch.Tensor, index=None) -> None:
        """Copy ``states`` [n, *shape] (values only) into ``slots`` [n] of ``(layer, name)``."""
        key = self._key(layer, name, states.shape[1:])
        index = self.index(slots) if index is None else index
        self.value[key].index_copy_(0, index, states.detach().to(self.dtype))

    def read(self, layer: int, name: str, slots: np.ndarray, index=None) -> torch.Tensor:
        """[n, *shape] float32 copy of ``slots`` [n] (repeats allowed)."""
        key = self._key(layer, name)
        return self.value[key].index_select(0, self.index(slots) if index is None else index)

    def accumulate(self, layer: int, name: str, slots: np.ndarray, grad: torch.Tensor, index=None) -> None:
        """Add ``grad`` [n, *shape] into the gradient slots (repeats: every one is added)."""
        key = self._key(layer, name)
        self.grad[key].index_add_(0, self.index(slots) if index is None else index, grad.to(self.dtype))

    def grad_of(self, layer: int, name: str, slots: np.ndarray, index=None) -> torch.Tensor:
        """[n, *shape] float32 copy of the gradient slots."""
        key = self._key(layer, name)
        return self.grad[key].index_select(0, self.index(slots) if index is None else index)

    def zero_grad(self, lo: int, hi: int) -> None:
        """Clear the gradient slots ``[lo, hi)`` of every state."""
        if self.has_grad:
            for key in self.shapes:
                self.grad[key][lo:hi].zero_()
