"""TreeWalk: the depth-first walk over a step plan's groups, with a KV stack (and a
state stack for recurrent layers): the walk part of a step (check -> weights -> plan ->
walk -> finish; :mod:`dtree.plan.step_plan` builds the plan it reads).

The walk (docs/design.md section 4), over the groups of a :class:`~dtree.plan.schedule.Schedule`::

    forward(g):  zero g's gradient slots; run g's segments through the model; every
                 attention layer pushes g's K/V onto the stack, reads the ancestors'
                 K/V from it, and takes g's own K/V through ``seed_from_stack``;
                 compute g's loss terms (retain mode)
    ...          all child groups, depth first; their attention backward adds their
                 prefix gradients into g's slots
    backward(g): autograd.backward(loss_g), the LM head's part first
                 (:mod:`dtree.engine.head_first`), or g's final hidden states with a zero
                 gradient when g has no loss terms: at every layer the seed's
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
grad and only pushes K/V; backward(g) re-runs g with grad under the same RNG seed). A
group without children runs once, with grad, and backpropagates at once.

:meth:`TreeWalk.train` is the training walk, :meth:`TreeWalk.logprobs` the log-prob
walk (forward only). Both push only the groups that write the stack
(:attr:`dtree.plan.schedule.GroupPlan.writes_stack`), so the plan's stack holds the slots
written and no more.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from ..device import rng
from ..losses import TokenLoss, weighted_terms
from ..models.checkpointing import LayerCheckpointing
from ..ops.logprobs import compute_dtype, token_logprobs
from ..ops.stack_attention import SegmentLayout, prepare_stack_attention
from ..plan.loss_terms import prediction_lin
from ..plan.memory_model import call_head_chunk
from ..plan.schedule import FORWARD, Schedule
from ..plan.step_plan import StepPlan
from ..stacks.group_attention import GradPattern, GroupAttention
from .head_first import HeadSplit
from .step import StepOutput, TokenStep, WalkOutput, per_sequence

__all__ = ["PerToken", "TreeWalk", "train_step"]


@dataclass(frozen=True)
class PerToken:
    """What a step evaluates per loss term: ``fn(logp, fields)`` on the log-probs of
    ``softmax(logits / temperature)``, with ``fields["entropy"]`` when ``with_entropy``."""

    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
    temperature: float = 1.0
    with_entropy: bool = False


@dataclass
class _GroupState:
    """A group's graph between its forward and its backward: ``loss``, read from
    ``split``'s rows (:class:`~dtree.engine.head_first.HeadSplit`: the head's backward
    first, then the decoder's), or ``hidden`` (with a zero gradient) when the group has
    no loss terms but its K/V carry seeds."""

    loss: torch.Tensor | None
    hidden: torch.Tensor | None
    split: HeadSplit | None = None


def _group_layout(sched: Schedule, g: int) -> SegmentLayout:
    plan = sched.groups[g]
    return SegmentLayout(
        q_offsets=plan.seg_q_offsets,
        own_slot=plan.stack_start + plan.seg_q_offsets[:-1],
        prefix_ranges=plan.seg_prefix_ranges,
        call_slots=(plan.stack_start, plan.stack_start + plan.num_tokens) if plan.in_call_ancestors else None,
    )


class TreeWalk:
    """The depth-first walk over a :class:`~dtree.plan.step_plan.StepPlan`'s groups: the model's
    calls, their K/V (and states) through the plan's stacks, and the backward of each
    group (:meth:`train`), or its log-probs (:meth:`logprobs`). It reads the plan and
    changes nothing in it but the stacks' contents."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan
        self.sched = plan.sched
        self.grad_pattern = GradPattern(plan.stack.spec.num_layers)  # the same in every call of the step
        self._layer_checkpointing: LayerCheckpointing | None = None
        # each group's layout from its first forward (or its preparation) to its backward: its
        # backend tables are built once, also for a group that runs twice (recomputed)
        self._layouts: dict[int, SegmentLayout] = {}
        forwards = [g for kind, g in self.sched.events if kind == FORWARD]
        self._next_forward = dict(zip(forwards, forwards[1:]))  # group -> the group whose forward comes next

    def layout(self, g: int) -> SegmentLayout:
        """Group ``g``'s :class:`SegmentLayout`, the same object until :meth:`release`."""
        layout = self._layouts.get(g)
        if layout is None:
            layout = self._layouts[g] = _group_layout(self.sched, g)
        return layout

    def release(self, g: int) -> None:
        """Drop group ``g``'s layout and the tables cached on it (its backward has run)."""
        self._layouts.pop(g, None)

    def prepare(self, g: int) -> None:
        """Group ``g``'s attention tables built and uploaded now (:func:`prepare_stack_attention`),
        while the GPU runs the call before it, not at its first layer."""
        plan = self.plan
        prepare_stack_attention(self.layout(g), plan.attention, plan.device, plan.deterministic)

    def _prepare_after(self, g: int) -> None:
        """:meth:`prepare` the group whose forward comes after ``g``'s (none after the last)."""
        nxt = self._next_forward.get(g)
        if nxt is not None:
            self.prepare(nxt)

    def _checkpointing(self) -> LayerCheckpointing:
        """The step's checkpointed layer wrappers (built at the first call that checkpoints)."""
        if self._layer_checkpointing is None:
            self._layer_checkpointing = LayerCheckpointing(
                self.plan.checkpoint_root, self.plan.keep_attention_outputs, self.plan.offload_checkpoints,
                self.plan.rerun_chunk_rows)
        return self._layer_checkpointing

    def events(self):
        if not self.plan.progress:
            return self.sched.events
        from tqdm import tqdm

        return tqdm(self.sched.events, desc="dtree step", unit="event", leave=False)

    def hidden(self, g: int, push: bool, checkpoint: int = 0) -> torch.Tensor:
        """Run group ``g`` through the model, ``checkpoint`` of its decoder layers
        checkpointed when grad is on: its [T, hidden] final hidden states."""
        r0, r1 = int(self.sched.row_offsets[g]), int(self.sched.row_offsets[g + 1])
        group = self.sched.groups[g]
        lo, hi = group.stack_start, group.stack_start + group.num_tokens
        grad_seed = self.plan.stack.has_grad and group.writes_stack
        plan = self.plan
        checkpointed = plan.checkpoint_root is not None and checkpoint > 0 and torch.is_grad_enabled()
        # a leaf call's K/V serve one layer at a time when its layers re-run for their backward
        window = plan.kv_window and group.is_leaf and (checkpointed or not torch.is_grad_enabled())
        attend = GroupAttention(
            plan.stack, lo, hi, self.layout(g), plan.attention, push, grad_seed, self._device_lo(g),
            plan.deterministic, None if plan.states is None else plan.states.layouts[g], plan.recurrence,
            plan.state_grads, self.grad_pattern, window=window,
        )
        with self._checkpointing().applied(checkpoint) if checkpointed else contextlib.nullcontext():
            hidden = plan.model.dtree_hidden_states(plan.arrays.input_ids[r0:r1], plan.arrays.positions[r0:r1], attend)
        if push:
            attend.check_layers()
        return hidden

    def _device_lo(self, g: int) -> torch.Tensor | None:
        starts = self.plan.arrays.stack_starts
        return None if starts is None else starts[g : g + 1]

    def zero_grad(self, g: int) -> None:
        """Clear group ``g``'s gradient slots: its K/V tokens and its state slots."""
        group = self.sched.groups[g]
        s_lo = s_hi = 0
        if self.plan.states is not None:
            s_lo = int(self.plan.states.slot_start[g])
            s_hi = s_lo + int(self.plan.states.num_slots[g])
        self.plan.stack.zero_grad(
            group.stack_start, group.stack_start + group.num_tokens, s_lo, s_hi, device_lo=self._device_lo(g)
        )

    # ------------------------------------------------------------------ training
    def _group_loss(
        self, g: int, hidden: torch.Tensor, per_token: PerToken, term_log: list, backward_now: bool
    ) -> tuple[torch.Tensor, HeadSplit] | None:
        """(group ``g``'s loss, the split its backward runs through), or None without loss terms.
        ``backward_now``: its backward runs right after (not after its descendants'): the LM
        head may keep its logits until then, in one chunk of all its rows where the plan has
        room for them (:mod:`dtree.plan.head_keep`)."""
        terms, a = self.plan.terms, self.plan.arrays
        e0, e1 = int(terms.loss_offsets[g]), int(terms.loss_offsets[g + 1])
        if e1 == e0:
            return None
        p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
        chunk = call_head_chunk(self.plan.logprob_chunk, p1 - p0, self.plan.kept_head_rows, backward_now)
        split = HeadSplit(hidden, a.pred_hidden_row[p0:p1])
        weighted = weighted_terms(
            per_token.fn, split.head_in, None, a.labels[p0:p1], a.loss_pred[e0:e1], a.weights[e0:e1],
            {n: f[e0:e1] for n, f in a.fields.items()}, self.plan.head, chunk,
            temperature=per_token.temperature, with_entropy=per_token.with_entropy, keep_logits=backward_now,
        )
        term_log.append((e0, weighted.detach()))
        return weighted.sum(), split

    def _run_group(
        self, g: int, push: bool, rng_seed: int | None, per_token: PerToken, term_log: list, checkpoint: int,
        backward_now: bool,
    ) -> _GroupState:
        with torch.enable_grad(), rng.seeded(rng_seed, self.plan.device):
            hidden = self.hidden(g, push=push, checkpoint=checkpoint)
            with_loss = self._group_loss(g, hidden, per_token, term_log, backward_now)
        if with_loss is not None:
            loss, split = with_loss
            return _GroupState(loss=loss, hidden=None, split=split)
        # without loss terms, a group's backward only carries its descendants' seeds
        keep_hidden = not self.sched.groups[g].is_leaf and hidden.requires_grad
        return _GroupState(loss=None, hidden=hidden if keep_hidden else None)

    def train(self, per_token: PerToken, scope: Callable | None = None) -> WalkOutput:
        """Forward and backward of every group, depth first; gradients land in the
        model's parameters. Groups with children are retained while their tokens fit
        the plan's ``retain_budget``, else recomputed. ``scope``: a context manager kept open for the
        whole walk (the model adapter's attention scope: HF gradient checkpointing
        re-runs layers inside backward, after the model call has returned)."""
        rng_seeds: dict[int, int | None] = {}  # the RNG seed of each group to recompute
        live: dict[int, _GroupState] = {}
        term_log: list[tuple[int, torch.Tensor]] = []
        total = torch.zeros((), dtype=compute_dtype(self.plan.dtype), device=self.plan.device)
        calls = live_tokens = peak = recomputed = 0

        def run(g: int, push: bool, rng_seed: int | None, checkpoint: int, backward_now: bool) -> _GroupState:
            state = self._run_group(g, push, rng_seed, per_token, term_log, checkpoint, backward_now)
            self._prepare_after(g)  # its kernels are queued: the next call's tables now, not at its first layer
            return state

        with scope() if scope is not None else contextlib.nullcontext():
            for kind, g in self.events():
                group = self.sched.groups[g]
                if kind == FORWARD:
                    calls += 1
                    rng_seed = rng.next_seed() if self.plan.randomness else None  # one draw per group in every mode
                    if group.is_leaf:  # once, with grad, and backward at once
                        if group.in_call_ancestors:  # its segments read each other through the stack
                            self.zero_grad(g)
                        state = run(g, push=group.in_call_ancestors, rng_seed=rng_seed,
                                    checkpoint=self.plan.checkpoint_layers, backward_now=True)
                        peak = max(peak, live_tokens + group.num_tokens)
                        total = _finish_group(state, total)
                        self.release(g)
                    elif live_tokens + group.num_tokens <= self.plan.retain_budget:
                        self.zero_grad(g)
                        live[g] = run(g, push=True, rng_seed=rng_seed, checkpoint=self.plan.path_checkpoint_layers,
                                      backward_now=False)
                        live_tokens += group.num_tokens
                        peak = max(peak, live_tokens)
                    else:
                        self.zero_grad(g)
                        rng_seeds[g] = rng_seed
                        with torch.no_grad(), rng.seeded(rng_seed, self.plan.device):
                            self.hidden(g, push=True)
                        self._prepare_after(g)
                    continue
                if group.is_leaf:
                    continue
                if g in live:
                    state = live.pop(g)
                    live_tokens -= group.num_tokens
                else:
                    calls += 1
                    recomputed += group.num_tokens
                    # K/V are on the stack already and its slots hold the descendants'
                    # gradients: no push, no zeroing. The RNG seed replays the forward's dropout
                    # masks, so the graph is of those K/V.
                    seed = rng_seeds.pop(g)
                    state = self._run_group(g, False, seed, per_token, term_log, self.plan.checkpoint_layers,
                                            backward_now=True)
                    peak = max(peak, live_tokens + group.num_tokens)
                total = _finish_group(state, total)
                self.release(g)
        plan = self.plan
        metrics = {
            "mode": plan.mode, "attention": plan.attention, "recurrence": plan.recurrence,
            "groups": self.sched.num_groups, "group_tokens": self.sched.group_tokens,
            "recomputed_tokens": recomputed, "kv_window": plan.kv_window, "rerun_chunk_rows": plan.rerun_chunk_rows,
            "memory_plan": plan.memory.describe(),
        }
        return WalkOutput(total, term_log, calls, peak, self.sched.stack_tokens, metrics)

    # ------------------------------------------------------------------ inference
    def logprobs(
        self, temperature: float, with_entropy: bool, rewind_rng: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Forward only, every prediction of the plan's terms: per sequence, [len-1]
        ``log p(s[t] | s[:t])`` under ``softmax(logits / temperature)``, and (when
        ``with_entropy``, else None) the entropies of those distributions.
        ``rewind_rng``: leave the random generators as they were before the walk, so that a
        training walk of the same schedule draws what this one drew (the two-pass path)."""
        with rng.rewound(self.plan.device) if rewind_rng else contextlib.nullcontext():
            return self._logprobs(temperature, with_entropy)

    def _logprobs(self, temperature: float, with_entropy: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        cdt = compute_dtype(self.plan.dtype)
        lp_unique = torch.full((self.plan.forest.num_unique_tokens,), float("nan"), dtype=cdt, device=self.plan.device)
        ent_unique = torch.full_like(lp_unique, float("nan")) if with_entropy else None
        a, terms = self.plan.arrays, self.plan.terms
        for kind, g in self.events():
            if kind != FORWARD:
                continue
            with rng.seeded(rng.next_seed() if self.plan.randomness else None, self.plan.device):
                # a leaf group's K/V are read by nothing after it: no stack slots
                hidden = self.hidden(g, push=self.sched.groups[g].writes_stack)
                self.release(g)
                self._prepare_after(g)
                p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
                if p1 > p0:
                    lp, ent = token_logprobs(
                        hidden[a.pred_hidden_row[p0:p1]], self.plan.head, a.labels[p0:p1], self.plan.logprob_chunk,
                        temperature=temperature, with_entropy=with_entropy,
                    )
                    lp_unique[a.pred_unique[p0:p1]] = lp
                    if with_entropy:
                        ent_unique[a.pred_unique[p0:p1]] = ent
        # per unique token u: log p(u | its prefix), NaN where u is never predicted (the roots)
        forest = self.plan.forest
        targets = forest.lin_unique[prediction_lin(forest)]
        lps = per_sequence(forest, lp_unique, targets, self.plan.device)
        return lps, (per_sequence(forest, ent_unique, targets, self.plan.device) if with_entropy else None)


def _finish_group(state: _GroupState, total: torch.Tensor) -> torch.Tensor:
    """Backward of one group (see the module docstring); returns the running loss sum."""
    if state.loss is not None:
        total = total + state.loss.detach()
        state.split.backward(state.loss)
    elif state.hidden is not None:
        state.hidden.backward(torch.zeros_like(state.hidden))
    return total


def train_step(
    plan: StepPlan, loss: TokenLoss, parameters: Iterable[torch.nn.Parameter], scope: Callable | None = None,
    return_logprobs: bool = False, pause_gc: bool = True, grad_guard: bool | str = True,
    before_sync: Callable[[float], None] | None = None, weight_grads_in_matmul: bool = True,
) -> StepOutput:
    """The training walk of ``plan`` for ``loss`` between the two ends of a step
    (:class:`dtree.engine.step.TokenStep`: ``param.grad`` kept aside until it succeeds when
    ``grad_guard``, the garbage collector paused when ``pause_gc``, one device sync at the
    end). ``scope``: the
    model adapter's attention scope (:meth:`TreeWalk.train`). ``before_sync(releasing)`` runs once
    every kernel of the step is queued, before its sync (the GPU still busy), with the bytes the
    step frees when it succeeds (:mod:`dtree.engine.micro_batches` prepares the next step there).
    ``weight_grads_in_matmul``: :class:`TokenStep`'s."""
    with TokenStep(parameters, plan.forest, loss, plan.terms.loss_lin, plan.device, plan.dtype, return_logprobs,
                   pause_gc=pause_gc, grad_guard=grad_guard, weight_grads_in_matmul=weight_grads_in_matmul) as step:
        per_token = PerToken(step.per_token, loss.temperature, loss.needs_entropy)
        walked = TreeWalk(plan).train(per_token, scope)
        if before_sync is not None:
            before_sync(step.releasing_bytes())
        return step.finish(walked)
