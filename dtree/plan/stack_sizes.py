"""How large a step's stacks are: the forest's shape for the memory policy, the KV-stack slots
(and their gradient slots) a schedule takes with a backend, and whether its leaf calls run in
a one-layer KV window (:mod:`dtree.ops.stack_ops.kv_window`) instead of the stack.

:func:`planning_shape` gives the policy every call budget's slots before a schedule exists
(from the packing alone); :func:`stack_sizes` gives the runtime the slots of the schedule it
runs. Both count the same slots (``tests/test_schedule.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..config import RuntimeConfig
from ..forest.forest import Forest
from ..models import ModelSpec
from ..ops.stack_attention.interface import OWN_KV_IN_STACK, leaf_slots_take_grads
from . import memory_policy
from .schedule import Packing, Schedule, SlotExtents, pack_budgets

__all__ = ["StackSizes", "budget_packings", "check_stack_capacity", "grad_slots", "leaf_calls_can_window",
           "planning_shape", "stack_needs", "stack_sizes", "stack_slots", "step_shape"]


@dataclass(frozen=True)
class StackSizes:
    """A step's KV stacks: ``kv`` slots each, ``grads`` of them with gradient slots, and a
    window of ``window`` slots (0: leaf calls in the stack)."""

    kv: int
    grads: int
    window: int = 0


def stack_slots(sched: Schedule, own_in_stack: bool) -> int:
    """The KV-stack capacity of ``sched`` with a backend that does (``own_in_stack``,
    :data:`OWN_KV_IN_STACK`) or does not read every call's own K/V from its slots
    (:meth:`~dtree.plan.schedule.SlotExtents.kv_slots`)."""
    return sched.extents.kv_slots(own_in_stack)


def grad_slots(sched: Schedule, leaf_grads: bool) -> int:
    """The KV-stack gradient slots of ``sched``; ``leaf_grads``:
    :func:`~dtree.ops.stack_attention.interface.leaf_slots_take_grads`
    (:meth:`~dtree.plan.schedule.SlotExtents.grad_slots`)."""
    return sched.extents.grad_slots(leaf_grads)


def leaf_calls_can_window(attention: str, deterministic: bool) -> bool:
    """Whether the ``attention`` backend may run leaf calls in a KV window when every layer is
    checkpointed: it reads a call's own K/V from its slots and returns their gradients whole
    (it adds nothing into a leaf call's slots, which a window's have no gradient buffers for).
    The model's layers must also attend with no score options (a softcap, sinks, ALiBi or a
    window send the flash-attn backend's calls to kernels that add there:
    :func:`~dtree.plan.memory_probe.attention_is_plain`)."""
    return attention in OWN_KV_IN_STACK and not leaf_slots_take_grads(attention, deterministic)


def stack_sizes(sched: Schedule, attention: str, deterministic: bool, windowed: bool = False) -> StackSizes:
    """The stacks a step over ``sched`` takes with the ``attention`` backend; ``windowed``
    (:func:`leaf_calls_can_window` and every layer checkpointed): the stack holds the groups
    with children, whose slots lie below every leaf call's, and the window every call's reach."""
    if windowed:
        with_children = sched.extents.with_children
        return StackSizes(with_children, with_children, stack_slots(sched, True))
    return StackSizes(stack_slots(sched, attention in OWN_KV_IN_STACK),
                      grad_slots(sched, leaf_slots_take_grads(attention, deterministic)))


def step_shape(forest: Forest, chunk_size: int, recurrent: bool = False) -> memory_policy.StepShape:
    """The forest's unique tokens, longest path, shared tokens (of trie nodes with
    children) and attention keys for the memory policy; for a model with recurrent layers (``recurrent``),
    its segments of at most ``chunk_size`` tokens that have children (the most state
    slots a schedule can push)."""
    lengths = forest.sequence_lengths()
    inner = np.diff(forest.child_offsets) > 0
    chunks = np.maximum(1, -(-forest.node_length // chunk_size))
    state_slots = int((chunks - 1).sum() + inner.sum()) if recurrent else 0
    return memory_policy.StepShape(
        forest.num_unique_tokens, int(lengths.max()) if len(lengths) else 0, int(forest.node_length[inner].sum()),
        state_slots, float((forest.positions + 1).sum()),
    )


def stack_needs(
    forest: Forest, chunk_size: int, budgets: tuple[int, ...], own_in_stack: bool, leaf_grads: bool
) -> tuple[tuple[int, int, int], ...]:
    """``(call budget, KV slots, KV gradient slots)`` for each of ``budgets``: what
    :func:`stack_slots` and :func:`grad_slots` give for the schedule that budget builds,
    from its packing alone (:func:`~dtree.plan.schedule.slot_extents`). With a backend whose leaf
    calls can run in a window, the gradient slots are the groups with children's reach, the
    stack's KV slots in a windowed step (:func:`stack_sizes`)."""
    packings = pack_budgets(forest, chunk_size, budgets)
    return needs_of(tuple(packings[b].extents for b in budgets), own_in_stack, leaf_grads)


