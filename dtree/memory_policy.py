"""Memory policy: how one training step runs a forest on the memory this process has.

Per step, :func:`plan_step` decides

* ``group_tokens``: the token budget of one model call (the schedule packs calls up
  to it);
* ``checkpoint_layers``: whether every decoder layer of a call runs under
  non-reentrant ``torch.utils.checkpoint`` (:mod:`dtree.checkpointing`), keeping only
  the layers' inputs;
* ``logprob_chunk``: rows per LM-head chunk;

and, once the schedule is built, :func:`retain_budget` decides how many tokens of
groups with children ``mode="auto"`` keeps alive until their backward (the rest are
recomputed).

It is a pure function of the model's shape and dtype, the bytes the step may still
allocate, and the forest's size (unique tokens, longest path): nothing measured on
earlier steps feeds back, so a step's calls (and the kernels they compile) do not
change after the first step. The runtime reads the device's free memory at each step
(``torch.cuda.mem_get_info`` and the allocator's cached bytes, capped by
``torch.cuda.set_per_process_memory_fraction``): that changes only when the process's
own allocations do (optimizer states after the first ``optimizer.step()``).

Settings (``TreeRuntime(memory=...)``):

``"auto"`` (default)
    the fastest plan whose predicted peak fits the budget (a margin below what the
    allocator can still hand out), or the leanest plan predicted within :data:`SLACK`
    of it when that saves at least :data:`LEANER` of its peak. On CPU (no device memory to plan for):
    8192-token calls, no checkpointing, everything retained.
``"low"``
    the lean recipe: layer checkpointing, calls of :data:`LOW_GROUP_TOKENS` tokens,
    :data:`LOW_LOGPROB_CHUNK`-row LM-head chunks, groups' layer inputs retained (no
    recompute of whole groups). Memory ~ weights + gradients + the KV stack of the
    path + ~0.1 MB per token of the call + one layer's activations.
a number
    a cap in GiB on the step's peak allocated memory (everything the process holds
    included): the fastest plan predicted under it.

Explicit ``group_tokens``, ``checkpoint_layers`` and ``logprob_chunk`` arguments of the
runtime are kept as given; the policy decides the rest.

The numbers it is built on (H100 80 GB, qwen2.5-1.5b bf16, eager HF layers, torch 2.11;
reports in ``/work/.device/2/r`` of the 2026-11-23 session, summarized in
``benchmarks/PERF_NOTES.md``):

* **activations of eager decoder layers**: 21.70 GiB for an 8,262-token call at the
  peak of a recompute step, 2.82 MB per token: the MLP keeps four ``[T, I]`` tensors
  per layer (gate, its SiLU, up, their product: 66.7 KB per layer-token measured,
  ``4 I`` elements), norms, projections' inputs, rotary and attention another ~29 KB.
  :func:`layer_activation_bytes` models ``L * itemsize * (4 I + 6 H + 3 Hq D)``: 2.78 MB
  (``ModelSpec.activation_bytes_per_token``, ``12 H + 4 I + 3 Hq D``, gives 3.30 MB, 17%
  high).
* **with layer checkpointing** autograd keeps each layer's ``[T, H]`` input: ``(L + 2)
  * H * itemsize`` = 92 KB per token (the final norm and LM-head rows included), plus,
  while a layer is re-run in backward, that layer's activations and their gradients
  (:data:`ONE_LAYER_BACKWARD` times one layer's share).
* **KV stack**: ``L * Hkv * (Dk + Dv) * (itemsize + 4)`` per slot (bf16 values, float32
  gradients): 86 KB; measured 1.16 GiB for 14.4k slots.
* **LM head, per chunk of c rows**: the chunked torch op keeps float32 temporaries,
  ~``c * V * (itemsize + 6)`` plus the float32 ``[V, H]`` weight-gradient accumulator
  (5.49 GiB measured at c = 4096); the fused Triton op one ``[c, V]`` buffer in the
  model dtype plus the accumulator (2.51 GiB at c = 4096, N = 16,384).
* **allocator fragmentation** (reserved - allocated at the peak): 10.7 GiB of 45.5
  reserved in recompute mode without ``expandable_segments``: the budget keeps
  :data:`MARGIN_FRAGMENTED` of the free memory unused then, :data:`MARGIN` with it.
* **retaining vs recomputing** the groups with children: on the 64k agentic tree (one
  such group, the 6.9k-token trunk) retaining it (auto) and recomputing it took 2.88 and
  2.90 s per step, for 17 GB more at the peak: ``mode="auto"`` retains only where the
  predicted saving reaches :data:`RETAIN_SAVING` of the step, and always with layer
  checkpointing (layer inputs are cheap; a recomputed checkpointed group would run its
  layers three times).
* **time** (a plan's predicted cost, in tokens' worth of fwd+bwd compute): a model
  call costs :data:`CALL_TOKENS` tokens (43 ms against 33 us per token, from 4,096- vs
  8,192-token calls on a 21k-token tree: 1.12 vs 0.90 s); re-running a token's layers
  (a recomputed group, or layer checkpointing) costs the layers' forward, about
  ``layer forward FLOPs / (3 * forward FLOPs)`` = 0.28 of a token for qwen2.5-1.5b;
  calls below 4,096 tokens lose efficiency (2,048-token calls: 2.04 s, +80% per token
  on the same tree); LM-head chunks of 1,024 rows re-read the float32 weight-gradient
  accumulator 4x as often as 4,096 (~15% of the head's time).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .models.protocol import ModelSpec

__all__ = [
    "MemoryPlan",
    "StepShape",
    "SETTINGS",
    "available_bytes",
    "head_bytes",
    "layer_activation_bytes",
    "layer_input_bytes",
    "missing_grad_bytes",
    "plan_step",
    "retain_budget",
    "stack_slot_bytes",
]

SETTINGS = ("auto", "low")
# Plans within this fraction of the fastest predicted one count as equally fast; the
# one with the least memory among them is taken when it saves at least LEANER of the
# fastest one's peak (the issue allows 5% against the best configuration; the rest is
# left for prediction error).
SLACK = 0.03
LEANER = 0.2
# mode="auto" retains groups with children (without layer checkpointing) only when that
# is predicted to save at least this fraction of the step.
RETAIN_SAVING = 0.05
# Fraction of the allocatable memory a plan leaves unused (fragmentation, kernels'
# workspaces, what the model does not tell us); larger without expandable segments.
MARGIN = 0.10
MARGIN_FRAGMENTED = 0.20
# Call sizes the policy considers (tokens); the largest call a schedule makes is at
# most its budget (and at most the forest).
GROUP_TOKENS = (32768, 16384, 8192, 4096, 2048)
LOGPROB_CHUNKS = (4096, 2048, 1024)
CPU_GROUP_TOKENS = 8192
DEFAULT_LOGPROB_CHUNK = 4096
LOW_GROUP_TOKENS = 8192
LOW_LOGPROB_CHUNK = 1024
# One layer re-run in backward holds its activations and about as much again in their
# gradients and temporaries.
ONE_LAYER_BACKWARD = 2.0
# Cost model constants (see the module docstring), for qwen2.5-1.5b on an H100 in eager
# mode; CALL_TOKENS scales with layers per unit of per-token compute.
CALL_TOKENS = 1300.0
_CALL_REFERENCE = (28, 3.09e9)  # (layers, forward FLOPs per token) where CALL_TOKENS was measured
SMALL_CALL_TOKENS = 4096  # calls below this lose efficiency
SMALL_CALL_PENALTY = 0.25  # extra cost per token per doubling below SMALL_CALL_TOKENS (fit: 2,048-token calls)
HEAD_CHUNK_PENALTY = {4096: 0.0, 2048: 0.05, 1024: 0.15}  # of the LM head's share of a token


def layer_activation_bytes(spec: ModelSpec, itemsize: int) -> float:
    """Bytes eager decoder layers keep for backward, per token, all layers."""
    per_layer = 4 * spec.intermediate_size + 6 * spec.hidden_size + 3 * spec.num_heads * spec.head_dim
    return spec.num_layers * itemsize * per_layer


def layer_input_bytes(spec: ModelSpec, itemsize: int) -> float:
    """Bytes per token kept with every layer checkpointed: each layer's ``[T, H]`` input,
    the final norm's and the LM head's rows."""
    return (spec.num_layers + 2) * spec.hidden_size * itemsize


def stack_slot_bytes(spec: ModelSpec, itemsize: int) -> float:
    """One KV-stack slot: K/V values in the model dtype and their float32 gradients."""
    return spec.kv_elements_per_token() * (itemsize + 4)  # the attending layers, each with its own shape


def head_bytes(spec: ModelSpec, itemsize: int, chunk: int, rows: int, fused: bool) -> float:
    """Peak bytes of the LM head's backward over ``rows`` predictions in chunks of
    ``chunk`` rows: the chunk's logits (fused: one buffer in the model dtype; torch:
    float32 temporaries too: 6 more bytes per logit at the peak, measured) and, with
    several chunks, the float32 ``[V, H]`` weight-gradient accumulator."""
    c = max(1, min(chunk, rows))
    per_element = itemsize if fused else itemsize + 6
    accumulator = spec.vocab_size * spec.hidden_size * 4 if rows > chunk else 0
    return c * spec.vocab_size * per_element + accumulator


def _forward_flops(spec: ModelSpec) -> float:
    return spec.forward_flops_per_token()


def _layer_share(spec: ModelSpec) -> float:
    """A token's layer forward as a fraction of its fwd+bwd (3x forward) compute."""
    head = 2 * spec.hidden_size * spec.vocab_size
    total = _forward_flops(spec)
    return (total - head) / (3 * total)


