"""Recurrent states of the packed segments of one model call, over the state stack.

A recurrent layer (short convolution, gated DeltaNet, Mamba, linear attention) carries
a state along the sequence. Segment ``i`` of a call starts from its parent's final
state, which is one of

* nothing: a root segment starts from zeros;
* the state stack (:class:`dtree.stacks.state_stack.StateStack`): the parent ran in an earlier
  call, which stored its final state in slot ``read_slot[i]``;
* the same call: the parent is segment ``call_parent[i]`` of this call (a closed
  subtree packed into one call), whose final state the op computes first and hands
  on inside the autograd graph.

A segment with children in later calls stores its final state in slot ``push_slot[i]``.

Gradients (the state analogue of :func:`dtree.ops.stack_attention.seed_from_stack`):

* a state read from the stack passes through :class:`_StateRead`, whose backward adds
  d(loss)/d(initial state) into the slot's gradient buffer (the parent's backward has
  not run yet: it runs after all its children's, depth first);
* the final states a call stores pass through :class:`_StateSeed` on the op's output,
  an identity whose backward adds the slots' gradients (every later child's
  contribution, complete by then) to d(loss)/d(final state). Autograd sums them with
  the in-call children's contributions before the state's own backward runs.

Both are plain autograd nodes inside whatever graph computed the layer, so layer
checkpointing and HF gradient checkpointing, which re-run a layer in backward, re-read
and re-seed the same slots (the re-run stores the same values).

:class:`StateLayout` holds a call's host tables (one per call, shared by its layers);
:class:`LayerStates` is what one layer's op receives: the layout, the stack, the layer,
whether the call stores states, and the recurrence backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol

import numpy as np
import torch

__all__ = ["StateLayout", "LayerStates", "StateSlots"]


class StateSlots(Protocol):
    """What the ops read and write of the state stack (:class:`dtree.stacks.state_stack.StateStack`,
    which sits above the ops): per ``(layer, name)``, slots [n] of states [n, *shape]."""

    def has_grad(self) -> bool: ...

    def store(self, layer: int, name: str, slots: np.ndarray, states: torch.Tensor, index=None) -> None: ...

    def read(self, layer: int, name: str, slots: np.ndarray, index=None) -> torch.Tensor: ...

    def accumulate(self, layer: int, name: str, slots: np.ndarray, grad: torch.Tensor, index=None) -> None: ...

    def grad_of(self, layer: int, name: str, slots: np.ndarray, index=None) -> torch.Tensor: ...


@dataclass
class StateLayout:
    """Where the segments of one call take their initial states and leave their final ones.

    Attributes:
        q_offsets: [S+1] row offsets of the segments (packed varlen).
        call_parent: [S] the segment's parent in this call (an earlier segment), or -1.
        read_slot: [S] state-stack slot of the parent's final state when the parent ran
            in an earlier call, else -1 (a root, or a parent in this call).
        push_slot: [S] slot where the segment's final state goes (it has children in later
            calls), else -1.
    """

    q_offsets: np.ndarray
    call_parent: np.ndarray
    read_slot: np.ndarray
    push_slot: np.ndarray
    _derived: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def roots(cls, q_offsets) -> "StateLayout":
        """Independent segments that each start from zeros (linearized sequences, the probe)."""
        q_offsets = np.asarray(q_offsets, dtype=np.int64)
        none = np.full(len(q_offsets) - 1, -1, dtype=np.int64)
        return cls(q_offsets, none, none.copy(), none.copy())

    @property
    def num_segments(self) -> int:
        return len(self.q_offsets) - 1

    @property
    def num_rows(self) -> int:
        return int(self.q_offsets[-1])

    def cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` for this call (tables every layer shares)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def levels(self) -> list[np.ndarray]:
        """Segment indices by depth inside the call: level 0 has no parent in the call,
        level d + 1 the children of level d (so a level's initial states are known when it runs)."""

        def build():
            depth = np.zeros(self.num_segments, dtype=np.int64)
            for i, p in enumerate(self.call_parent):
                if p >= 0:
                    if p >= i:
                        raise ValueError(f"segment {i}'s in-call parent {p} does not come before it")
                    depth[i] = depth[p] + 1
            return [np.flatnonzero(depth == d) for d in range(int(depth.max(initial=0)) + 1)]

        return self.cached("levels", build)

    def pushing(self) -> np.ndarray:
        """The segments that store their final state."""
        return self.cached("pushing", lambda: np.flatnonzero(self.push_slot >= 0))

    def rows_of(self, segments: np.ndarray) -> np.ndarray:
        """The call rows of ``segments``, in their order."""
        starts, stops = self.q_offsets[segments], self.q_offsets[segments + 1]
        lengths = stops - starts
        return np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)

    def device_index(self, key: Hashable, values: Callable[[], np.ndarray], device: torch.device) -> torch.Tensor:
        """A host table as a LongTensor on ``device``, built and copied once per call."""
        return self.cached(("index", key, device), lambda: torch.as_tensor(values()).to(device))

    def conv_tables(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Gather tables of a causal convolution with ``width = kernel - 1``.

        Returns ``(window_segments, z_index, out_rows, final_index)``: the segments whose
        initial window comes from the stack; ``z_index`` [T + S*width] lays out, per
        segment, its ``width`` preceding inputs then its own rows, as indices into
        ``src = cat(x [T], stack windows [len(window_segments) * width], a zero row)``;
        ``out_rows`` [T]: where each row's output is in a valid convolution over that
        layout; ``final_index`` [S, width]: the last ``width`` inputs up to each
        segment's end (its final window), oldest first."""
        return self.cached(("conv", width), lambda: _conv_tables(self, width))


def _conv_tables(layout: StateLayout, width: int):
    t, s = layout.num_rows, layout.num_segments
    windows = np.flatnonzero(layout.read_slot >= 0)
    zero = t + len(windows) * width
    prev = np.empty(zero + 1, dtype=np.int64)  # the input before each src row along its path
    prev[:t] = np.arange(t) - 1
    prev[zero] = zero
    window_of = np.full(s, -1, dtype=np.int64)
    window_of[windows] = np.arange(len(windows))
    for b in range(len(windows)):
        base = t + b * width
        prev[base] = zero
        prev[base + 1 : base + width] = np.arange(base, base + width - 1)
    first = layout.q_offsets[:-1]
    last = layout.q_offsets[1:] - 1
    parent = layout.call_parent
    prev[first] = np.where(
        parent >= 0, last[np.maximum(parent, 0)], np.where(window_of >= 0, t + window_of * width + width - 1, zero)
    )
    # back[k] = prev applied k times, for every src row
    back = [np.arange(zero + 1)]
    for _ in range(width):
        back.append(prev[back[-1]])
    before = np.stack([back[k][first] for k in range(width, 0, -1)], axis=1)  # [S, width], oldest first
    lengths = layout.q_offsets[1:] - first
    z_index = np.concatenate(
        [np.concatenate([before[i], np.arange(first[i], first[i] + lengths[i])]) for i in range(s)]
    ).astype(np.int64)
    seg_start = np.cumsum(np.concatenate([[0], lengths[:-1] + width])) + width  # own rows in the layout
    out_rows = (np.repeat(seg_start - first, lengths) + np.arange(t)) - width
    final_index = np.stack([back[k][last] for k in range(width - 1, -1, -1)], axis=1)
    return windows, z_index, out_rows.astype(np.int64), final_index.astype(np.int64)


class _StateRead(torch.autograd.Function):
    """Initial states read from the stack; backward adds their gradient into the slots.

    ``anchor`` is a fresh leaf that requires grad, so that autograd runs this backward
    even where nothing else of the call requires grad (the parent's state may still)."""

    @staticmethod
    def forward(ctx, anchor, stack: StateSlots, layer: int, name: str, slots, index):
        ctx.stack, ctx.layer, ctx.name, ctx.slots, ctx.index = stack, layer, name, slots, index
        return stack.read(layer, name, slots, index)

    @staticmethod
    def backward(ctx, grad):
        ctx.stack.accumulate(ctx.layer, ctx.name, ctx.slots, grad, ctx.index)
        return None, None, None, None, None, None


class _StateSeed(torch.autograd.Function):
    """Identity on an op's output whose backward adds the stack's gradient slots of the
    final states the call stored to those states' gradients (see the module docstring)."""

    @staticmethod
    def forward(ctx, out, finals, stack: StateSlots, layer: int, name: str, slots, index):
        ctx.stack, ctx.layer, ctx.name, ctx.slots, ctx.index = stack, layer, name, slots, index
        ctx.dtype = finals.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        seed = ctx.stack.grad_of(ctx.layer, ctx.name, ctx.slots, ctx.index).to(ctx.dtype)
        return grad_out, seed, None, None, None, None, None


class LayerStates:
    """What one recurrent layer's op gets for one call (see the module docstring).

    Args:
        layout: the call's :class:`StateLayout`.
        stack: the state stack (None where no segment reads or stores one).
        layer: the decoder layer.
        push: store final states (False when a recomputed call runs again in backward).
        backend: the ``linear_recurrence`` backend (:mod:`dtree.ops.backends`).
        grad_reads: states read from the stack take a gradient (in a training walk):
            True when a trainable parameter feeds the layer's states (the runtime decides
            per layer from the model, :meth:`dtree.models.hf.HFTreeModel.dtree_state_grads`;
            a parent recomputed in backward stores its states without grad, so their own
            ``requires_grad`` cannot tell).
    """

    def __init__(
        self,
        layout: StateLayout,
        stack: StateSlots | None,
        layer: int,
        push: bool = True,
        backend: str = "reference",
        grad_reads: bool = True,
    ) -> None:
        self.layout, self.stack, self.layer, self.push_states, self.backend = layout, stack, layer, push, backend
        self.grad_reads = grad_reads
        self._seeds: list[tuple[torch.Tensor, str, np.ndarray, torch.Tensor]] = []

    def _slots_index(self, kind: str, slots: np.ndarray, device) -> torch.Tensor:
        return self.layout.device_index((kind, slots.tobytes()), lambda: slots, device)

    def read(self, name: str, segments: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
        """[n, *shape] initial states of ``segments`` (each with a ``read_slot``) from the stack."""
        slots = self.layout.read_slot[segments]
        if self.stack is None or (slots < 0).any():
            raise RuntimeError(f"segments {segments.tolist()} have no state-stack slot to read (layer {self.layer})")
        index = self._slots_index("read", slots, device)
        stack = self.stack
        if stack.has_grad and torch.is_grad_enabled() and self.grad_reads:
            anchor = torch.empty(0, device=device, requires_grad=True)
            values = _StateRead.apply(anchor, stack, self.layer, name, slots, index)
        else:
            values = stack.read(self.layer, name, slots, index)
        return values.to(dtype)

    def push(self, name: str, segments: np.ndarray, finals: torch.Tensor) -> None:
        """``finals`` [n, *shape]: the final states of ``segments`` (each with a ``push_slot``).
        Stored when the call stores states; seeded by the next :meth:`tie` when they need grad."""
        if not len(segments):
            return
        slots = self.layout.push_slot[segments]
        index = self._slots_index("push", slots, finals.device)
        if self.push_states:
            self.stack.store(self.layer, name, slots, finals, index)
        if self.stack.has_grad and torch.is_grad_enabled() and finals.requires_grad:
            self._seeds.append((finals, name, slots, index))

    def tie(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged, carrying the seeds of the final states pushed since the last tie."""
        for finals, name, slots, index in self._seeds:
            out = _StateSeed.apply(out, finals, self.stack, self.layer, name, slots, index)
        self._seeds = []
        return out
