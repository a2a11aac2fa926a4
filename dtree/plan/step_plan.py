"""The plan of a step: what :class:`dtree.TreeRuntime` decides before the walk, built once.

A *step* is one call of the runtime (``forward_backward``, ``logprobs``, ...); it reads
check -> weights -> plan -> walk -> finish. :class:`StepPlanner` builds the plan, a
:class:`StepPlan` value the walk (:mod:`dtree.engine.walk`) only reads: the attention and
recurrence backends for the model's placement, the memory plan, the schedule, the loss
terms, the retain budget, the stacks (KV and, for recurrent layers, states) sized by the
slots the schedule writes, and the step's arrays on the device.

Each is a function of the model's state now (device, dtype, training flags, HF
gradient checkpointing), the :class:`~dtree.config.RuntimeConfig` and the step's
forest or schedule, so the planner reads them at every call, not at construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..config import RuntimeConfig
from ..device.placement import model_placement
from ..device.transfer import upload_arrays
from ..forest.forest import Forest
from ..models import ModelSpec, TreeModule, unwrap
from ..ops import determinism, stack_ops
from ..ops.logprobs import OutputHead, as_output_head, compute_dtype, fused_head_kernel
from ..ops.stack_attention.output_memo import KEEPING_BACKENDS
from ..stacks.step_stacks import StepStacks
from . import memory_policy
from .backend_choice import Placement, pick_backend, pick_recurrence
from .head_keep import keep_head_logits
from .loss_terms import LossTerms, all_predictions, select_loss_terms
from .memory_model import refine
from .memory_probe import CallBytes, attention_is_plain, measure_call_bytes
from .model_view import ModelView, model_view
from .schedule import Packing, Schedule, build_schedule
from .stack_sizes import (
    StackSizes,
    budget_packings,
    check_stack_capacity,
    leaf_calls_can_window,
    planning_shape,
    stack_sizes,
)
from .state_plan import StatePlan, plan_states

__all__ = [
    "StepArrays", "StepPlan", "StepPlanner", "checkpoint_root", "measured_call_bytes", "offloads_checkpoints",
    "plan_memory",
]

KEPT_PLANS = 256  # forest shapes whose plans deterministic mode keeps


def checkpoint_root(module: torch.nn.Module, view: ModelView | None = None) -> torch.nn.Module | None:
    """The module whose decoder layers dtree checkpoints (None: it cannot: no layer list,
    or HF gradient checkpointing does it already). ``view``: ``module``'s this step."""
    view = view or model_view(module)
    if view.hf_checkpointing or not view.can_checkpoint:
        return None
    return unwrap(module)


def offloads_checkpoints(config: RuntimeConfig, device: torch.device, view: ModelView) -> bool:
    """Whether checkpointed layers may keep their inputs on the host (:mod:`dtree.models.host_checkpoints`):
    ``"auto"`` on CUDA under a memory cap (under a number :func:`plan_memory` takes the offload only where it
    is predicted faster with its copies priced: :func:`~dtree.plan.memory_policy.cheaper_than_offload`); never
    under HF's own checkpointing (``torch.utils.checkpoint`` keeps them)."""
    if not view.can_checkpoint or view.hf_checkpointing or config.offload_checkpoints is False:
        return False
    return config.offload_checkpoints is True or (device.type == "cuda" and config.memory != "auto")


