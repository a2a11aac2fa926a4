"""GroupAttention: the ``attend`` callable a group's model call gets (:mod:`dtree.engine.walk`), and
the one the memory probe measures with (:mod:`dtree.plan.memory_probe`).

Every attending layer pushes the call's K/V onto the KV stack, passes them through
:func:`~dtree.ops.stack_attention.seed_from_stack` where their slots collect gradients,
and attends through the stack; every recurrent layer gets its states from the state
stack (:mod:`dtree.ops.segment_states`).
"""

from __future__ import annotations

import torch

from ..ops.segment_states import LayerStates, StateLayout
from ..ops.stack_attention import AttentionOptions, SegmentLayout, StackSlots, seed_from_stack, stack_attention
from .step_stacks import StepStacks

__all__ = ["GradPattern", "GroupAttention"]


class GradPattern:
    """Which layers' K/V need grad, the same in every model call of a step.

    A call's K/V at layer l need grad when a trainable parameter feeds them. For a dense
    model that holds for all calls alike. If it held for an ancestor but not for a
    descendant (trainable parts that only some tokens reach, e.g. some MoE experts), the
    descendant's attention would have no backward and send the ancestor no gradient:
    refuse rather than be silently wrong. Checked as each layer attends with grad on: in
    its forward, or, for a checkpointed layer (whose forward runs with grad off), in its
    re-run in backward."""

    def __init__(self, num_layers: int) -> None:
        self.seen: list[tuple[bool, bool] | None] = [None] * num_layers

    def check(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pattern, seen = (k.requires_grad, v.requires_grad), self.seen[layer]
        if seen is None:
            self.seen[layer] = pattern
        elif seen != pattern:
            raise ValueError(
                "the layers whose K/V need gradients differ between model calls of one step: trainable parameters "
                "that only some tokens reach (e.g. some MoE experts) cannot be trained through dtree's KV stack; "
                "make the trainable path the same for every token (e.g. train all experts or none)"
            )


class GroupAttention:
    """The ``attend`` callable handed to the model for one group's call.

    ``push``: write the call's K/V into its stack slots ``[lo, hi)`` (every time a
    layer runs, also when a checkpointed layer re-runs in backward: the same values),
    and the final recurrent states of its segments with children in later calls into
    their state slots. ``grad_seed``: pass the call's K/V through :func:`seed_from_stack`
    (groups whose slots collect gradients: groups with children, and calls with
    in-call ancestors). ``device_lo``: ``lo`` on the device, for the stack's CUDA ops.
    ``deterministic``: the attention's backward sums in a fixed order
    (:mod:`dtree.ops.determinism`). Recurrent layers get their :class:`LayerStates` from
    :meth:`states` (``state_layout``: the call's segments' state slots). ``grad_pattern``:
    the step's :class:`GradPattern`, checked at every layer that attends with grad on.
    ``window``: a leaf call of a step whose every layer is checkpointed: each layer binds its
    stack's window (:meth:`StepStacks.window_of`) and the call pushes and attends there."""

    def __init__(
        self,
        stacks: StepStacks,
        lo: int,
        hi: int,
        layout: SegmentLayout,
        backend: str,
        push: bool,
        grad_seed: bool,
        device_lo: torch.Tensor | None = None,
        deterministic: bool = False,
        state_layout: StateLayout | None = None,
        recurrence: str | None = None,
        state_grads: tuple[bool, ...] | None = None,
        grad_pattern: GradPattern | None = None,
        window: bool = False,
    ):
        self.stacks, self.lo, self.hi, self.layout, self.backend = stacks, lo, hi, layout, backend
        self.push, self.grad_seed, self.device_lo, self.deterministic = push, grad_seed, device_lo, deterministic
        self.state_layout, self.recurrence, self.state_grads = state_layout, recurrence, state_grads
        self.grad_pattern, self.window = grad_pattern, window
        num_layers = stacks.spec.num_layers
        self.called = [False] * num_layers
        self.plain = True  # every layer so far attended with no score options
        self.recurred = [False] * num_layers

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **options
    ) -> torch.Tensor:
        """``options``: the per-layer ``softcap``, ``sinks``, ``alibi_slopes``, ``window``
        of :func:`dtree.ops.stack_attention.stack_attention`."""
        self.called[layer] = True
        stack, local = self.stacks.window_of(layer, self.lo) if self.window else self.stacks.kv_of(layer)
        if self.push:
            stack.push(local, self.lo, k.detach(), v.detach(), device_lo=self.device_lo)
        if torch.is_grad_enabled():
            if self.grad_pattern is not None:
                self.grad_pattern.check(layer, k, v)
            if self.grad_seed:
                k, v = seed_from_stack(k, v, stack, local, self.lo, self.hi, device_lo=self.device_lo)
        options = AttentionOptions(scale=scale, deterministic=self.deterministic, **options)
        self.plain = self.plain and options.plain
        slots = StackSlots(stack, local, self.layout, own_in_stack=self.push)
        return stack_attention(q, k, v, slots, options, self.backend)

    def states(self, layer: int) -> LayerStates:
        """The recurrent states of ``layer`` for this call (:mod:`dtree.ops.segment_states`)."""
        if self.state_layout is None:
            raise ValueError(f"layer {layer} is recurrent but the model's spec declares no recurrent states")
        self.recurred[layer] = True
        grad_reads = True if self.state_grads is None else self.state_grads[layer]
        return LayerStates(
            self.state_layout, self.stacks.states, layer, push=self.push, backend=self.recurrence, grad_reads=grad_reads
        )

    def check_layers(self) -> None:
        """Raise unless every attending layer called attend() and every recurrent layer
        asked for its states (custom modules; the HF adapter's guard checks its own)."""
        spec = self.stacks.spec
        missing = [i for i in spec.attention_layers if not self.called[i]]
        missing += [i for i in spec.recurrent_layers if not self.recurred[i]]
        if missing:
            raise RuntimeError(
                f"layers {sorted(missing)} never called attend() (attention) or attend.states() (recurrent); "
                "every layer of the spec must"
            )