def _head_share(spec: ModelSpec) -> float:
    total = _forward_flops(spec)
    return 2 * spec.hidden_size * spec.vocab_size / total


def _call_tokens(spec: ModelSpec) -> float:
    """One model call's fixed cost in tokens' worth of compute (launch-bound eager
    layers: proportional to the layers, against the per-token compute)."""
    layers, flops = _CALL_REFERENCE
    return CALL_TOKENS * (spec.num_layers / layers) * (flops / _forward_flops(spec))


@dataclass(frozen=True)
class StepShape:
    """What the policy needs to know of a forest."""

    unique_tokens: int
    longest_path: int


@dataclass(frozen=True)
class MemoryPlan:
    """One step's decisions and the figures behind them (bytes are what the step adds
    on top of what was allocated when it started).

    ``retain_bytes``: what graphs of groups with children may hold at most (the
    budget left above the predicted peak), at ``retained_bytes_per_token`` each;
    ``inf`` on CPU. :func:`retain_budget` decides what ``mode="auto"`` spends of it."""

    group_tokens: int
    checkpoint_layers: bool
    logprob_chunk: int
    retain_bytes: float
    retained_bytes_per_token: float
    predicted_peak_bytes: float
    predicted_cost: float  # tokens' worth of compute
    budget_bytes: float
    setting: str
    parts: dict = field(default_factory=dict, compare=False)  # predicted peak by part (bytes)
    reason: str = ""

    def retain_tokens(self) -> float:
        """Tokens whose graphs fit in ``retain_bytes``."""
        if self.retained_bytes_per_token <= 0:
            return math.inf
        return self.retain_bytes / self.retained_bytes_per_token

    def describe(self) -> dict:
        """The plan as plain numbers (``StepOutput.metrics["memory_plan"]``)."""
        gib = 2.0**30
        return {
            "setting": self.setting,
            "group_tokens": self.group_tokens,
            "checkpoint_layers": self.checkpoint_layers,
            "logprob_chunk": self.logprob_chunk,
            "predicted_peak_gib": None if math.isinf(self.predicted_peak_bytes) else self.predicted_peak_bytes / gib,
            "budget_gib": None if math.isinf(self.budget_bytes) else self.budget_bytes / gib,
            "retain_gib": None if math.isinf(self.retain_bytes) else self.retain_bytes / gib,
            "reason": self.reason,
        }