def plan_memory(
    view: ModelView,
    spec: ModelSpec,
    head: OutputHead,
    config: RuntimeConfig,
    placement: Placement,
    stack: StepStacks | None,
    forest: Forest,
    call_bytes: CallBytes | None = None,
    kept: dict | None = None,
    attention: str | None = None,
    releasing: float = 0.0,
    kv_window: bool = False,
    packings: dict[int, Packing] | None = None,
) -> memory_policy.MemoryPlan:
    """The memory policy's plan for a step over ``forest`` (see :mod:`dtree.plan.memory_policy`);
    ``view``: the model this step (:func:`dtree.plan.model_view.model_view`); ``stack``: the stacks the runtime holds now (their bytes are already allocated);
    ``call_bytes``: the model's measured per-token figures (None: HF's eager estimate); ``attention``: the
    stack-attention backend (one of ``KEEPING_BACKENDS`` lets the plan keep checkpointed layers' attention outputs).
    ``releasing``: bytes allocated now that are free before the step starts (planned ahead, while the step
    before it still holds them: :mod:`dtree.engine.micro_batches`). ``kv_window``: plans with every layer checkpointed run leaf calls in a KV window (scored so);
    ``packings``: :func:`dtree.plan.stack_sizes.budget_packings` (packed here when None).
    ``kept`` (deterministic mode): the last plan per forest shape, which a step over that
    shape keeps while it is predicted to fit, whatever else the memory free at the call
    would allow: call sizes, checkpointing and head chunks set the order of the gradient's
    sums, so two runs of one forest give the same bits only under one plan.
    The plan's ``grad_guard`` is the config's, except under a memory cap while accumulating
    (``param.grad`` set) with the default guard: ``"host"`` (:class:`dtree.engine.grad_guard.GradHostCopy`)
    when the plan without the device copy of the old gradients is predicted faster, and under
    ``memory="low"`` when it is predicted leaner (that cap is its own recipe's peak, which the
    copy raises wherever the step peaks with its gradients: :func:`dtree.plan.memory_model.grads_at_peak`)."""
    device, dtype = placement
    itemsize = torch.empty((), dtype=dtype).element_size()
    kw = {}
    if device.type == "cuda":
        available, allocated = memory_policy.available_bytes(device)
        kw = dict(
            available=available + releasing,
            allocated=allocated - releasing,
            expandable_segments=memory_policy.expandable_segments(),
            stack_held=float(stack.nbytes()) if stack is not None and stack.device == device else 0.0,
            step_grads=memory_policy.step_grad_bytes(view.parameters, config.grad_guard in (True, "device")),
            fused_head=fused_head_kernel(head, dtype, device), kv_window=kv_window,
        )
    offload = offloads_checkpoints(config, device, view)
    shape = planning_shape(forest, config, spec, device, attention, packings)
    last = kept.get(shape) if kept is not None else None
    keep = None if last is None else (
        last.group_tokens, last.checkpoint_layers, last.path_checkpoint_layers, last.logprob_chunk,
        last.keep_attention_outputs,
    )
    def planned(**changes) -> memory_policy.MemoryPlan:
        return memory_policy.plan_step(
            spec, itemsize, shape, on_cuda=device.type == "cuda", setting=config.memory, mode=config.mode,
            group_tokens=config.group_tokens, checkpoint_layers=config.checkpoint_layers,
            logprob_chunk=config.logprob_chunk, hf_checkpointing=view.hf_checkpointing,
            can_checkpoint=view.can_checkpoint, call_bytes=call_bytes, keep=keep,
            can_keep_attention=config.keep_attention_outputs and attention in KEEPING_BACKENDS,
            **{"offload": offload, **kw, **changes},
        )

    plan = planned()
    if offload and config.offload_checkpoints == "auto" and not isinstance(config.memory, str):
        plan = memory_policy.cheaper_than_offload(plan, planned(offload=False))
        offload = plan.offload_checkpoints
    plan = dataclasses.replace(plan, grad_guard=config.grad_guard)
    if config.grad_guard is True and config.memory != "auto" and kw:
        in_place = memory_policy.step_grad_bytes(view.parameters, kept_aside=False)
        if in_place < kw["step_grads"]:  # accumulating: the old gradients could wait on the host instead
            lean = planned(step_grads=in_place)
            if lean.predicted_cost < plan.predicted_cost or (  # low: the least memory
                config.memory == "low" and lean.predicted_peak_bytes < plan.predicted_peak_bytes
            ):
                plan = dataclasses.replace(lean, grad_guard="host")
    if kept is not None:
        kept.pop(shape, None)
        kept[shape] = plan
        while len(kept) > KEPT_PLANS:  # the oldest shapes first
            kept.pop(next(iter(kept)))
    return plan


