"""The byte figures of one training step: what each part of dtree holds at the peak.

The memory policy (:mod:`dtree.plan.memory_policy`) picks a plan from these; after the
schedule is built, :func:`simulate_peak` walks its events with the same figures and
gives the step's predicted peak (what ``memory=<GiB>`` is held to, and what the step
reports next to the measured peak).

What is alive at a moment of the walk, on top of what the process held when the step
started (weights, optimizer state, the KV stack kept from the last step):

* the gradients the step allocates (trainable parameters whose ``.grad`` is None);
* the stacks' growth: :func:`stack_slot_bytes` per KV slot the schedule writes, and for
  a model with recurrent layers :func:`state_slot_bytes` per state slot;
* the retained groups with children on the current path (their graphs live from
  their forward to their backward): ``tokens x CallBytes.call(path_checkpoint)``;
* the running call: ``tokens x CallBytes.call(checkpoint)``, and on top, at its
  backward, the larger of the LM head's backward (:func:`head_bytes`) and one decoder
  layer's backward (``tokens x CallBytes.backward(checkpoint)``), which never overlap
  (the head's backward finishes before the last layer's starts).

Figures from the H100 session of 2026-11-23 (qwen2.5-1.5b, bf16; ``benchmarks/results/
h100/session_b/memory_profile_*``): eager decoder layers keep 2.73 MB per token (54.05
GiB for a 21,266-token call), checkpointed ones their inputs, 86 KB per token; the KV
stack 86 KB per slot (bf16 values, float32 gradients); the fused LM head at 4,096-row
chunks 2.05 GiB (the ``[c, V]`` logits buffer 1.16, the float32 weight-gradient
accumulator 0.87) plus 0.43 GiB for its weight gradient in the model dtype, returned
before it is added into ``.grad`` (the policy before this one left that out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.protocol import ModelSpec
from .memory_probe import CallBytes, layer_activation_bytes, layer_input_bytes
from .schedule import FORWARD, Schedule

SMALL_CALL_TOKENS = 4096  # the call size planned for group_tokens=0 (one segment per call)

__all__ = [
    "StepShape", "head_bytes", "layer_activation_bytes", "layer_input_bytes", "peak_of", "simulate_peak",
    "stack_slot_bytes", "state_slot_bytes",
]


@dataclass(frozen=True)
class StepShape:
    """What the policy needs to know of a forest: unique tokens, the longest path, the
    tokens of trie nodes with children (shared prefixes: about what the groups with
    children hold), and the segments with children (each may store its recurrent
    states in a state-stack slot: a bound on the state stack's slots; 0 for a model
    without recurrent layers)."""

    unique_tokens: int
    longest_path: int
    shared_tokens: int = 0
    state_slots: int = 0


def stack_slot_bytes(spec: ModelSpec, itemsize: int) -> float:
    """One KV-stack slot: K/V values in the model dtype and their gradients in the
    compute dtype (float32; float64 for a float64 model), over the attending layers,
    each with its own K/V shape."""
    grad_itemsize = 8 if itemsize == 8 else 4
    return spec.kv_elements_per_token() * (itemsize + grad_itemsize)


def state_slot_bytes(spec: ModelSpec, itemsize: int) -> float:
    """One state-stack slot: every recurrent layer's states and their gradients, in the
    state dtype (float32; float64 for a float64 model: :class:`dtree.stacks.state_stack.StateStack`)."""
    return spec.state_elements() * (8 if itemsize == 8 else 4) * 2


def head_bytes(spec: ModelSpec, itemsize: int, chunk: int, rows: int, fused: bool) -> float:
    """Peak bytes of the LM head's backward over ``rows`` predictions in chunks of
    ``chunk`` rows: the chunk's logits (fused: one buffer in the model dtype; torch:
    float32 temporaries too, 6 more bytes per logit, measured), with several chunks the
    float32 ``[V, H]`` weight-gradient accumulator, the weight gradient in the model
    dtype it returns, and the rows' hidden states and their gradient."""
    if rows <= 0:
        return 0.0
    c = max(1, min(chunk, rows))
    per_element = itemsize if fused else itemsize + 6
    weight = spec.vocab_size * spec.hidden_size
    accumulator = weight * 4 if rows > chunk else 0
    return c * spec.vocab_size * per_element + accumulator + weight * itemsize + 2 * rows * spec.hidden_size * itemsize


@dataclass(frozen=True)
class _Figures:
    """Everything :func:`peak_of` needs besides the plan's knobs."""

    spec: ModelSpec
    itemsize: int
    call_bytes: CallBytes
    fused_head: bool
    chunk: int


def peak_of(fig: _Figures, retained: float, tokens: int, rows: int, checkpoint: int) -> float:
    """Live bytes at the backward of a call of ``tokens`` (``rows`` predictions) with
    ``checkpoint`` layers checkpointed, on top of ``retained`` bytes of path graphs."""
    call = tokens * fig.call_bytes.call(checkpoint)
    head = head_bytes(fig.spec, fig.itemsize, fig.chunk, rows, fig.fused_head)
    return retained + call + max(head, tokens * fig.call_bytes.backward(checkpoint))


def simulate_peak(
    sched: Schedule, rows: list[int], retain_budget: float, checkpoint: int, path_checkpoint: int, fig: _Figures,
) -> tuple[float, dict]:
    """The most live activation bytes over ``sched``'s walk (as :class:`dtree.engine.walk.TreeWalk`
    runs it: groups with children retained outermost first while their tokens fit
    ``retain_budget``, the others recomputed at their backward) and where it is:
    ``(bytes, {"group", "tokens", "retained_tokens"})``. ``rows``: predictions per group."""
    live_tokens, retained = 0, 0.0
    kept: dict[int, float] = {}
    best, where = 0.0, {}
    path_per_token = fig.call_bytes.call(path_checkpoint)

    def visit(g: int, tokens: int, k: int) -> None:
        nonlocal best, where
        peak = peak_of(fig, retained, tokens, rows[g], k)
        if peak > best:
            best, where = peak, {"group": g, "tokens": tokens, "retained_tokens": live_tokens}

    for kind, g in sched.events:
        group = sched.groups[g]
        n = group.num_tokens
        if kind == FORWARD:
            if group.is_leaf:
                visit(g, n, checkpoint)
            elif live_tokens + n <= retain_budget:
                live_tokens += n
                kept[g] = n * path_per_token
                retained += kept[g]
        elif not group.is_leaf:
            if g in kept:  # its backward: the head and the layers, over its own kept graph
                retained -= kept[g]
                visit(g, n, path_checkpoint)
                live_tokens -= n
                kept.pop(g)
            else:  # recomputed: run again with grad
                visit(g, n, checkpoint)
    return best, where


def call_count(unique: int, group_tokens: int) -> float:
    """Model calls a schedule makes for ``unique`` tokens at a budget (groups are not
    full: 1.25x the ideal count, plus the group that holds the trunk); a budget of 0 (one
    segment per call) counts as the policy's small call."""
    if group_tokens <= 0:
        group_tokens = SMALL_CALL_TOKENS
    if unique <= group_tokens:
        return 1.0
    return math.ceil(1.25 * unique / group_tokens) + 1.0