def _calls(unique: int, group_tokens: int) -> float:
    """Model calls a schedule makes for ``unique`` tokens at a budget (groups are not
    full: 1.25x the ideal count, plus the group that holds the trunk)."""
    if unique <= group_tokens:
        return 1.0
    return math.ceil(1.25 * unique / group_tokens) + 1.0


def _candidate(
    spec: ModelSpec, itemsize: int, shape: StepShape, group_tokens: int, checkpoint: bool, chunk: int,
    fused_head: bool, stack_held: float, missing_grads: float,
) -> tuple[float, float, dict]:
    """(predicted peak bytes the step adds, predicted cost, parts) of one plan."""
    u = shape.unique_tokens
    call = max(1, min(group_tokens, u))
    activations = layer_activation_bytes(spec, itemsize)
    if checkpoint:
        held = layer_input_bytes(spec, itemsize) * call + ONE_LAYER_BACKWARD * activations / spec.num_layers * call
    else:
        held = activations * call
    stack = max(0.0, min(u, shape.longest_path + call) * stack_slot_bytes(spec, itemsize) - stack_held)
    parts = {
        "gradients": missing_grads,
        "kv_stack": stack,
        "lm_head": head_bytes(spec, itemsize, chunk, call, fused_head),
        "activations": held,
    }
    peak = sum(parts.values())
    cost = u * (1.0 + (_layer_share(spec) if checkpoint else 0.0))
    cost += _calls(u, group_tokens) * _call_tokens(spec)
    if call < SMALL_CALL_TOKENS:
        cost += u * SMALL_CALL_PENALTY * math.log2(SMALL_CALL_TOKENS / call)
    cost += u * _head_share(spec) * HEAD_CHUNK_PENALTY.get(chunk, 0.15)
    return peak, cost, parts