def model_state_key(view: ModelView, placement: Placement, attention: str, recurrence: str | None) -> tuple:
    """What a probe of the model depends on: its placement, backends, HF checkpointing, its modules
    and which of them have a patched ``forward``, and which parameters are frozen."""
    return (
        placement, attention, recurrence, view.hf_checkpointing,
        tuple((type(m).__name__, "forward" in vars(m)) for m in view.modules),
        tuple(p.requires_grad for p in view.parameters),
    )


def measured_call_bytes(
    module: torch.nn.Module, view: ModelView, model: TreeModule, spec: ModelSpec, placement: Placement, attention: str,
    cache: dict, recurrence: str | None = None,
) -> CallBytes | None:
    """The model's per-token call figures (:func:`dtree.plan.memory_probe.measure_call_bytes`),
    measured once per model state (its modules and which of them have a patched
    ``forward``, frozen parameters, HF checkpointing, placement, attention and recurrence
    backends) and kept in ``cache``. None off CUDA (no plan needs them), and under
    ``torch.inference_mode()`` before a first measurement (no graph to measure there)."""
    if placement[0].type != "cuda":
        return None
    key = model_state_key(view, placement, attention, recurrence)
    if key not in cache and not torch.is_inference_mode_enabled():
        cache[key] = measure_call_bytes(model, spec, placement, attention, checkpoint_root(module, view), recurrence)
    return cache.get(key)


