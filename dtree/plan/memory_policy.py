"""Memory policy: how one training step runs a forest on the memory this process has.

Per step, :func:`plan_step` decides

* ``group_tokens``: the token budget of one model call (the schedule packs calls up
  to it);
* ``checkpoint_layers``: how many decoder layers of a call without child groups (and of
  a recomputed group's re-run) are checkpointed (:mod:`dtree.models.checkpointing`),
  keeping only their inputs: 0 (none) to all; the peak
  is the sum over layers, so checkpointing part of them trades memory for time
  smoothly;
* the path: whether the groups with children (the current root-to-leaf path's
  graphs, alive until their subtree is done) are retained, and with how many layers
  checkpointed (``path_checkpoint_layers``: their layer inputs are cheap, 86 KB per
  token on qwen2.5-1.5b, so a path of 10k tokens costs under 1 GB), or recomputed at
  their backward;
* ``logprob_chunk``: rows per LM-head chunk (after scheduling, calls whose backward follows their
  forward may run all their loss rows in one chunk where the budget has room:
  :mod:`dtree.plan.head_keep`).

So activation memory is bounded by one path plus one call, not by the tree, and the
policy recomputes only what does not fit.

It is a pure function of the model's shape and dtype, the per-token bytes its calls
keep (:class:`dtree.plan.memory_probe.CallBytes`: measured on the model as it is, its layer
kernels and adapters included, by the runtime; HF's eager figure otherwise), the
bytes the step may still allocate and the forest's size: nothing measured on earlier
steps feeds back, so a step's calls (and the kernels they compile) do not change after
the first step. The byte figures and the step simulation are in
:mod:`dtree.plan.memory_model`, with :class:`~dtree.plan.memory_model.MemoryPlan`; after
scheduling, :func:`dtree.plan.memory_model.refine` replaces the plan's bound with the
schedule's predicted peak.

Settings (``TreeRuntime(memory=...)``):

``"auto"`` (default)
    the fastest plan whose predicted peak fits the budget: :data:`MARGIN` below what
    the device has free at the call (``torch.cuda.mem_get_info``) plus what this
    process's allocator holds unused (:func:`available_bytes`), so memory another
    process (a colocated inference engine) holds is never planned for. On CPU (no
    device memory to plan for): 8192-token calls, no checkpointing, everything retained.
``"low"``
    the lean recipe's predicted peak (every layer checkpointed, :data:`LOW_GROUP_TOKENS`-token
    calls, :data:`LOW_GROUP_TOKENS_OFFLOADED` with the layer inputs on the host (CUDA: the
    runtime's ``offload_checkpoints``; then also the attention outputs, kept on the host with the
    inputs where the backend can: 6% faster for 0.03 GiB on the 64k tree, session AC), the path's
    groups retained, :data:`LOW_LOGPROB_CHUNK`-row LM-head chunks) is
    the cap, and the fastest plan predicted under it runs, with the recipe's LM-head
    chunks: the head's backward is where this setting's step peaked once (its ``[chunk, V]``
    buffer and the ``[V, H]`` weight gradient; ``benchmarks/results/h200/session_o``), and it
    still sets a floor under every call's peak; 1,024-row chunks cost ~2% of the head's time
    over 4,096 (``benchmarks/head_chunk_cost.py``), and 512-row chunks take another ~0.15 GiB
    off on qwen2.5-1.5b's 152k vocabulary (session Q). Since session S the step peaks in the
    top layer's re-run backward, the MLP's (:mod:`dtree.ops.swiglu`). No slack above the cap: a
    faster plan may not predict more memory than the recipe.
a number
    a cap in GiB on the step's peak allocated memory (everything the process holds
    included; :data:`CAP_MARGIN` is kept for prediction error): the fastest plan
    predicted under it. On CUDA the planner scores the cap with the layer inputs on the host
    and on the device and keeps the device's plan where it fits and is predicted no more than
    :data:`OFFLOAD_COST` slower (:func:`cheaper_than_offload`).

Explicit ``group_tokens``, ``checkpoint_layers`` and ``logprob_chunk`` arguments of the
runtime are kept as given; the policy decides the rest.

Time (a plan's predicted cost, in tokens' worth of fwd+bwd compute, ~23 us each for
qwen2.5-1.5b on an H200): a model call's CPU work (eager layers: ~90 ms to launch its
kernels forward and backward) is hidden behind the GPU unless the call's own GPU work is
shorter, so a call of ``T`` tokens costs :data:`~dtree.plan.memory_model.CALL_FIXED_TOKENS`
plus ``max(0, CALL_CPU_TOKENS * (1 + RERUN_CPU_SHARE * f) - T)``, ``f`` the fraction of its
layers that are checkpointed (their re-runs add host work); fitted on H200 hosts (session R,
``benchmarks/PERF_NOTES.md``): on the 64k agentic tree with every layer checkpointed,
8k-token calls ran 2.82 s where 12k ones ran 2.18 s; with nothing checkpointed 4k-token
calls cost 1.2 s over 32k ones. Re-running a layer (a checkpointed layer) costs
:data:`~dtree.plan.memory_model.RERUN_MATMUL_SHARE` of its forward, ``layer forward FLOPs
/ (3 * forward FLOPs) / L`` (0.28 for all 28 layers of qwen2.5-1.5b; the re-run skips the
down projection), plus its attention forward over the forest's keys
(:func:`~dtree.plan.memory_model.attention_rerun_rate`) unless the plan keeps checkpointed
layers' attention outputs (:mod:`dtree.ops.stack_attention.output_memo`; only where the
backend can, at 3 KB per layer and token on qwen2.5-1.5b); a recomputed group runs its whole
forward again. LM-head chunks of 1,024 and 2,048 rows are priced 15% and 5% of the head's
time over 4,096 (:data:`~dtree.plan.plan_candidates.HEAD_CHUNK_PENALTY`, from when the
backward re-read a float32 ``[V, H]`` sum per chunk; an H200 now measures 1-2%,
benchmarks/head_chunk_cost.py). Plans within :data:`~dtree.plan.plan_candidates.SLACK` (2%)
of the fastest count as equally fast: the leanest of them runs when it saves at least
:data:`~dtree.plan.plan_candidates.LEANER` of the memory (at 5%, GRPO case 1's default
checkpointed 9 layers once re-runs were priced as measured). The candidates are scored together in
:mod:`dtree.plan.plan_candidates` (beside the one-plan reference they equal).
"""

