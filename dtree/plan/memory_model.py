"""The figures of one training step and the plan made of them: what each part of dtree
holds at the peak, what a model call costs, and :class:`MemoryPlan`, the memory
policy's decisions.

The memory policy (:mod:`dtree.plan.memory_policy`) picks a plan from these figures;
after the schedule is built, :func:`refine` walks its events with the same figures
(:func:`simulate_peak`) and gives the plan the step's predicted peak (what
``memory=<GiB>`` is held to, and what the step reports next to the measured peak).

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

Figures from the H100 session of 2026-11-23 (qwen2.5-1.5b, bf16;
``benchmarks/results/h100/session_b/memory_profile_*``): eager decoder layers keep 2.73 MB per token (54.05 GiB for a
21,266-token call), checkpointed ones their inputs, 86 KB per token; the KV stack 86 KB per slot (bf16 values, float32
gradients); the fused LM head at 4,096-row chunks 2.05 GiB (the ``[c, V]`` logits buffer 1.16, the float32
weight-gradient accumulator 0.87) plus 0.43 GiB for its weight gradient in the model dtype, returned before it is
added into ``.grad`` (the policy before this one left that out). Since session M the fused head's backward runs
vocabulary slices over all rows and writes the weight's gradient once: no ``[V, H]`` accumulator, a float32
``[rows, H]`` one instead (0.09 GiB at 16k rows).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ..models.protocol import ModelSpec
from ..ops.stack_attention.output_memo import kept_bytes_per_token
from .memory_probe import CallBytes, layer_activation_bytes, layer_input_bytes
from .schedule import FORWARD, Schedule, SlotExtents

SMALL_CALL_TOKENS = 4096  # the call size planned for group_tokens=0 (one segment per call)

__all__ = [
    "RECOMPUTE", "RERUN_MATMUL_SHARE", "MemoryPlan", "PeakVisit", "StepShape", "attention_rerun_rate",
    "backward_peak", "call_count", "call_head_chunk", "call_overhead_tokens", "cost_rates", "grads_at_peak",
    "head_bytes", "layer_activation_bytes", "layer_input_bytes", "peak_visits", "plan_walk", "refine",
    "simulate_peak", "stack_grad_slot_bytes", "stack_slot_bytes", "state_slot_bytes", "window_slot_bytes",
    "with_simulated_peak"
]

RECOMPUTE = -1  # path_checkpoint_layers of a plan that recomputes the groups with children
# Cost model constants (see dtree.plan.memory_policy's docstring), for qwen2.5-1.5b in eager
# mode; all scale with layers per unit of per-token compute.
# A call's host work hides behind its GPU work from ~5k tokens on; checkpointed layers push that
# point out (they run forward twice, the re-run with autograd).
# Fitted on H200 hosts (session R, benchmarks/PERF_NOTES.md), 64k agentic tree: nothing
# checkpointed, calls of 2k/4k/8k tokens cost 4.62/1.20/0.30 s over 32k ones (session P); every
# layer checkpointed without kept outputs, 8k/12k/16k-token calls took 2.823/2.177/2.071 s. The
# H100 host of the first fit (2,600 tokens, nothing checkpointed) was faster per launch.
CALL_CPU_TOKENS = 5000.0
RERUN_CPU_SHARE = 0.47  # every layer checkpointed: the CPU point this much further out
# A checkpointed layer's re-run against its layers' share of a token's compute (cost_rates' first
# figure): the re-run skips the down projection (its output is unused); fitted on session Q's
# one-process run (H200): memory=14.5 (16k calls, every layer checkpointed, attention outputs
# kept) took 1.905 s against the default's 1.624 s.
RERUN_MATMUL_SHARE = 0.5
CALL_FIXED_TOKENS = 1500.0  # H100, qwen2.5-1.5b, 64k agentic tree: 20 calls of 4,096 tokens took 4.22 s a step, ~6
# calls of up to 14.9k tokens 2.65 s (kernel sessions 3, 4); session B measured ~43 ms (1,300) a call
_CALL_REFERENCE = (28, 3.09e9)  # (layers, forward FLOPs per token) where they were measured


@dataclass(frozen=True)
class StepShape:
    """What the policy needs to know of a forest: unique tokens, the longest path, the
    tokens of trie nodes with children (shared prefixes: about what the groups with
    children hold), and the segments with children (each may store its recurrent
    states in a state-stack slot: a bound on the state stack's slots; 0 for a model
    without recurrent layers), and the (query, key) pairs of the forest's attention
    (what re-running a checkpointed layer's attention costs); ``stack_needs``: per call budget
    the KV-stack slots its schedule takes, ``(group_tokens, KV slots, gradient slots)``
    (:func:`dtree.plan.stack_sizes.stack_needs`; without an entry, a plan is scored on the bound:
    the longest path plus a call, gradients in every slot); ``packings``: per call budget what its
    schedule packs (:class:`~dtree.plan.schedule.SlotExtents`: its calls, the largest, the groups with
    children; without an entry, a plan is scored on calls as large as the budget and the trie's
    nodes with children as the path)."""

    unique_tokens: int
    longest_path: int
    shared_tokens: int = 0
    state_slots: int = 0
    attention_keys: float = 0.0  # keys the unique tokens attend to, summed (a token at depth p sees p + 1)
    stack_needs: tuple[tuple[int, int, int], ...] = ()
    packings: tuple[SlotExtents, ...] = ()

    def stack_need(self, group_tokens: int) -> tuple[int, int] | None:
        """(KV slots, gradient slots) of the schedule of ``group_tokens``-token calls; None: not known."""
        return next(((kv, grads) for budget, kv, grads in self.stack_needs if budget == group_tokens), None)

    def packing(self, group_tokens: int) -> SlotExtents | None:
        """What the schedule of ``group_tokens``-token calls packs; None: not known."""
        return next((p for p in self.packings if p.group_tokens == group_tokens), None)


def stack_slot_bytes(spec: ModelSpec, itemsize: int) -> float:
    """One KV-stack slot: K/V values in the model dtype and their gradients in the
    compute dtype (float32; float64 for a float64 model), over the attending layers,
    each with its own K/V shape."""
    return spec.kv_elements_per_token() * itemsize + stack_grad_slot_bytes(spec, itemsize)


def stack_grad_slot_bytes(spec: ModelSpec, itemsize: int) -> float:
    """The gradient part of :func:`stack_slot_bytes` (a stack holds fewer gradient slots
    than K/V slots when leaf calls' slots take no gradients: :attr:`KVStack.grad_slots`)."""
    return spec.kv_elements_per_token() * (8 if itemsize == 8 else 4)


def window_slot_bytes(spec: ModelSpec, itemsize: int) -> float:
    """One slot of the KV windows (:mod:`dtree.ops.stack_ops.kv_window`): one layer's K/V of each
    distinct attention shape, in the model dtype."""
    shapes = {spec.kv_shape(i) for i in spec.attention_layers}
    return float(sum(heads * (dim + v_dim) for heads, dim, v_dim in shapes) * itemsize)


def state_slot_bytes(spec: ModelSpec, itemsize: int) -> float:
    """One state-stack slot: every recurrent layer's states and their gradients, in the
    state dtype (float32; float64 for a float64 model: :class:`dtree.stacks.state_stack.StateStack`)."""
    return spec.state_elements() * (8 if itemsize == 8 else 4) * 2


def head_bytes(spec: ModelSpec, itemsize: int, chunk: int, rows: int, fused: bool) -> float:
    """Peak bytes of the LM head's backward over ``rows`` predictions at ``chunk`` rows
    per chunk: ``chunk x V`` logits (fused: one buffer in the model dtype, which the
    backward fills with vocabulary slices over all rows; torch: row chunks with float32
    temporaries too, 6 more bytes per logit, measured), the weight gradient in the model
    dtype it returns, the rows' hidden states and their gradient, and what sums over
    the pieces when there are several: fused, the hidden states' gradient in float32
    (``[rows, H]``); torch, the weight's (``[V, H]``)."""
    if rows <= 0:
        return 0.0
    c = max(1, min(chunk, rows))
    per_element = itemsize if fused else itemsize + 6
    weight = spec.vocab_size * spec.hidden_size
    acc_itemsize = 8 if itemsize == 8 else 4
    accumulator = 0
    if rows > chunk:
        accumulator = rows * spec.hidden_size * acc_itemsize if fused else weight * 4
    return c * spec.vocab_size * per_element + accumulator + weight * itemsize + 2 * rows * spec.hidden_size * itemsize


@dataclass(frozen=True)
class MemoryPlan:
    """One step's decisions and the figures behind them (bytes are what the step adds
    on top of ``start_bytes``, what was allocated when it started).

    ``path_checkpoint_layers``: layers checkpointed in the retained groups with
    children, or :data:`RECOMPUTE`; ``retain_bytes``: what their graphs may hold at
    once, at ``retained_bytes_per_token`` (:meth:`retain_budget` turns it into
    tokens); ``inf`` on CPU. ``keep_attention_outputs``: the checkpointed layers keep
    their attention outputs (``call_bytes`` then counts them). ``offload_checkpoints``: their
    inputs wait in pinned host memory (``call_bytes`` then counts two per call)."""

    group_tokens: int
    checkpoint_layers: int
    logprob_chunk: int
    retain_bytes: float
    retained_bytes_per_token: float
    predicted_peak_bytes: float
    predicted_cost: float  # tokens' worth of compute
    budget_bytes: float
    setting: str
    path_checkpoint_layers: int = 0
    keep_attention_outputs: bool = False  # checkpointed layers keep their attention outputs
    start_bytes: float = 0.0
    parts: dict = field(default_factory=dict, compare=False)  # predicted peak by part (bytes)
    reason: str = ""
    call_bytes: CallBytes | None = field(default=None, compare=False)
    fused_head: bool = False
    spec: ModelSpec | None = field(default=None, compare=False)
    itemsize: int = 2
    step_grad_bytes: float = 0.0  # the gradients the step allocates (alive from its first backward on)
    grad_guard: bool | str = True  # where the step keeps param.grad's old values (dtree.engine.grad_guard)
    offload_checkpoints: bool = False  # checkpointed layers' inputs wait on the host (dtree.models.host_checkpoints)
    kept_head_rows: int = 0  # calls of at most these loss rows keep their head's logits (dtree.plan.head_keep)

    def retain_tokens(self) -> float:
        """Tokens whose graphs fit in ``retain_bytes``."""
        if self.retained_bytes_per_token <= 0:
            return math.inf
        return self.retain_bytes / self.retained_bytes_per_token

    def retain_budget(self, mode: str, tokens: int | None = None) -> float:
        """Tokens of groups with children whose graphs are kept alive at once (the walk retains
        the outermost first, recomputes the rest): ``tokens`` (the config's
        ``retain_budget_tokens``) when given, else all in ``retain`` mode and on CPU, none in
        ``recompute`` mode or when the plan recomputes the path, else what fits in
        ``retain_bytes``."""
        if tokens is not None:
            return float(tokens)
        if mode == "retain" or (mode == "auto" and math.isinf(self.retain_bytes)):
            return math.inf
        if mode == "recompute" or self.path_checkpoint_layers == RECOMPUTE:
            return 0.0
        return self.retain_tokens()

    def describe(self) -> dict:
        """The plan as plain numbers (``StepOutput.metrics["memory_plan"]``)."""
        gib = 2.0**30

        def g(x):
            return None if math.isinf(x) or math.isnan(x) else x / gib

        return {
            "setting": self.setting,
            "group_tokens": self.group_tokens,
            "checkpoint_layers": self.checkpoint_layers,
            "path_checkpoint_layers": (
                "recompute" if self.path_checkpoint_layers == RECOMPUTE else self.path_checkpoint_layers
            ),
            "logprob_chunk": self.logprob_chunk,
            "kept_head_rows": self.kept_head_rows,
            "keep_attention_outputs": self.keep_attention_outputs,
            "grad_guard": {True: "device", False: "in place"}.get(self.grad_guard, self.grad_guard),
            "offload_checkpoints": self.offload_checkpoints,
            "predicted_peak_gib": g(self.predicted_peak_bytes),
            "predicted_total_gib": g(self.start_bytes + self.predicted_peak_bytes),
            "start_gib": g(self.start_bytes),
            "budget_gib": g(self.budget_bytes),
            "retain_gib": g(self.retain_bytes),
            "parts_gib": {k: v / gib for k, v in self.parts.items()},
            "bytes_per_token": self.call_bytes.describe() if self.call_bytes is not None else None,
            "reason": self.reason,
        }


@functools.lru_cache(maxsize=64)
def cost_rates(spec: ModelSpec) -> tuple[float, float, float]:
    """(a token's layer forward, all layers, as a fraction of its fwd+bwd compute; the LM
    head's share of the forward; the call-cost scale: layers per unit of per-token
    compute against the reference model's)."""
    head = 2 * spec.hidden_size * spec.vocab_size
    total = spec.forward_flops_per_token()
    layers, flops = _CALL_REFERENCE
    return (total - head) / (3 * total), head / total, (spec.num_layers / layers) * (flops / total)


def call_overhead_tokens(spec: ModelSpec, tokens: float, checkpointed: float = 0.0) -> float:
    """One model call's cost beyond its tokens, in tokens' worth of compute: the fixed
    part, and the CPU time its GPU work does not hide (both proportional to the layers,
    against the per-token compute). ``checkpointed``: the fraction of its decoder layers
    the call checkpoints (their re-runs add host work, :data:`RERUN_CPU_SHARE`)."""
    return call_overhead_at(cost_rates(spec)[2], tokens, checkpointed)


def call_overhead_at(scale: float, tokens: float, checkpointed: float = 0.0) -> float:
    """:func:`call_overhead_tokens` for the call-cost ``scale`` of :func:`cost_rates`."""
    cpu = scale * CALL_CPU_TOKENS * (1.0 + RERUN_CPU_SHARE * checkpointed)
    return scale * CALL_FIXED_TOKENS + max(0.0, cpu - tokens)


@dataclass(frozen=True)
class _Figures:
    """Everything :func:`backward_peak` needs besides the plan's knobs; ``call_bytes_keeping``:
    the call figures when checkpointed layers keep their attention outputs."""

    spec: ModelSpec
    itemsize: int
    call_bytes: CallBytes
    fused_head: bool
    chunk: int
    call_bytes_keeping: CallBytes | None = None


def _figures(spec: ModelSpec, itemsize: int, call_bytes: CallBytes, fused_head: bool, chunk: int,
             offload: bool = False) -> _Figures:
    """The figures of ``call_bytes`` (kept on the device), with and without kept attention
    outputs; with ``offload`` both wait on the host (:meth:`CallBytes.offloading`: the kept
    outputs go with their layer's input)."""
    layers = list(spec.attention_layers)
    kept = sum(kept_bytes_per_token(spec.num_heads, spec.kv_shape(i)[2], itemsize) for i in layers)
    keeping = call_bytes.keeping_attention(kept / max(1, len(layers)), len(layers))
    if offload:
        call_bytes, keeping = call_bytes.offloading(), keeping.offloading()
    return _Figures(spec, itemsize, call_bytes, fused_head, chunk, keeping)


def attention_rerun_rate(spec: ModelSpec, shape: StepShape) -> float:
    """Re-running every attention layer's forward over ``shape``'s forest, per unique
    token, in tokens' worth of fwd+bwd compute (:func:`cost_rates`' unit; the matmul
    figure leaves attention out)."""
    if shape.unique_tokens <= 0:
        return 0.0
    keys_per_token = shape.attention_keys / shape.unique_tokens
    return keys_per_token * spec.forward_attention_flops_per_key() / (3 * spec.forward_flops_per_token())


def grads_at_peak(step_grads, calls, freed, head_excess):
    """The step's gradients counted at its peak (floats or [n] arrays). A call's backward peaks as
    it starts (its LM-head chunk or its top layer's backward), or at its bottom layer, where it has
    allocated every gradient of the step and freed what its upper layers kept (``freed`` bytes;
    ``head_excess``: how far the head's chunk tops the layers' backward). So after the first call
    every later one counts them all, and a one-call step counts what its frees do not offset: none
    without checkpointing (GRPO case 1 measured 13.4 GiB where counting them all predicted 16.4),
    nearly all with its layer inputs on the host (the 64k tree in one call measured 10.9 GiB, with
    2.7 GiB of gradients, where counting none predicted 7.4: session AL)."""
    one_call = np.maximum(0.0, step_grads - freed - head_excess)
    return np.where(np.asarray(calls) > 1, step_grads, one_call)


def call_head_chunk(chunk: int, rows: int, kept_head_rows: int, backward_now: bool) -> int:
    """The LM-head chunk of a call of ``rows`` loss rows under ``chunk``-row chunks: all its rows in one (its logits
    kept for the backward) where its backward follows its forward at once and they are at most ``kept_head_rows``
    (:mod:`dtree.plan.head_keep`), else ``chunk``. The walk runs it; :func:`simulate_peak` prices it."""
    return rows if backward_now and chunk < rows <= kept_head_rows else chunk


def backward_peak(fig: _Figures, retained: float, tokens: int, rows: int, checkpoint: int,
                  alive: float = 0.0, grads: float = 0.0, chunk: int | None = None) -> tuple[float, float]:
    """(live bytes at the peak of a call's backward, the gradients among them): a call of ``tokens``
    (``rows`` predictions) with ``checkpoint`` layers checkpointed, on top of ``retained`` bytes of
    path graphs; ``alive``: the step's gradients alive as it starts (``grads``, the step's
    gradients, once an earlier backward allocated them). See :func:`grads_at_peak`. ``chunk``:
    its LM head's rows per chunk (None: ``fig.chunk``; :func:`call_head_chunk`)."""
    cb = fig.call_bytes
    head = head_bytes(fig.spec, fig.itemsize, fig.chunk if chunk is None else chunk, rows, fig.fused_head)
    layer = tokens * cb.backward(checkpoint)
    counted = alive if alive >= grads else float(grads_at_peak(
        grads, 1, tokens * cb.freed_at_last_layer(checkpoint), max(0.0, head - layer)))
    return retained + tokens * cb.call(checkpoint) + max(head, layer) + counted, counted


class PeakVisit(NamedTuple):
    """One call's backward in :func:`simulate_peak`'s walk: :func:`backward_peak`'s figures but the rows and chunk."""

    group: int
    tokens: int
    checkpoint: int
    backward_now: bool  # a leaf call, or a group recomputed at its backward (not a retained one)
    retained: float  # bytes of the path's retained graphs alive under it
    retained_tokens: int
    alive: float  # the step's gradients alive as it starts

    def peak(self, fig: _Figures, rows: int, grads: float, chunk: int) -> tuple[float, float]:
        """:func:`backward_peak` of this call with ``rows`` loss rows, its LM head in ``chunk``-row chunks."""
        return backward_peak(fig, self.retained, self.tokens, rows, self.checkpoint, self.alive, grads, chunk)


def peak_visits(sched: Schedule, retain_budget: float, checkpoint: int, path_checkpoint: int, fig: _Figures,
                grads: float = 0.0) -> Iterator[PeakVisit]:
    """The calls' backwards of ``sched``'s walk in order, as :class:`dtree.engine.walk.TreeWalk` runs it: groups
    with children retained outermost first while their tokens fit ``retain_budget``, the others recomputed."""
    live_tokens, retained = 0, 0.0
    kept: dict[int, float] = {}
    path_per_token = fig.call_bytes.call(path_checkpoint)
    alive = 0.0  # the step's gradients alive at the next backward
    for kind, g in sched.events:
        group = sched.groups[g]
        n = group.num_tokens
        if kind == FORWARD:
            if group.is_leaf:
                yield PeakVisit(g, n, checkpoint, True, retained, live_tokens, alive)
                alive = grads
            elif live_tokens + n <= retain_budget:
                live_tokens += n
                kept[g] = n * path_per_token
                retained += kept[g]
        elif not group.is_leaf:
            if g in kept:  # its backward: the head and the layers, over its own kept graph
                retained -= kept.pop(g)
                yield PeakVisit(g, n, path_checkpoint, False, retained, live_tokens, alive)
                live_tokens -= n
            else:  # recomputed: run again with grad
                yield PeakVisit(g, n, checkpoint, True, retained, live_tokens, alive)
            alive = grads


def simulate_peak(
    sched: Schedule, rows: list[int], retain_budget: float, checkpoint: int, path_checkpoint: int, fig: _Figures,
    grads: float = 0.0, kept_head_rows: int = 0,
) -> tuple[float, dict]:
    """The most live bytes over ``sched``'s walk (:func:`peak_visits`) and where: ``(bytes, {"group", "tokens",
    "retained_tokens", "gradients"})``. ``rows``: predictions per group; ``grads``: the step's gradients' bytes
    (:func:`backward_peak`), ``"gradients"`` those counted at the peak; ``kept_head_rows``: :func:`call_head_chunk`."""
    best, where = 0.0, {}
    for v in peak_visits(sched, retain_budget, checkpoint, path_checkpoint, fig, grads):
        chunk = call_head_chunk(fig.chunk, rows[v.group], kept_head_rows, v.backward_now)
        peak, counted = v.peak(fig, rows[v.group], grads, chunk)
        if peak > best:
            best = peak
            where = {"group": v.group, "tokens": v.tokens, "retained_tokens": v.retained_tokens, "gradients": counted}
    return best, where


def call_count(unique: int, group_tokens: int) -> float:
    """Model calls a schedule makes for ``unique`` tokens at a budget (groups are not
    full: 1.25x the ideal count, plus the group that holds the trunk); a budget of 0 (one
    segment per call) counts as the policy's small call."""
    group_tokens = group_tokens if group_tokens > 0 else SMALL_CALL_TOKENS
    return 1.0 if unique <= group_tokens else math.ceil(1.25 * unique / group_tokens) + 1.0


def refine(
    plan: MemoryPlan, sched: Schedule, retain_tokens: float, held: tuple[int, int], state_slots: int,
    stack_slots: int | None = None, grad_slots: int | None = None, held_grads: int | None = None,
    window_slots: int = 0, held_window: int = 0,
) -> MemoryPlan:
    """``plan`` with its predicted peak from ``sched`` (:func:`simulate_peak`): the calls it
    makes, the path graphs the walk retains under ``retain_tokens``, and the stacks' growth:
    the KV slots it writes (``stack_slots``, default ``sched.stack_tokens``), their gradient
    slots (``grad_slots``, default as many) and its ``state_slots`` state slots beyond the
    ``held`` (KV, state) slots and ``held_grads`` gradient slots (default ``held[0]``) of the
    stacks kept from earlier steps, and a KV window of ``window_slots`` beyond the ``held_window``
    (:mod:`dtree.ops.stack_ops.kv_window`). A plan without figures (CPU) is returned as is."""
    if plan.call_bytes is None or plan.spec is None or math.isinf(plan.predicted_peak_bytes):
        return plan
    slots = sched.stack_tokens if stack_slots is None else stack_slots
    grads = slots if grad_slots is None else grad_slots
    grad_bytes = stack_grad_slot_bytes(plan.spec, plan.itemsize)
    grow = max(0, slots - held[0]) * (stack_slot_bytes(plan.spec, plan.itemsize) - grad_bytes)
    grow += max(0, grads - (held[0] if held_grads is None else held_grads)) * grad_bytes
    grow += max(0, state_slots - held[1]) * state_slot_bytes(plan.spec, plan.itemsize)
    grow += max(0, window_slots - held_window) * window_slot_bytes(plan.spec, plan.itemsize)
    rows = [int(n) for n in sched.predictions.pred_offsets[1:] - sched.predictions.pred_offsets[:-1]]
    return with_simulated_peak(plan, sched, rows, retain_tokens, float(grow))


def plan_walk(plan: MemoryPlan) -> tuple[_Figures, int]:
    """The figures and path checkpointing :func:`simulate_peak` walks ``plan``'s schedule with."""
    return (_Figures(plan.spec, plan.itemsize, plan.call_bytes, plan.fused_head, plan.logprob_chunk),
            plan.path_checkpoint_layers if plan.path_checkpoint_layers != RECOMPUTE else 0)


def with_simulated_peak(plan: MemoryPlan, sched: Schedule, rows: list[int], retain_tokens: float, grow: float,
                        kept_head_rows: int = 0, note: str = "") -> MemoryPlan:
    """``plan`` (with figures) with ``kept_head_rows`` and its predicted peak: :func:`simulate_peak` over
    ``sched`` (``rows`` loss rows per group, the path's groups retained under ``retain_tokens``) plus
    the stacks' growth ``grow``; ``note`` goes into the reason before where the peak is."""
    fig, path = plan_walk(plan)
    peak, where = simulate_peak(sched, rows, retain_tokens, plan.checkpoint_layers, path, fig, plan.step_grad_bytes,
                                kept_head_rows)
    gradients = where.get("gradients", 0.0)
    parts = {"gradients": gradients, "kv_stack": grow, "activations": peak - gradients}
    return replace(plan, kept_head_rows=kept_head_rows, predicted_peak_bytes=sum(parts.values()), parts=parts,
                   reason=plan.reason + f"; {note}peak at group {where.get('group')} ({where.get('tokens')} tokens)")
