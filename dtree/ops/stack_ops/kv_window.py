"""KVWindow: one layer's K/V slots for leaf calls whose every layer is checkpointed.

A leaf call (a group with no child group) is the last reader of its own K/V: nothing
after it attends to them. With every decoder layer checkpointed, each layer's K/V are
needed only while that layer runs: in the call's forward (no graph kept), and again in the
layer's re-run, whose backward follows at once. So a leaf call needs its slots for one layer
at a time, not for every layer until its backward, as the KV stack keeps them. On the 64k
agentic tree under ``memory="low"`` (12k-token calls) the stack's K/V reach 18.9k slots
while the groups with children reach 6.7k: the leaf calls' 12.2k slots x 28 layers are
0.33 GiB of bf16 K/V on qwen2.5-1.5b, against 19 MiB for one layer's window.

The window holds slots ``[0, capacity)`` of one layer: :meth:`KVWindow.bind` copies the
stack's slots ``[0, base)`` of a layer (the call's ancestors, read in place by its
attention) into it and returns a :class:`WindowedLayer`, which stands for the KV stack in
the call's attention ops at layer 0: the call's own K/V are pushed into the window at the
slots the stack would hold them, reads see the window, and gradients of the ancestors'
slots go to the stack's gradient slots of the bound layer (which lie below every leaf
call's, :attr:`KVStack.grad_slots`).

Binding again (the next layer, the next call) makes the older :class:`WindowedLayer`
stale: reading its K/V raises, so a layer that was not checkpointed (its backward long
after its forward) fails loudly instead of reading another layer's K/V.

Only backends that read a call's own K/V from its slots and return their gradients whole
(the flash-attn backend's one-call path: ``OWN_KV_IN_STACK``, ``OWN_GRADS_IN_CALL``) run
in a window: they never add into a leaf call's own gradient slots, which the stack does
not have (:meth:`WindowedLayer.grad_slots_through` refuses slots past the stack's).
"""

from __future__ import annotations

import torch

from . import interface as stack_ops
from .kv_stack import KVStack

__all__ = ["KVWindow", "WindowedLayer"]


class KVWindow:
    """The window's buffers: ``k`` [1, capacity, kv_heads, head_dim], ``v`` [1, capacity,
    kv_heads, v_head_dim] in the model dtype (one layer of a :class:`KVStack` of that shape)."""

    def __init__(
        self, capacity: int, num_kv_heads: int, head_dim: int, *, v_head_dim: int | None = None,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        self.capacity, self.num_kv_heads, self.head_dim = capacity, num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.dtype = dtype
        self.k = torch.empty((1, capacity, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.empty((1, capacity, num_kv_heads, self.v_head_dim), dtype=dtype, device=device)
        self.device = self.k.device
        # counts bindings: a binding is live while it holds the latest count (the window keeps no
        # reference to it: a bound KV stack must not outlive the step through its window)
        self.bindings = 0

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def bind(self, stack: KVStack, layer: int, base: int) -> WindowedLayer:
        """The window for a call whose own slots start at ``base``, at ``layer`` of ``stack``:
        the stack's slots ``[0, base)`` of that layer copied in; older bindings go stale."""
        if (stack.num_kv_heads, stack.head_dim, stack.v_head_dim, stack.dtype) != (
            self.num_kv_heads, self.head_dim, self.v_head_dim, self.dtype
        ):
            raise ValueError("the KV window's shape or dtype differs from the stack it is bound to")
        if not 0 <= base <= min(stack.capacity, self.capacity):
            raise ValueError(f"a window bound at slot {base}: past the stack ({stack.capacity}) or the window "
                             f"({self.capacity})")
        if base:
            self.k[0, :base].copy_(stack.k[layer, :base])
            self.v[0, :base].copy_(stack.v[layer, :base])
        self.bindings += 1
        return WindowedLayer(self, stack, layer, self.bindings)


class WindowedLayer:
    """A :class:`KVStack` of one layer (index 0) for one bound call: K/V from the window,
    gradient slots from the stack's bound layer (see the module docstring)."""

    num_layers = 1

    def __init__(self, window: KVWindow, stack: KVStack, layer: int, binding: int) -> None:
        self.window, self.stack, self.layer, self.binding = window, stack, layer, binding
        self.capacity, self.dtype, self.device = window.capacity, window.dtype, window.device
        self.num_kv_heads, self.head_dim, self.v_head_dim = window.num_kv_heads, window.head_dim, window.v_head_dim

    def _live(self) -> KVWindow:
        if self.window.bindings != self.binding:
            raise RuntimeError(
                "a leaf call read its KV window after another layer or call had bound it: a layer ran its "
                "backward apart from its forward, which a window allows only for checkpointed layers (a bug in "
                "the step's plan: it runs leaf calls in the window only when every layer is checkpointed)"
            )
        return self.window

    @property
    def k(self) -> torch.Tensor:
        return self._live().k

    @property
    def v(self) -> torch.Tensor:
        return self._live().v

    @property
    def has_grad(self) -> bool:
        return self.stack.has_grad

    @property
    def grad_slots(self) -> int:
        return self.stack.grad_slots

    @property
    def grad_k(self) -> torch.Tensor | None:
        return None if self.stack.grad_k is None else self.stack.grad_k[self.layer : self.layer + 1]

    @property
    def grad_v(self) -> torch.Tensor | None:
        return None if self.stack.grad_v is None else self.stack.grad_v[self.layer : self.layer + 1]

    def grad_slots_through(self, end: int) -> None:
        """The stack's gradient slots through ``end``: slots of the window past the stack's
        capacity have none (a backend that adds into a leaf call's own slots cannot run here)."""
        if end > self.stack.capacity:
            raise RuntimeError(
                f"an attention op added gradients into KV-window slot {end - 1}, past the stack's {self.stack.capacity} "
                "slots: only backends that return a call's own K/V gradients whole run leaf calls in a window"
            )
        self.stack.grad_slots_through(end)

    def push(self, layer: int, lo: int, k: torch.Tensor, v: torch.Tensor, *, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None, device_lo: torch.Tensor | None = None) -> None:
        """:meth:`KVStack.push` into the window (``layer`` 0)."""
        window = self._live()
        stack_ops.push_kv(window.k[layer], window.v[layer], lo, k, v, cos=cos, sin=sin, device_lo=device_lo)

    def seed_grad(self, layer: int, lo: int, hi: int, gk, gv, dtypes, *, device_lo=None):
        """:meth:`KVStack.seed_grad` of the bound layer (``layer`` 0)."""
        return self.stack.seed_grad(self.layer + layer, lo, hi, gk, gv, dtypes, device_lo=device_lo)