from __future__ import annotations

import math
import os
from typing import Iterable

import torch

from ..config import MEMORY_SETTINGS as SETTINGS
from ..device.allocator import allocator_bytes
from ..models.protocol import ModelSpec
from ..ops.swiglu.interface import CONSUMING_CHUNK_ROWS
from .memory_model import (
    RECOMPUTE,
    MemoryPlan,
    StepShape,
    _figures,
    attention_rerun_rate,
    cost_rates,
    head_bytes,
    layer_activation_bytes,
    layer_input_bytes,
    stack_grad_slot_bytes,
    stack_slot_bytes,
    state_slot_bytes,
    window_slot_bytes,
)
from .memory_probe import CallBytes, estimated_call_bytes
from .plan_candidates import KnobGrid, Knobs, candidate, candidate_scores, choose_index, knob_grid

__all__ = [
    "MemoryPlan", "RECOMPUTE", "StepShape", "SETTINGS", "available_bytes", "call_budgets", "cheaper_than_offload",
    "head_bytes",
    "layer_activation_bytes", "layer_input_bytes", "rerun_chunk_rows", "step_grad_bytes", "plan_step",
    "stack_slot_bytes",
    "state_slot_bytes",
]

# Fraction of the allocatable memory a plan leaves unused (fragmentation, kernels'
# workspaces, what the model does not tell us); larger without expandable segments.
MARGIN = 0.10
MARGIN_FRAGMENTED = 0.20
CAP_MARGIN = 0.03  # of a memory=<GiB> cap, for prediction error
# Call sizes the policy considers (tokens); the largest call a schedule makes is at
# most its budget (and at most the forest).
GROUP_TOKENS = (32768, 16384, 12288, 8192, 4096, 2048)
LOGPROB_CHUNKS = (4096, 2048, 1024, 512)  # 512: low's recipe, which a cap in GiB can need too (memory=8: session X)
CHECKPOINT_STEPS = 8  # layer counts tried: 0, L/8, ..., L
CPU_GROUP_TOKENS = 8192
DEFAULT_LOGPROB_CHUNK = 4096
LOW_GROUP_TOKENS = 8192
LOW_GROUP_TOKENS_OFFLOADED = 12288  # with the layer inputs on the host a call's size costs little memory
LOW_LOGPROB_CHUNK = 512
# memory="low": a re-run's SwiGLU backward in chunks of this many rows (its leanest); other plans run
# each call's in one chunk, as the memory probe measures it (its 128- and 384-token calls are one chunk)
LOW_RERUN_CHUNK_ROWS = CONSUMING_CHUNK_ROWS
# What the offload's copies cost a capped step, as a share of its predicted time (the time model
# itself prices them at nothing): a margin, not a measured cost. Session W fitted 0.12 when the
# outputs' copies were not yet overlapped and the time model priced a recomputed path on the trie's
# nodes with children. With the attention outputs kept on the host beside the inputs (session AC)
# and calls scored on their schedule's packing (session AD), the offloaded memory=12.5 plan on the
# 64k tree (32k-token calls, path recomputed) ran 1.858 s against the device's (16k-token calls)
# 1.861 s, predicted 1.0% slower: the copies cost nothing the runs can see.
OFFLOAD_COST = 0.02


