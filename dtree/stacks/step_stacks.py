"""StepStacks: the stacks one step's walk keeps, sized from the model's layers.

* one :class:`~dtree.ops.stack_ops.kv_stack.KVStack` per distinct attention shape ``(kv_heads,
  head_dim, v_head_dim)``, holding the layers of that shape: a plain model has one
  stack of all its layers; Gemma 4 (global layers with another head dim) has two; a
  hybrid model's stacks hold only its attention layers;
* one :class:`~dtree.stacks.state_stack.StateStack` when the model has recurrent layers;
* with ``window_tokens``, one :class:`~dtree.ops.stack_ops.kv_window.KVWindow` per KV stack: one
  layer's slots, where leaf calls run when every layer is checkpointed (:meth:`StepStacks.window_of`).

The attention ops take a KVStack and a layer index inside it: :meth:`StepStacks.kv_of`
maps a decoder layer to both.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..ops.linear_recurrence import state_dtype
from ..ops.logprobs import compute_dtype
from ..ops.stack_ops.kv_stack import KVStack
from ..ops.stack_ops.kv_window import KVWindow, WindowedLayer
from .state_stack import StateStack

__all__ = ["StackShapes", "StepStacks"]


class StackShapes(Protocol):
    """What the stacks read of a model's shapes (:class:`dtree.models.ModelSpec` is one)."""

    @property
    def attention_layers(self) -> tuple[int, ...]: ...

    @property
    def recurrent_states(self) -> tuple[tuple[int, str, tuple[int, ...]], ...]: ...

    def kv_shape(self, layer: int) -> tuple[int, int, int] | None: ...