@dataclass(frozen=True)
class StepArrays:
    """Every per-step array the walk slices, on the device (int64 unless noted), in one
    upload per kind (:func:`dtree.device.transfer.upload_arrays`).

    Attributes:
        input_ids, positions: [U] token id and position of every row, group after group.
        pred_hidden_row: [P] row (local to its group) whose hidden state predicts.
        pred_unique: [P] unique token each prediction predicts.
        labels: [P] its token id.
        loss_pred: [E] index (local to its group's predictions) of each term's log-prob.
        weights: [E] compute-dtype weight of each loss term (None in a log-prob walk).
        fields: name -> [E] compute-dtype per-token field of each loss term.
        stack_starts: [G] first stack slot of each group: the device-side slot offsets
            the KV stack's CUDA ops read (:mod:`dtree.ops.stack_ops`).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    pred_hidden_row: torch.Tensor
    pred_unique: torch.Tensor
    labels: torch.Tensor
    loss_pred: torch.Tensor
    weights: torch.Tensor | None = None
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    stack_starts: torch.Tensor | None = None


@dataclass(frozen=True)
class StepPlan:
    """One step's plan, built once by :meth:`StepPlanner.make_plan`; the walk only reads it.

    ``memory``: the memory policy's decisions; ``sched``: the groups and calls; ``terms``:
    the predictions and loss terms of each group (every prediction in a log-prob walk);
    ``arrays``: their device arrays; ``stack``: the KV (and state) stacks, with gradient
    slots in a training plan; ``states``: the state slots (recurrent layers, else None);
    ``retain_budget``: tokens of groups with children whose graphs may be alive at once
    (``mode``: the config's retain / recompute / auto).
    The rest say how the model runs: ``checkpoint_root`` (None: no layer checkpointing)
    with ``checkpoint_layers`` of its decoder layers checkpointed in the calls of groups
    without children and in recomputed groups' re-runs, ``path_checkpoint_layers`` in
    retained groups with children, ``keep_attention_outputs``: whether those
    checkpointed layers keep their attention outputs for the re-run, ``offload_checkpoints``:
    whether their inputs wait in pinned host memory, ``rerun_chunk_rows``: the rows per chunk of their
    re-runs' SwiGLU backward (0: the whole call); ``randomness``: every group runs under its own RNG
    seed (a module is in training mode, :mod:`dtree.device.rng`); ``state_grads``: per layer,
    whether its states' stack reads take gradients (None: all)."""

    forest: Forest
    memory: memory_policy.MemoryPlan
    sched: Schedule
    terms: LossTerms
    arrays: StepArrays
    stack: StepStacks
    states: StatePlan | None
    retain_budget: float
    mode: str
    model: TreeModule
    head: OutputHead
    attention: str
    recurrence: str | None
    logprob_chunk: int
    device: torch.device
    dtype: torch.dtype
    randomness: bool
    checkpoint_root: torch.nn.Module | None
    checkpoint_layers: int
    path_checkpoint_layers: int
    keep_attention_outputs: bool
    offload_checkpoints: bool
    progress: bool
    deterministic: bool
    state_grads: tuple[bool, ...] | None
    kv_window: bool = False  # leaf calls run in the stacks' KV window (dtree.ops.stack_ops.kv_window)
    rerun_chunk_rows: int = 0
    kept_head_rows: int = 0  # a backward_now call of at most these loss rows: its head in one chunk, logits kept


class StepPlanner:
    """Builds every step's :class:`StepPlan` from the model's state now and keeps what
    steps share: the backends for the model's placement, the stacks (reused while they
    fit), the measured call figures per model state, the last schedule's state slots and
    the last memory plan."""

    def __init__(self, module: torch.nn.Module, model: TreeModule, spec: ModelSpec, config: RuntimeConfig) -> None:
        self.module, self.model, self.spec, self.config = module, model, spec, config
        self.placement: Placement | None = None
        self.deterministic = False  # deterministic mode as the backends were picked for
        self.attention: str | None = None
        self.recurrence: str | None = None
        self.stack: StepStacks | None = None
        self.memory_plan: memory_policy.MemoryPlan | None = None  # the last planned step's
        self._call_bytes: dict = {}
        self._plain: dict = {}  # per model state: its layers attend with no score options
        self._can_window = False  # the last planned step's leaf calls may run in a KV window
        self._kept_plans: dict = {}  # deterministic mode: the last plan per forest shape (plan_memory)
        # the last step's memory plan, schedule and state slots (the two-pass path reuses them)
        self._last: tuple[memory_policy.MemoryPlan, Schedule, StatePlan | None] | None = None

    def sync(self, view: ModelView | None = None) -> Placement:
        """Read the model's device and dtype (from ``view``, the model this step, when
        given); when they (or torch's deterministic mode) changed since the last call, pick
        the backends again (the stacks are reallocated when they no longer fit)."""
        placement = model_placement(view.parameters if view is not None else self.module.parameters())
        deterministic = determinism.requested(self.config.deterministic)
        if placement != self.placement or deterministic != self.deterministic:
            self.placement, self.deterministic = placement, deterministic
            self.attention = pick_backend(self.config.attention, placement, self.spec, deterministic)
            self.recurrence = pick_recurrence(self.config.recurrence, placement, self.spec, deterministic)
            if deterministic:
                stack_ops.note_missing_extension(placement[0])
        return placement

    @property
    def logprob_chunk(self) -> int:
        if self.config.logprob_chunk is not None:
            return self.config.logprob_chunk
        return self.memory_plan.logprob_chunk if self.memory_plan is not None else memory_policy.DEFAULT_LOGPROB_CHUNK

    def schedule(self, forest: Forest) -> Schedule:
        """The schedule a step over ``forest`` (validated) would run now."""
        return self._plan_schedule(forest, None, same_schedule=False)[1]

    def _plan_schedule(
        self, forest: Forest, weights: np.ndarray | None, same_schedule: bool, view: ModelView | None = None,
        releasing: float = 0.0,
    ) -> tuple[memory_policy.MemoryPlan, Schedule, LossTerms, StatePlan | None]:
        """The memory plan, schedule, loss terms (``weights`` None: every prediction) and state
        slots of a step over ``forest``, in that order: the plan sizes the calls, the schedule
        packs them, the state slots follow the schedule, and the plan's peak is then predicted
        from the schedule (:func:`dtree.plan.memory_model.refine`). ``same_schedule``: the last
        step's plan, schedule and state slots, with new loss terms (the two-pass path) and the calls that keep
        their LM head's logits decided on them (:meth:`_with_kept_head`).
        ``view``: the model this step (:func:`dtree.plan.model_view.model_view`); ``releasing``:
        :func:`plan_memory`'s."""
        if same_schedule:
            memory, sched, states = self._last
            terms = select_loss_terms(sched.predictions, forest, weights)
            self.memory_plan = memory = self._with_kept_head(memory, sched, terms, weights is not None)
            return memory, sched, terms, states
        view = view or model_view(self.module)
        self.sync(view)
        head = as_output_head(self.model.dtree_output_layer())
        call_bytes = measured_call_bytes(
            self.module, view, self.model, self.spec, self.placement, self.attention, self._call_bytes, self.recurrence
        )
        kept = self._kept_plans if self.deterministic else None
        self._can_window = self._leaf_calls_can_window(view)
        packings = budget_packings(forest, self.config, self.placement[0])  # scored by the policy, one frozen
        memory = plan_memory(
            view, self.spec, head, self.config, self.placement, self.stack, forest, call_bytes, kept,
            self.attention, releasing, self._can_window, packings,
        )
        sched = build_schedule(forest, self.config.chunk_size, memory.group_tokens, packings.get(memory.group_tokens))
        check_stack_capacity(sched, forest, self.config.stack_capacity)
        terms = (select_loss_terms(sched.predictions, forest, weights) if weights is not None
                 else all_predictions(sched.predictions))
        states = plan_states(sched) if self.spec.recurrent_states else None
        held = (self.stack.capacity, self.stack.state_slots) if self.stack is not None else (0, 0)
        retain_tokens = memory.retain_budget(self.config.mode, self.config.retain_budget_tokens)
        sizes = self._stack_sizes(sched, memory, training=weights is not None)
        memory = refine(memory, sched, retain_tokens, held, states.capacity if states is not None else 0,
                        stack_slots=sizes.kv, grad_slots=sizes.grads,
                        held_grads=self.stack.grad_tokens if self.stack is not None else 0,
                        window_slots=sizes.window, held_window=self.stack.window_tokens if self.stack is not None else 0)
        self._last = (memory, sched, states)
        self.memory_plan = memory = self._with_kept_head(memory, sched, terms, weights is not None)
        return memory, sched, terms, states

    def _with_kept_head(self, memory: memory_policy.MemoryPlan, sched: Schedule, terms: LossTerms, training: bool
                        ) -> memory_policy.MemoryPlan:
        """``memory`` with the calls that keep their LM head's logits in one chunk, from these loss
        terms' rows per call (:func:`dtree.plan.head_keep.keep_head_logits`), in a training step whose
        chunk the user left to the policy and outside deterministic mode (the same kernels every step)."""
        if not training or self.config.logprob_chunk is not None or self.deterministic:
            return memory
        retain = memory.retain_budget(self.config.mode, self.config.retain_budget_tokens)
        return keep_head_logits(memory, sched, np.diff(terms.pred_offsets), retain)

    def _leaf_calls_can_window(self, view: ModelView) -> bool:
        """Whether this step's leaf calls may run in a KV window (with every layer checkpointed,
        or without grad): the backend allows it, the model's layers attend plainly (probed once
        per model state) and no fixed ``stack_capacity`` is asked for."""
        if self.config.stack_capacity is not None or not leaf_calls_can_window(self.attention, self.deterministic):
            return False
        key = model_state_key(view, self.placement, self.attention, self.recurrence)
        if key not in self._plain:
            self._plain[key] = attention_is_plain(self.model, self.spec, self.placement, self.attention, self.recurrence)
        return self._plain[key]

    def _stack_sizes(self, sched: Schedule, memory: memory_policy.MemoryPlan, training: bool) -> StackSizes:
        """The stacks of a step over ``sched`` with this backend: leaf calls in a window where
        they may run there and every layer is checkpointed (a training step) or none takes grad."""
        windowed = self._can_window and (not training or memory.checkpoint_layers >= self.spec.num_layers)
        return stack_sizes(sched, self.attention, self.deterministic, windowed)

    def make_plan(
        self, forest: Forest, weights: np.ndarray | None = None, field_names: Sequence[str] = (),
        same_schedule: bool = False, view: ModelView | None = None, releasing: float = 0.0,
    ) -> StepPlan:
        """The plan of a step over ``forest``: a training plan with its [N] ``weights`` and the
        loss's fields, else a log-prob plan (every prediction, no gradient slots); over the
        last plan's schedule when ``same_schedule`` (the two-pass path's second pass), else
        a new schedule. The step's arrays go to the device in one copy per kind; the stacks
        are the ones held when they fit, else new ones. ``view``: the model this call (its
        modules and parameters walked once, :func:`~dtree.plan.model_view.model_view`; walked
        here when None). ``releasing``: bytes allocated now that the step before this one frees
        before this one starts (:func:`plan_memory`)."""
        view = view or model_view(self.module)
        memory, sched, terms, states = self._plan_schedule(forest, weights, same_schedule, view, releasing)
        training, (device, dtype) = weights is not None, self.placement
        ints, floats = upload_arrays(
            [forest.tokens[sched.row_unique], forest.positions[sched.row_unique], terms.pred_hidden_row,
             terms.pred_unique, forest.tokens[terms.pred_unique], terms.loss_pred,
             np.array([g.stack_start for g in sched.groups])],
            ([weights[terms.loss_lin]] if training else []) + [forest.fields[n][terms.loss_lin] for n in field_names],
            device, compute_dtype(dtype),
        )
        w = floats.pop(0) if training else None
        arrays = StepArrays(*ints[:6], weights=w, fields=dict(zip(field_names, floats)), stack_starts=ints[6])
        sizes = self._stack_sizes(sched, memory, training)
        capacity = max(sizes.kv, self.config.stack_capacity or 0, 1)
        grad_tokens = capacity if self.config.stack_capacity else sizes.grads
        state_slots = states.capacity if states is not None else 0
        if self.stack is None or not self.stack.fits(
            self.spec, capacity, state_slots, dtype, device, training, grad_tokens=grad_tokens,
            window_tokens=sizes.window,
        ):
            self.stack = None  # free the old buffers before allocating new ones
            # Normal tensors even under torch.inference_mode(): an inference-mode stack, kept for
            # reuse, would make every later training step fail. Gradient slots in the compute dtype.
            with torch.inference_mode(False):
                self.stack = StepStacks(
                    self.spec, capacity, state_slots, dtype=dtype, device=device, with_grad=training,
                    grad_tokens=grad_tokens, window_tokens=sizes.window,
                )
        root = checkpoint_root(self.module, view) if training else None
        grads = getattr(self.model, "dtree_state_grads", None) if states is not None else None
        return StepPlan(
            forest=forest, memory=memory, sched=sched, terms=terms, arrays=arrays, stack=self.stack, states=states,
            retain_budget=memory.retain_budget(self.config.mode, self.config.retain_budget_tokens),
            mode=self.config.mode, model=self.model, head=as_output_head(self.model.dtree_output_layer()),
            attention=self.attention, recurrence=self.recurrence, logprob_chunk=self.logprob_chunk, device=device,
            dtype=dtype,
            # model calls may draw random numbers (dropout) when any module is in training mode
            randomness=view.training,
            checkpoint_root=root,
            checkpoint_layers=memory.checkpoint_layers if root is not None else 0,
            path_checkpoint_layers=max(0, memory.path_checkpoint_layers) if root is not None else 0,
            keep_attention_outputs=memory.keep_attention_outputs and root is not None,
            offload_checkpoints=memory.offload_checkpoints and root is not None,
            rerun_chunk_rows=memory_policy.rerun_chunk_rows(self.config.memory, self.config.rerun_chunk_rows),
            kept_head_rows=memory.kept_head_rows,
            progress=self.config.progress, deterministic=self.deterministic, kv_window=sizes.window > 0,
            state_grads=None if grads is None else grads(),  # custom modules: every read takes gradients
        )