def needs_of(extents: tuple[SlotExtents, ...], own_in_stack: bool, leaf_grads: bool) -> tuple[tuple[int, int, int], ...]:
    """:func:`stack_needs` from the budgets' extents."""
    return tuple((e.group_tokens, e.kv_slots(own_in_stack), e.grad_slots(leaf_grads)) for e in extents)


def budget_packings(forest: Forest, config: RuntimeConfig, device: torch.device) -> dict[int, Packing]:
    """The packing of every call budget the memory policy scores for a step over ``forest``
    (:func:`~dtree.plan.memory_policy.call_budgets`), on CUDA; none off it (the CPU plan is fixed)."""
    if device.type != "cuda":
        return {}
    budgets = memory_policy.call_budgets(config.group_tokens, forest.num_unique_tokens)
    return pack_budgets(forest, config.chunk_size, budgets)


def planning_shape(
    forest: Forest, config: RuntimeConfig, spec: ModelSpec, device: torch.device, attention: str | None,
    packings: dict[int, Packing] | None = None,
) -> memory_policy.StepShape:
    """:func:`step_shape` and, on CUDA, the KV-stack slots each call budget the policy scores would
    take with this backend (``stack_needs``): with large calls the bound the policy has without them
    (the longest path plus a call, gradients in every slot) over-counts by GiBs. On the 64k agentic
    tree the 12k-token calls of ``memory="low"`` hold 18.9k K/V slots but 6.7k gradient slots, and
    a cap of 8 GiB ruled that plan out on the bound (0.8 GiB over) and ran 4k-token calls 1.9x slower
    (``benchmarks/results/h200/session_x``). ``packings``: :func:`budget_packings` (packed here when None)."""
    shape = step_shape(forest, config.chunk_size, bool(spec.recurrent_states))
    if device.type != "cuda":  # the CPU plan is fixed (no memory model)
        return shape
    packings = budget_packings(forest, config, device) if packings is None else packings
    extents = tuple(p.extents for p in packings.values())
    needs = needs_of(extents, attention in OWN_KV_IN_STACK, leaf_slots_take_grads(attention, config.deterministic))
    return dataclasses.replace(shape, stack_needs=needs, packings=extents)


def check_stack_capacity(sched: Schedule, forest: Forest, capacity: int | None) -> None:
    """A ValueError, naming the fix, when ``sched`` writes more KV-stack slots than the
    runtime's ``stack_capacity`` (None: no limit)."""
    if capacity is None or sched.stack_tokens <= capacity:
        return
    lengths = forest.sequence_lengths()
    s = int(np.argmax(lengths))
    too_long = f"the longest path (sequence {s}, {int(lengths[s])} tokens) alone exceeds it"
    hint = too_long if lengths[s] > capacity else "lower group_tokens or raise stack_capacity"
    raise ValueError(f"this forest needs {sched.stack_tokens} KV-stack slots but stack_capacity is {capacity}: {hint}")