def kv_groups(spec: StackShapes) -> dict[tuple[int, int, int], list[int]]:
    """Attention shape -> the decoder layers of that shape, in layer order."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for layer in spec.attention_layers:
        groups.setdefault(spec.kv_shape(layer), []).append(layer)
    return groups


class StepStacks:
    """The KV stacks and the state stack of a model (see the module docstring).

    Args:
        spec: the model's shapes (``attention_layers``, ``kv_shape``, ``recurrent_states``).
        tokens: KV-stack capacity in tokens.
        state_slots: state-stack capacity in slots.
        dtype: of K/V (the model's). The K/V gradient slots are in its compute dtype
            (float32; float64 for a float64 model: a float32 sum would cap a float64
            model at float32 accuracy), the states and their gradients in
            :func:`~dtree.ops.linear_recurrence.state_dtype` (the same rule).
        device: where the buffers live.
        with_grad: allocate gradient buffers.
        grad_tokens: KV gradient slots (None: ``tokens``; :attr:`KVStack.grad_slots`).
        window_tokens: slots of each KV stack's window (0: none).
    """

    def __init__(
        self, spec: StackShapes, tokens: int, state_slots: int, *, dtype: torch.dtype, device, with_grad: bool,
        grad_tokens: int | None = None, window_tokens: int = 0,
    ) -> None:
        self.spec, self.tokens, self.state_slots, self.dtype = spec, tokens, state_slots, dtype
        self.window_tokens = window_tokens
        self.kv: list[KVStack] = []
        self.windows: list[KVWindow] = []
        self._where: dict[int, tuple[int, int]] = {}
        for (heads, dim, v_dim), layers in kv_groups(spec).items():
            for local, layer in enumerate(layers):
                self._where[layer] = (len(self.kv), local)
            self.kv.append(
                KVStack(
                    len(layers), tokens, heads, dim, v_head_dim=v_dim, dtype=dtype, device=device,
                    grad_dtype=compute_dtype(dtype), with_grad=with_grad, grad_slots=grad_tokens,
                )
            )
            if window_tokens:
                self.windows.append(KVWindow(window_tokens, heads, dim, v_head_dim=v_dim, dtype=dtype, device=device))
        self.states = (
            StateStack(spec.recurrent_states, state_slots, device=device, with_grad=with_grad, dtype=state_dtype(dtype))
            if spec.recurrent_states
            else None
        )
        self.device = torch.empty(0, device=device).device
        self.with_grad = with_grad
        self.released = False

    @property
    def has_grad(self) -> bool:
        return self.with_grad

    @property
    def capacity(self) -> int:
        """KV-stack slots (tokens) each KV stack holds, as :attr:`KVStack.capacity`."""
        return self.tokens

    def kv_of(self, layer: int) -> tuple[KVStack, int]:
        """(the KV stack holding ``layer``, the layer's index in it)."""
        if layer not in self._where:
            raise ValueError(f"layer {layer} has no attention in this model's spec; it has no K/V stack")
        stack, local = self._where[layer]
        return self.kv[stack], local

    def window_of(self, layer: int, base: int) -> tuple[WindowedLayer, int]:
        """(the window of ``layer``'s KV stack bound to that layer for a leaf call whose slots
        start at ``base`` (:meth:`KVWindow.bind`), its layer index: 0)."""
        if not self.windows:
            raise ValueError("these stacks have no KV window (window_tokens=0)")
        stack, local = self._where[layer]
        return self.windows[stack].bind(self.kv[stack], local, base), 0

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer: K/V values and gradients of each KV stack, states and their gradients."""
        out = [t for s in self.kv for t in (s.k, s.v, s.grad_k, s.grad_v) if t is not None]
        out += [t for w in self.windows for t in (w.k, w.v)]
        if self.states is not None:
            out += list(self.states.value.values()) + list((self.states.grad or {}).values())
        return out

    def nbytes(self) -> int:
        states = self.states.nbytes() if self.states is not None else 0
        return sum(s.nbytes() for s in self.kv) + sum(w.nbytes() for w in self.windows) + states

    def release(self) -> None:
        """Drop every buffer now, whoever still holds this object: the step's plan is
        alive in the runtime's frame (or a failed step's traceback) when the runtime
        releases memory after a call, and ``torch.cuda.empty_cache`` can only return
        blocks nothing references. An empty shell afterwards: it fits no step."""
        self.kv, self.windows, self._where, self.states = [], [], {}, None
        self.tokens = self.state_slots = self.window_tokens = 0
        self.released = True

    @property
    def grad_tokens(self) -> int:
        """KV gradient slots each KV stack holds now (:attr:`KVStack.grad_slots`; 0 without)."""
        return min((s.grad_slots for s in self.kv), default=0)

    def fits(
        self, spec: StackShapes, tokens: int, state_slots: int, dtype: torch.dtype, device, with_grad: bool,
        grad_tokens: int | None = None, window_tokens: int = 0,
    ) -> bool:
        """Whether these stacks serve a step needing ``tokens`` KV slots, ``grad_tokens``
        of them with gradient slots (None: all), ``state_slots`` and a window of ``window_tokens``."""
        return (
            not self.released
            and self.window_tokens >= window_tokens
            and (not with_grad or not self.kv or self.grad_tokens >= (tokens if grad_tokens is None else grad_tokens))
            and self.spec.attention_layers == spec.attention_layers
            and all(self.spec.kv_shape(i) == spec.kv_shape(i) for i in spec.attention_layers)
            and self.spec.recurrent_states == spec.recurrent_states
            and self.tokens >= tokens
            and self.state_slots >= state_slots
            and self.dtype == dtype
            and self.device == torch.empty(0, device=device).device
            and (self.with_grad or not with_grad)
        )

    def zero_grad(
        self, lo: int, hi: int, state_lo: int = 0, state_hi: int = 0, *, device_lo: torch.Tensor | None = None
    ) -> None:
        """Clear the KV gradient slots ``[lo, hi)`` of every layer and the state slots
        ``[state_lo, state_hi)`` of every recurrent state. ``device_lo``: ``lo`` on the
        device (:meth:`KVStack.zero_grad`)."""
        for stack in self.kv:
            stack.zero_grad(lo, hi, device_lo=device_lo)
        if self.states is not None and state_hi > state_lo:
            self.states.zero_grad(state_lo, state_hi)