def plan_step(
    spec: ModelSpec,
    itemsize: int,
    shape: StepShape,
    *,
    on_cuda: bool,
    available: float = math.inf,
    expandable_segments: bool = False,
    setting: str | float = "auto",
    allocated: float = 0.0,
    group_tokens: int | None = None,
    checkpoint_layers: bool | None = None,
    logprob_chunk: int | None = None,
    fused_head: bool = False,
    stack_held: float = 0.0,
    missing_grads: float = 0.0,
    hf_checkpointing: bool = False,
) -> MemoryPlan:
    """Decide one step (see the module docstring).

    Args:
        spec, itemsize: the model's shape and its dtype's size in bytes.
        shape: the forest's unique tokens and longest path.
        on_cuda: False: the CPU defaults (no memory model).
        available: bytes the allocator can still hand out now (:func:`available_bytes`).
        expandable_segments: the allocator runs with them (less fragmentation).
        setting: ``"auto"``, ``"low"``, or a cap in GiB on the step's peak (of all
            allocated memory; ``allocated`` is what the process held when it started).
        group_tokens, checkpoint_layers, logprob_chunk: fixed by the user (None: decide).
        fused_head: the LM head runs the fused Triton op (its chunk is leaner).
        stack_held: bytes of the KV stack kept from earlier steps (reused or freed).
        missing_grads: bytes of the gradients the step will allocate (trainable
            parameters whose ``.grad`` is None).
        hf_checkpointing: the model checkpoints its own layers (HF gradient
            checkpointing): planned as checkpointed, and dtree adds no checkpoint.
    """
    label = _setting_label(setting)
    if hf_checkpointing:
        checkpoint_layers = True
    if setting == "low":
        checkpoint_layers = True if checkpoint_layers is None else checkpoint_layers
        group_tokens = LOW_GROUP_TOKENS if group_tokens is None else group_tokens
        logprob_chunk = LOW_LOGPROB_CHUNK if logprob_chunk is None else logprob_chunk
    if not on_cuda:
        g = CPU_GROUP_TOKENS if group_tokens is None else group_tokens
        return MemoryPlan(
            group_tokens=g, checkpoint_layers=bool(checkpoint_layers), logprob_chunk=logprob_chunk or DEFAULT_LOGPROB_CHUNK,
            retain_bytes=math.inf, retained_bytes_per_token=0.0, predicted_peak_bytes=math.inf,
            predicted_cost=math.nan, budget_bytes=math.inf, setting=label,
            reason="CPU: the low recipe" if setting == "low" else "CPU defaults (no device memory to plan for)",
        )
    margin = MARGIN if expandable_segments else MARGIN_FRAGMENTED
    budget = available * (1.0 - margin)
    if not isinstance(setting, str):
        budget = min(budget, setting * 2.0**30 - allocated)
    plans = [
        # group_tokens=0 (one segment per call) runs calls of at most a chunk_size;
        # the caller passes the budget it plans with
        (*_candidate(spec, itemsize, shape, g if g > 0 else SMALL_CALL_TOKENS, ckpt, chunk, fused_head, stack_held,
                     missing_grads), g, ckpt, chunk)
        for g in _options(group_tokens, GROUP_TOKENS)
        for ckpt in _options(checkpoint_layers, (False, True))
        for chunk in _options(logprob_chunk, LOGPROB_CHUNKS)
    ]
    (peak, cost, parts, g, ckpt, chunk), reason = _choose(plans, budget)
    per_token = layer_input_bytes(spec, itemsize) if ckpt else layer_activation_bytes(spec, itemsize)
    return MemoryPlan(
        group_tokens=g, checkpoint_layers=ckpt, logprob_chunk=chunk,
        retain_bytes=max(0.0, budget - peak), retained_bytes_per_token=per_token,
        predicted_peak_bytes=peak, predicted_cost=cost, budget_bytes=budget, setting=label, parts=parts, reason=reason,
    )