def _checkpoint_options(fixed: int | None, layers: int) -> tuple[int, ...]:
    if fixed is not None:
        return (fixed,)
    step = max(1, layers // CHECKPOINT_STEPS)
    return tuple(sorted(set(range(0, layers, step)) | {layers}))


def plan_step(
    spec: ModelSpec,
    itemsize: int,
    shape: StepShape,
    *,
    on_cuda: bool,
    available: float = math.inf,
    expandable_segments: bool = False,
    setting: str | float = "auto",
    mode: str = "auto",
    allocated: float = 0.0,
    group_tokens: int | None = None,
    checkpoint_layers: bool | int | None = None,
    logprob_chunk: int | None = None,
    fused_head: bool = False,
    stack_held: float = 0.0,
    step_grads: float = 0.0,
    hf_checkpointing: bool = False,
    can_checkpoint: bool = True,
    call_bytes: CallBytes | None = None,
    keep: tuple[int, int, int, int, bool] | None = None,
    can_keep_attention: bool = False,
    offload: bool = False,
    kv_window: bool = False,
) -> MemoryPlan:
    """Decide one step (see the module docstring).

    Args:
        spec, itemsize: the model's shape and its dtype's size in bytes.
        shape: the forest's unique tokens, longest path and shared (trie-internal) tokens.
        on_cuda: False: the CPU defaults (no memory model).
        available: bytes the allocator can still hand out now (:func:`available_bytes`).
        expandable_segments: the allocator runs with them (less fragmentation).
        setting: ``"auto"``, ``"low"``, or a cap in GiB on the step's peak (of all
            allocated memory; ``allocated`` is what the process held when it started).
        mode: the runtime's mode: ``"retain"`` / ``"recompute"`` fix how the groups
            with children run; ``"auto"`` leaves it to the plan.
        group_tokens, checkpoint_layers, logprob_chunk: fixed by the user (None: decide; True: all layers).
        fused_head: the LM head runs the fused Triton op (its chunk is leaner).
        stack_held: bytes of the stacks (KV, states) kept from earlier steps (reused or freed).
        step_grads: bytes of the gradients the step allocates (:func:`step_grad_bytes`).
        hf_checkpointing: the model checkpoints its own layers (HF's; ``call_bytes`` so): dtree adds none.
        can_checkpoint: dtree can checkpoint the model's layers (a layer list).
        call_bytes: per-token bytes of the model's calls (None: HF's eager figure).
        keep: an earlier plan's (group_tokens, checkpoint_layers, path_checkpoint_layers,
            logprob_chunk, keep_attention_outputs), kept while predicted to fit (deterministic mode).
        can_keep_attention: the attention backend can keep a checkpointed layer's outputs for its
            re-run (:mod:`dtree.ops.stack_attention.output_memo`): plans with and without are scored.
        offload: checkpointed layers' inputs wait on the host (:meth:`CallBytes.offloading`).
        kv_window: plans with every layer checkpointed run leaf calls in a KV window (``kv_stack_bytes``).
    """
    label, L = _setting_label(setting), spec.num_layers
    cb = call_bytes or estimated_call_bytes(spec, itemsize)
    fixed_ckpt = _fixed_checkpoint(checkpoint_layers, L, hf_checkpointing or not can_checkpoint)
    if not on_cuda:
        return _cpu_plan(label, setting, mode, L, group_tokens, fixed_ckpt, logprob_chunk, offload)
    fig_of = {c: _figures(spec, itemsize, cb, fused_head, c, offload) for c in (*LOGPROB_CHUNKS, logprob_chunk) if c}
    fixed = _shared_figures(spec, itemsize, shape, stack_held, step_grads, kv_window)
    budget = _budget(available, expandable_segments, setting, allocated)
    recipe = _low_recipe(mode, L, group_tokens, fixed_ckpt, logprob_chunk, offload, can_keep_attention) \
        if setting == "low" else None
    chunk = recipe.chunk if recipe is not None else logprob_chunk
    grid = _knob_grid(shape, mode, L, group_tokens, fixed_ckpt, chunk, can_keep_attention, offload)
    if recipe is not None:  # the lean recipe's peak is the cap: a faster plan must not need more
        fig_of.setdefault(recipe.chunk, _figures(spec, itemsize, cb, fused_head, recipe.chunk, offload))
        budget = min(budget, candidate(shape, recipe, fig_of[recipe.chunk], spec, fixed)[0])
    peaks, costs = candidate_scores(shape, grid, fig_of, spec, fixed)
    chosen, reason = choose_index(peaks, costs, grid, budget, Knobs(*keep) if keep is not None else None)
    kn = grid.knob(chosen)
    peak, cost, parts = candidate(shape, kn, fig_of[kn.chunk], spec, fixed)
    cb = fig_of[kn.chunk].call_bytes_keeping if kn.keep else fig_of[kn.chunk].call_bytes
    per_token = cb.call(kn.path) if kn.path != RECOMPUTE else 0.0
    retain = 0.0 if kn.path == RECOMPUTE else max(parts["path_graphs"], budget - peak + parts["path_graphs"])
    return MemoryPlan(
        group_tokens=kn.group_tokens, checkpoint_layers=kn.checkpoint, path_checkpoint_layers=kn.path,
        keep_attention_outputs=kn.keep, logprob_chunk=kn.chunk, retain_bytes=retain, retained_bytes_per_token=per_token,
        predicted_peak_bytes=peak, predicted_cost=cost, budget_bytes=budget, setting=label, start_bytes=allocated,
        parts=parts, reason=reason, call_bytes=cb, fused_head=fused_head, spec=spec, itemsize=itemsize,
        step_grad_bytes=step_grads, offload_checkpoints=offload,
    )


def _budget(available: float, expandable_segments: bool, setting: str | float, allocated: float) -> float:
    """Bytes a plan's peak may add: the margin off what is available, and a cap's share."""
    budget = available * (1.0 - (MARGIN if expandable_segments else MARGIN_FRAGMENTED))
    if not isinstance(setting, str):
        budget = min(budget, setting * 2.0**30 * (1 - CAP_MARGIN) - allocated)
    return budget


def _shared_figures(spec: ModelSpec, itemsize: int, shape: StepShape, stack_held: float, step_grads: float,
                    kv_window: bool = False) -> dict:
    """What every candidate plan shares, computed once per step (~770 candidates on GRPO case 1);
    ``window``: plans with every layer checkpointed run leaf calls in a KV window."""
    return {
        "window": kv_window, "window_slot_bytes": window_slot_bytes(spec, itemsize),
        "stack_held": stack_held, "step_grads": step_grads, "attention_rerun": attention_rerun_rate(spec, shape),
        "rates": cost_rates(spec), "slot_bytes": stack_slot_bytes(spec, itemsize),
        "grad_slot_bytes": stack_grad_slot_bytes(spec, itemsize),
        "state_bytes": state_slot_bytes(spec, itemsize),
    }


def _knob_grid(shape: StepShape, mode: str, layers: int, group_tokens, fixed_ckpt, logprob_chunk,
               can_keep: bool, offload: bool = False) -> KnobGrid:
    """Every plan the policy scores: call sizes, checkpointed layers (calls and path),
    head chunks, and whether checkpointed layers keep their attention outputs."""
    return knob_grid(call_budgets(group_tokens, shape.unique_tokens), _checkpoint_options(fixed_ckpt, layers),
                     _path_options(mode, fixed_ckpt, layers, offload), _options(logprob_chunk, LOGPROB_CHUNKS),
                     can_keep)


def _low_recipe(mode: str, layers: int, group_tokens, fixed_ckpt, logprob_chunk, offload: bool = False,
                can_keep: bool = False) -> Knobs:
    """The lean recipe: every layer checkpointed, the groups with children retained
    (their layer inputs) unless the mode recomputes them, mid-size calls, small head chunks.
    With the layer inputs on the host: larger calls (smaller ones are host-bound: 8k-token
    calls paid their whole host time in session R), the path recomputed unless the mode
    retains it (retained with its inputs on the host, the 64k tree's step ran 10% slower in
    session V; recomputed, as fast as with them on the device), and the attention outputs
    kept where the backend can (on the host with the inputs: two layers' worth on the device,
    and no attention forward in the re-runs)."""
    k = layers if fixed_ckpt is None else fixed_ckpt
    group = (LOW_GROUP_TOKENS_OFFLOADED if offload else LOW_GROUP_TOKENS) if group_tokens is None else group_tokens
    chunk = LOW_LOGPROB_CHUNK if logprob_chunk is None else logprob_chunk
    recompute = mode == "recompute" or (offload and mode != "retain")
    return Knobs(group, k, RECOMPUTE if recompute else k, chunk, offload and can_keep and k > 0)


def _fixed_checkpoint(value: bool | int | None, layers: int, forbidden: bool) -> int | None:
    """The layer count the user fixed (None: the policy decides)."""
    if forbidden:
        return 0
    if value is None:
        return None
    if value is True:
        return layers
    return min(int(value), layers)


def _path_options(mode: str, fixed: int | None, layers: int, offload: bool = False) -> tuple[int, ...]:
    """How groups with children may run: retained with none, half or all of their layers
    checkpointed (the path is a few percent of the tokens: coarser steps than the
    calls' keep the search small), or recomputed (the last option: the leanest). With the
    layer inputs on the host (``offload``) a retained path's checkpointed layers keep theirs
    there until their backward, which the time model does not price: on the 64k tree such plans
    ran 10% (session V) and 5% (session X, ``memory=8``: 2.212 s against `low`'s 2.100 s,
    predicted 13% faster) slower than recomputing the path, so only ``mode="retain"`` takes them."""
    if mode == "recompute":
        return (RECOMPUTE,)
    retained = (0, layers // 2, layers) if fixed is None else (fixed,)
    if mode == "retain":
        return retained
    return tuple(k for k in retained if k == 0 or not offload) + (RECOMPUTE,)


def _cpu_plan(label, setting, mode, layers, group_tokens, fixed_ckpt, logprob_chunk, offload) -> MemoryPlan:
    k = fixed_ckpt if fixed_ckpt is not None else (layers if setting == "low" else 0)
    return MemoryPlan(
        group_tokens=CPU_GROUP_TOKENS if group_tokens is None else group_tokens, checkpoint_layers=k,
        path_checkpoint_layers=RECOMPUTE if mode == "recompute" else k,
        logprob_chunk=logprob_chunk or (LOW_LOGPROB_CHUNK if setting == "low" else DEFAULT_LOGPROB_CHUNK),
        retain_bytes=math.inf, retained_bytes_per_token=0.0,
        predicted_peak_bytes=math.inf, predicted_cost=math.nan, budget_bytes=math.inf, setting=label,
        reason="CPU: the low recipe" if setting == "low" else "CPU defaults (no device memory to plan for)",
        offload_checkpoints=offload,
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


def rerun_chunk_rows(setting: str | float, fixed: int | None) -> int:
    """The rows per chunk of a checkpointed layer's SwiGLU backward in its re-run: ``fixed``
    (``RuntimeConfig.rerun_chunk_rows``) when given; else the whole call (0), what the memory probe
    prices per token; under ``memory="low"``, :data:`LOW_RERUN_CHUNK_ROWS`. With 4,096-row chunks
    the capped 256k step ran 1.3% slower (session AF; the 64k one as fast either way): each chunk's
    weight gradient is a matmul of 4,096-deep sums whose float32 total is read and written per chunk."""
    if fixed is not None:
        return fixed
    return LOW_RERUN_CHUNK_ROWS if setting == "low" else 0


def call_budgets(fixed: int | None, unique_tokens: int) -> tuple[int, ...]:
    """The call budgets worth scoring: the user's, or :data:`GROUP_TOKENS` without those
    that plan the same calls as a larger one (every budget at or above the forest's size
    is one call of the whole forest: a GRPO group of 6k tokens scores one of 32k, 16k and
    8k, not all three)."""
    if fixed is not None:
        return (fixed,)
    seen: set[int] = set()
    out = []
    for g in GROUP_TOKENS:
        call = min(g, max(1, unique_tokens))
        if call not in seen:
            seen.add(call)
            out.append(g)
    return tuple(out)


def cheaper_than_offload(offloaded: MemoryPlan, on_device: MemoryPlan) -> MemoryPlan:
    """Under a cap in GiB, the plan with the layer inputs on the device where it fits and is
    predicted no slower than the offloaded plan with its copies priced (:data:`OFFLOAD_COST`);
    else the offloaded one (at memory=8 on the 64k tree the only plans that fit on the device ran
    2k-token calls: 7.66 s, against 5.41 s for the offloaded plan's 4k-token calls: session W)."""
    fits = on_device.predicted_peak_bytes <= on_device.budget_bytes
    faster = on_device.predicted_cost <= offloaded.predicted_cost * (1 + OFFLOAD_COST)
    return on_device if fits and faster else offloaded


def available_bytes(device: torch.device) -> tuple[float, float]:
    """(bytes the caching allocator can still hand out, bytes allocated now) on a CUDA
    ``device``: the device's free memory (``torch.cuda.mem_get_info``: what other
    processes hold is not free) plus what this process's allocator holds unused,
    capped by ``torch.cuda.set_per_process_memory_fraction``."""
    free, total = torch.cuda.mem_get_info(device)
    counts = allocator_bytes(device)
    allocated = counts.allocated
    available = free + counts.reserved - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        available = min(available, total * get_fraction(device) - allocated)
    return float(available), float(allocated)


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator was configured with expandable segments."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def step_grad_bytes(parameters: Iterable[torch.Tensor], kept_aside: bool = True) -> float:
    """Bytes of the gradients a training step allocates (each storage once: tied weights share
    one gradient). ``kept_aside`` (``grad_guard``): a fresh ``.grad`` for every trainable
    parameter, whether or not it has one already: the step keeps the gradients already there
    aside until it succeeds (:class:`dtree.engine.grad_guard.GradStash`), so in a
    gradient-accumulation loop both are alive (the old ones are in the allocated bytes the plan
    starts from, the step's are these). Else the parameters without ``.grad`` only."""
    seen, total = set(), 0
    for p in parameters:
        if p.requires_grad and (kept_aside or p.grad is None) and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return float(total)
