"""StepWalk: one step's depth-first walk over a schedule's groups, with a KV stack (and a
state stack for recurrent layers).

The walk (docs/design.md section 4), over the groups of a :class:`~dtree.schedule.Schedule`::

    forward(g):  zero g's gradient slots; run g's segments through the model; every
                 attention layer pushes g's K/V onto the stack, reads the ancestors'
                 K/V from it, and takes g's own K/V through ``seed_from_stack``;
                 compute g's loss terms (retain mode)
    ...          all child groups, depth first; their attention backward adds their
                 prefix gradients into g's slots
    backward(g): autograd.backward(loss_g)  (or g's final hidden states with a zero
                 gradient when g has no loss terms): at every layer the seed's
                 backward adds g's slots (the descendants' gradients, and the ones g's
                 own segments sent their in-call ancestors) to dK_g, dV_g where the
                 attention consumed them, and g's attention backward adds its prefix
                 gradients into the ancestors' slots, complete when they pop

Recurrent layers do the same with their states (:mod:`dtree.ops.segment_states`):
forward(g) stores the final states of g's segments with children in later groups in
g's state slots and reads its segments' initial states from the ancestors' slots;
backward(g) seeds those final states with the gradients the children left in g's
slots, and the reads add g's own initial-state gradients into the ancestors' slots.

A group with children is retained (its graph lives from forward(g) to backward(g))
while the retained tokens fit the budget, else recomputed (forward(g) runs without
grad and only pushes K/V; backward(g) re-runs g with grad under the same seed). A
group without children runs once, with grad, and backpropagates at once.

:meth:`StepWalk.train` is the training walk, :meth:`StepWalk.logprobs` the inference
walk (forward only). :class:`StepArrays` holds every per-step array they slice, moved
to the device once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import rng
from .checkpointing import checkpointed_layers
from .losses import weighted_terms
from .models import TreeModule
from .ops.logprobs import OutputHead, compute_dtype, token_logprobs
from .ops.segment_states import LayerStates, StateLayout
from .ops.stack_attention import AttentionOptions, SegmentLayout, StackSlots, seed_from_stack, stack_attention
from .schedule import FORWARD, LossTerms, Schedule
from .stacks import StepStacks
from .state_plan import StatePlan
from .transfer import upload
from .tree import Forest

__all__ = ["PerToken", "StepArrays", "StepWalk", "WalkResult"]


@dataclass(frozen=True)
class PerToken:
    """What a step evaluates per loss term: ``fn(logp, fields)`` on the log-probs of
    ``softmax(logits / temperature)``, with ``fields["entropy"]`` when ``with_entropy``."""

    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
    temperature: float = 1.0
    with_entropy: bool = False


@dataclass(frozen=True)
class StepArrays:
    """Every per-step array the walk slices, on the device (int64 unless noted).

    Attributes:
        input_ids, positions: [U] token id and position of every row, group after group.
        pred_hidden_row: [P] row (local to its group) whose hidden state predicts.
        pred_unique: [P] unique token each prediction predicts.
        labels: [P] its token id.
        loss_pred: [E] index (local to its group's predictions) of each term's log-prob.
        weights: [E] compute-dtype weight of each loss term (None in an inference walk).
        fields: name -> [E] compute-dtype per-token field of each loss term.
        stack_starts: [G] first stack slot of each group: the device-side slot offsets
            the KV stack's CUDA ops read (:mod:`dtree.ops.stack_ops`), one upload per step.
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

    @classmethod
    def upload(
        cls,
        forest: Forest,
        sched: Schedule,
        terms: LossTerms,
        weights: np.ndarray | None,
        field_names: Sequence[str],
        device: torch.device,
        dtype: torch.dtype,
    ) -> "StepArrays":
        """``weights``: [N] per linearized token (None: an inference walk, no terms)."""

        def ints(a: np.ndarray) -> torch.Tensor:
            return upload(a.astype(np.int64, copy=False), device)

        cdt = compute_dtype(dtype)
        return cls(
            input_ids=ints(forest.tokens[sched.row_unique]),
            positions=ints(forest.positions[sched.row_unique]),
            pred_hidden_row=ints(terms.pred_hidden_row),
            pred_unique=ints(terms.pred_unique),
            labels=ints(forest.tokens[terms.pred_unique]),
            loss_pred=ints(terms.loss_pred),
            weights=None if weights is None else upload(weights[terms.loss_lin], device, cdt),
            fields={n: upload(forest.fields[n][terms.loss_lin], device, cdt) for n in field_names},
            stack_starts=ints(np.array([plan.stack_start for plan in sched.groups])),
        )


def check_grad_pattern(pattern: tuple, expected: list) -> None:
    """Every group of a step must have the same layers whose K/V need grad.

    A group's K/V at layer l need grad when a trainable parameter feeds them. For a
    dense model that holds for all groups alike. If it held for an ancestor but not
    for a descendant (trainable parts that only some tokens reach, e.g. some MoE
    experts), the descendant's attention would have no backward and send the ancestor
    no gradient: refuse rather than be silently wrong. ``pattern``: per layer,
    (k.requires_grad, v.requires_grad) as the group's call saw them with grad on (None
    where it did not); ``expected`` is empty before the step's first group, then holds
    its pattern."""
    if not expected:
        expected.append(pattern)
    elif pattern != expected[0]:
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
    their state slots. ``seed``: pass the call's K/V through :func:`seed_from_stack`
    (groups whose slots collect gradients: groups with children, and calls with
    in-call ancestors). ``device_lo``: ``lo`` on the device, for the stack's CUDA ops.
    ``deterministic``: the attention's backward sums in a fixed order
    (:mod:`dtree.ops.determinism`). Recurrent layers get their :class:`LayerStates` from
    :meth:`states` (``state_layout``: the call's segments' state slots)."""

    def __init__(
        self,
        stacks: StepStacks,
        lo: int,
        hi: int,
        layout: SegmentLayout,
        backend: str,
        push: bool,
        seed: bool,
        device_lo: torch.Tensor | None = None,
        deterministic: bool = False,
        state_layout: StateLayout | None = None,
        recurrence: str | None = None,
        state_grads: tuple[bool, ...] | None = None,
    ):
        self.stacks, self.lo, self.hi, self.layout, self.backend = stacks, lo, hi, layout, backend
        self.push, self.seed, self.device_lo, self.deterministic = push, seed, device_lo, deterministic
        self.state_layout, self.recurrence, self.state_grads = state_layout, recurrence, state_grads
        num_layers = stacks.spec.num_layers
        self.called = [False] * num_layers
        self.recurred = [False] * num_layers
        self.pattern: list[tuple[bool, bool] | None] = [None] * num_layers

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **options
    ) -> torch.Tensor:
        """``options``: the per-layer ``softcap``, ``sinks``, ``alibi_slopes``, ``window``
        of :func:`dtree.ops.stack_attention.stack_attention`."""
        self.called[layer] = True
        stack, local = self.stacks.kv_of(layer)
        if self.push:
            stack.store_kv(local, self.lo, k.detach(), v.detach(), device_lo=self.device_lo)
        if torch.is_grad_enabled():
            self.pattern[layer] = (k.requires_grad, v.requires_grad)
            if self.seed:
                k, v = seed_from_stack(k, v, stack, local, self.lo, self.hi, device_lo=self.device_lo)
        options = AttentionOptions(scale=scale, deterministic=self.deterministic, **options)
        return stack_attention(q, k, v, StackSlots(stack, local, self.layout), options, self.backend)

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


@dataclass
class _GroupState:
    """A group's graph between its forward and its backward: the backward's root is
    ``loss``, or ``hidden`` (with a zero gradient) when the group has no loss terms but
    its K/V carry seeds."""

    loss: torch.Tensor | None
    hidden: torch.Tensor | None
    pattern: tuple


@dataclass
class WalkResult:
    """What :meth:`StepWalk.train` leaves besides the gradients.

    ``total``: 0-d device sum of the loss terms (not synced); ``term_log``: per call
    with terms, (offset into ``terms.loss_lin``, [E_call] detached weighted terms)."""

    total: torch.Tensor
    term_log: list[tuple[int, torch.Tensor]]
    num_model_calls: int
    peak_graph_tokens: int
    recomputed_tokens: int


def _group_layout(sched: Schedule, g: int) -> SegmentLayout:
    plan = sched.groups[g]
    return SegmentLayout(
        q_offsets=plan.seg_q_offsets,
        own_slot=plan.stack_start + plan.seg_q_offsets[:-1],
        prefix_ranges=plan.seg_prefix_ranges,
        call_slots=(plan.stack_start, plan.stack_start + plan.num_tokens) if plan.in_call_ancestors else None,
    )


@dataclass
class StepWalk:
    """One step over ``sched``: the model, its stack and the step's device arrays.

    ``checkpoint_root``: the module whose decoder layers run under
    :func:`dtree.checkpointing.checkpointed_layers` in calls with grad (None: no
    layer checkpointing): ``checkpoint_layers`` of them in the calls of groups without
    children and in recomputed groups' re-runs, ``path_checkpoint_layers`` in retained
    groups with children (the memory plan's counts). ``randomness``: every group runs
    under its own seed (a module is in training mode, see :mod:`dtree.rng`)."""

    model: TreeModule
    sched: Schedule
    terms: LossTerms
    arrays: StepArrays
    stack: StepStacks
    head: OutputHead
    attention: str
    logprob_chunk: int
    device: torch.device
    dtype: torch.dtype
    randomness: bool
    checkpoint_root: torch.nn.Module | None = None
    checkpoint_layers: int = 0
    path_checkpoint_layers: int = 0
    progress: bool = False
    deterministic: bool = False
    states: StatePlan | None = None  # the state slots, for models with recurrent layers
    recurrence: str | None = None  # their linear_recurrence backend
    state_grads: tuple[bool, ...] | None = None  # per layer: its states' stack reads take gradients

    def events(self):
        if not self.progress:
            return self.sched.events
        from tqdm import tqdm

        return tqdm(self.sched.events, desc="dtree step", unit="event", leave=False)

    def hidden(self, g: int, push: bool, checkpoint: int = 0) -> tuple[torch.Tensor, GroupAttention]:
        """Run group ``g`` through the model, ``checkpoint`` of its decoder layers
        checkpointed when grad is on: ([T, hidden] final hidden states, its attend)."""
        r0, r1 = int(self.sched.row_offsets[g]), int(self.sched.row_offsets[g + 1])
        plan = self.sched.groups[g]
        lo, hi = plan.stack_start, plan.stack_start + plan.num_tokens
        seed = self.stack.has_grad and plan.writes_stack
        attend = GroupAttention(
            self.stack, lo, hi, _group_layout(self.sched, g), self.attention, push, seed, self._device_lo(g),
            self.deterministic, None if self.states is None else self.states.layouts[g], self.recurrence,
            self.state_grads,
        )
        checkpointed = self.checkpoint_root is not None and checkpoint > 0 and torch.is_grad_enabled()
        with checkpointed_layers(self.checkpoint_root, checkpoint) if checkpointed else contextlib.nullcontext():
            hidden = self.model.dtree_hidden_states(self.arrays.input_ids[r0:r1], self.arrays.positions[r0:r1], attend)
        if push:
            attend.check_layers()
        return hidden, attend

    def _device_lo(self, g: int) -> torch.Tensor | None:
        starts = self.arrays.stack_starts
        return None if starts is None else starts[g : g + 1]

    def zero_grad(self, g: int) -> None:
        """Clear group ``g``'s gradient slots: its K/V tokens and its state slots."""
        plan = self.sched.groups[g]
        s_lo = s_hi = 0
        if self.states is not None:
            s_lo = int(self.states.slot_start[g])
            s_hi = s_lo + int(self.states.num_slots[g])
        self.stack.zero_grad(
            plan.stack_start, plan.stack_start + plan.num_tokens, s_lo, s_hi, device_lo=self._device_lo(g)
        )

    # ------------------------------------------------------------------ training
    def _group_loss(self, g: int, hidden: torch.Tensor, per_token: PerToken, term_log: list) -> torch.Tensor | None:
        terms, a = self.terms, self.arrays
        e0, e1 = int(terms.loss_offsets[g]), int(terms.loss_offsets[g + 1])
        if e1 == e0:
            return None
        p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
        weighted = weighted_terms(
            per_token.fn, hidden, a.pred_hidden_row[p0:p1], a.labels[p0:p1], a.loss_pred[e0:e1], a.weights[e0:e1],
            {n: f[e0:e1] for n, f in a.fields.items()}, self.head, self.logprob_chunk,
            temperature=per_token.temperature, with_entropy=per_token.with_entropy,
        )
        term_log.append((e0, weighted.detach()))
        return weighted.sum()

    def _run_group(
        self, g: int, push: bool, seed: int | None, per_token: PerToken, term_log: list, checkpoint: int
    ) -> _GroupState:
        with torch.enable_grad(), rng.seeded(seed, self.device):
            hidden, attend = self.hidden(g, push=push, checkpoint=checkpoint)
            loss = self._group_loss(g, hidden, per_token, term_log)
        # without loss terms, a group's backward only carries its descendants' seeds
        keep_hidden = loss is None and not self.sched.groups[g].is_leaf and hidden.requires_grad
        return _GroupState(loss=loss, hidden=hidden if keep_hidden else None, pattern=tuple(attend.pattern))

    def train(self, per_token: PerToken, retain_budget: float, scope: Callable | None = None) -> WalkResult:
        """Forward and backward of every group, depth first; gradients land in the
        model's parameters. ``retain_budget``: tokens of groups with children whose
        graphs may be alive at once. ``scope``: a context manager kept open for the
        whole walk (the model adapter's attention scope: HF gradient checkpointing
        re-runs layers inside backward, after the model call has returned)."""
        seeds: dict[int, int | None] = {}  # the seed of each group to recompute
        pattern: list = []  # which layers' K/V need grad, as seen in the step's first group
        live: dict[int, _GroupState] = {}
        term_log: list[tuple[int, torch.Tensor]] = []
        total = torch.zeros((), dtype=compute_dtype(self.dtype), device=self.device)
        calls = live_tokens = peak = recomputed = 0

        def run(g: int, push: bool, seed: int | None, checkpoint: int) -> _GroupState:
            state = self._run_group(g, push, seed, per_token, term_log, checkpoint)
            check_grad_pattern(state.pattern, pattern)
            return state

        with scope() if scope is not None else contextlib.nullcontext():
            for kind, g in self.events():
                plan = self.sched.groups[g]
                if kind == FORWARD:
                    calls += 1
                    seed = rng.next_seed() if self.randomness else None  # one draw per group in every mode
                    if plan.is_leaf:  # once, with grad, and backward at once
                        if plan.in_call_ancestors:  # its segments read each other through the stack
                            self.zero_grad(g)
                        state = run(g, push=plan.in_call_ancestors, seed=seed, checkpoint=self.checkpoint_layers)
                        peak = max(peak, live_tokens + plan.num_tokens)
                        total = _finish_group(state, total)
                    elif live_tokens + plan.num_tokens <= retain_budget:
                        self.zero_grad(g)
                        live[g] = run(g, push=True, seed=seed, checkpoint=self.path_checkpoint_layers)
                        live_tokens += plan.num_tokens
                        peak = max(peak, live_tokens)
                    else:
                        self.zero_grad(g)
                        seeds[g] = seed
                        with torch.no_grad(), rng.seeded(seed, self.device):
                            self.hidden(g, push=True)
                    continue
                if plan.is_leaf:
                    continue
                if g in live:
                    state = live.pop(g)
                    live_tokens -= plan.num_tokens
                else:
                    calls += 1
                    recomputed += plan.num_tokens
                    # K/V are on the stack already and its slots hold the descendants'
                    # gradients: no push, no zeroing. The seed replays the forward's dropout
                    # masks, so the graph is of those K/V.
                    state = run(g, push=False, seed=seeds.pop(g), checkpoint=self.checkpoint_layers)
                    peak = max(peak, live_tokens + plan.num_tokens)
                total = _finish_group(state, total)
        return WalkResult(total, term_log, calls, peak, recomputed)

    # ------------------------------------------------------------------ inference
    def logprobs(
        self, num_unique: int, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward only, every prediction of ``terms``: per unique token u, [U] ``log p(u
        | its prefix)`` and (when ``with_entropy``, else None) [U] the entropy of that
        distribution; NaN where u is never predicted (the roots)."""
        cdt = compute_dtype(self.dtype)
        lp_unique = torch.full((num_unique,), float("nan"), dtype=cdt, device=self.device)
        ent_unique = torch.full_like(lp_unique, float("nan")) if with_entropy else None
        a, terms = self.arrays, self.terms
        for kind, g in self.events():
            if kind != FORWARD:
                continue
            with rng.seeded(rng.next_seed() if self.randomness else None, self.device):
                # a leaf group's K/V are read by nothing after it: no stack slots
                hidden, _ = self.hidden(g, push=self.sched.groups[g].writes_stack)
                p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
                if p1 > p0:
                    lp, ent = token_logprobs(
                        hidden[a.pred_hidden_row[p0:p1]], self.head, a.labels[p0:p1], self.logprob_chunk,
                        temperature=temperature, with_entropy=with_entropy,
                    )
                    lp_unique[a.pred_unique[p0:p1]] = lp
                    if with_entropy:
                        ent_unique[a.pred_unique[p0:p1]] = ent
        return lp_unique, ent_unique


def _finish_group(state: _GroupState, total: torch.Tensor) -> torch.Tensor:
    """Backward of one group (see the module docstring); returns the running loss sum."""
    if state.loss is not None:
        total = total + state.loss.detach()
        if state.loss.requires_grad:
            state.loss.backward()
    elif state.hidden is not None:
        state.hidden.backward(torch.zeros_like(state.hidden))
    return total