def _setting_label(setting: str | float) -> str:
    """``setting`` for reports (``"auto"``, ``"low"``, ``"12 GiB"``); a ValueError for
    anything else."""
    if not (setting in SETTINGS or (isinstance(setting, (int, float)) and not isinstance(setting, bool) and setting > 0)):
        raise ValueError(f"memory must be one of {SETTINGS} or a positive number of GiB, got {setting!r}")
    return setting if isinstance(setting, str) else f"{float(setting):g} GiB"


def _options(fixed, choices) -> tuple:
    """What the planner tries for one knob: the user's value, or every choice."""
    return (fixed,) if fixed is not None else choices


def _choose(plans: list[tuple], budget: float) -> tuple[tuple, str]:
    """The plan to run among ``(peak, cost, parts, group_tokens, checkpoint, chunk)``
    candidates, and why: the fastest that fits, or a leaner one within ``SLACK`` of its
    cost that saves at least ``LEANER`` of its memory; the leanest when none fits."""
    fitting = [p for p in plans if p[0] <= budget]
    if not fitting:
        return min(plans, key=lambda p: p[0]), "no plan is predicted to fit: the leanest one"
    fastest = min(fitting, key=lambda p: (p[1], p[0]))
    leanest = min((p for p in fitting if p[1] <= fastest[1] * (1 + SLACK)), key=lambda p: p[0])
    chosen = leanest if leanest[0] <= (1 - LEANER) * fastest[0] else fastest
    reason = ("fastest predicted plan that fits" if chosen is fastest else
              f"within {SLACK:.0%} of the fastest predicted plan, with {1 - chosen[0] / fastest[0]:.0%} less memory")
    if len(plans) > 1:
        reason += f" ({len(fitting)} of {len(plans)} plans fit)"
    return chosen, reason


def retain_budget(
    plan: MemoryPlan, spec: ModelSpec, mode: str, *, unique_tokens: int, num_groups: int, nonleaf_tokens: int,
    nonleaf_groups: int,
) -> float:
    """Tokens of groups with children whose graphs ``mode`` keeps alive at once (the
    walk retains the outermost first and recomputes the rest).

    ``retain``: all; ``recompute``: none; ``auto``: everything on CPU; with layer
    checkpointing, what fits in ``plan.retain_bytes`` (a group's layer inputs: cheap);
    without, what fits only if recomputing all of them (their layers' forward again,
    and one more call each) is predicted to cost at least :data:`RETAIN_SAVING` of the
    step (``unique_tokens`` in ``num_groups`` calls), else none."""
    if mode == "retain" or (mode == "auto" and math.isinf(plan.retain_bytes)):
        return math.inf
    if mode == "recompute" or nonleaf_tokens == 0:
        return 0.0
    if not plan.checkpoint_layers:
        saving = nonleaf_tokens * _layer_share(spec) + nonleaf_groups * _call_tokens(spec)
        step = unique_tokens + num_groups * _call_tokens(spec)
        if saving < RETAIN_SAVING * step:
            return 0.0
    return plan.retain_tokens()


def available_bytes(device: torch.device) -> tuple[float, float]:
    """(bytes the caching allocator can still hand out, bytes allocated now) on a CUDA
    ``device``: free device memory plus what the allocator holds unused, capped by
    ``torch.cuda.set_per_process_memory_fraction``."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    available = free + torch.cuda.memory_reserved(device) - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        available = min(available, total * get_fraction(device) - allocated)
    return float(available), float(allocated)


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator was configured with expandable segments."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def missing_grad_bytes(parameters: Iterable[torch.Tensor]) -> float:
    """Bytes of the gradients a step will allocate: trainable parameters without ``.grad``
    (each storage once: tied weights share one gradient)."""
    seen, total = set(), 0
    for p in parameters:
        if p.requires_grad and p.grad is None and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return float(total)
