"""Which calls run their LM head in one chunk and keep its logits for the backward.

The fused head (:mod:`dtree.ops.logprobs`) makes a call's ``[rows, V]`` logits in its forward
and, over more rows than one chunk, again in its backward: that recompute is what keeps the
head's memory at one ``[chunk, V]`` buffer. A call whose backward follows its forward at once
(a leaf call, a recomputed group's re-run: the walk's ``backward_now``) can instead run all its
rows as one chunk and keep the forward's buffer (``token_logprobs(keep_logits=True)``): the same
gradients, one ``[rows, H] x [H, V]`` product and the float32 sums over vocabulary slices fewer, for
``(rows - chunk) x V`` more bytes at its backward's peak. On the 64k agentic tree's default plan
(~22k loss rows a call) that was 1.422 against 1.451 s of kernels for 3.8 GiB more (session AP,
``benchmarks/PERF_NOTES.md``).

Since it only removes work, the step takes it wherever the memory is there: after the schedule
is known, :func:`keep_head_logits` gives the refined plan the largest row threshold whose
simulated peak (:func:`dtree.plan.memory_model.simulate_peak`, each call with its own loss rows)
still fits the plan's budget. The walk then runs a ``backward_now`` call of ``rows`` loss rows,
``logprob_chunk < rows <= kept_head_rows``, in one chunk (:meth:`dtree.engine.walk.TreeWalk._group_loss`).

A threshold changes only the head chunk of the calls it takes in, and each call's backward peak depends
on its own chunk alone, so one walk (:func:`dtree.plan.memory_model.peak_visits`) prices every threshold:
each visit's peak with and without its logits kept, then the step's peak at each threshold from a prefix
and a suffix maximum. Trying the thresholds largest first with a simulation each
(:func:`keep_head_logits_reference`, the same answer) takes O(calls x thresholds) where the largest does not
fit: on a 1.4M-token GRPO batch of 178 calls under ``memory="low"`` (a ~150 ms plan on the development CPU),
110 simulations and 56-97 ms against 1.4-3.6 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .memory_model import MemoryPlan, peak_visits, plan_walk, with_simulated_peak
from .schedule import Schedule

__all__ = ["keep_head_logits", "keep_head_logits_reference", "threshold_peaks"]


def keep_head_logits(plan: MemoryPlan, sched: Schedule, rows: Sequence[int], retain_tokens: float) -> MemoryPlan:
    """``plan`` (refined: :func:`dtree.plan.memory_model.refine`) with the most loss rows a call
    may keep its head's logits for (:attr:`MemoryPlan.kept_head_rows`) and the peak predicted with
    them: the largest of the calls' row counts over ``plan.logprob_chunk`` whose simulated peak fits
    ``plan.budget_bytes``, else ``plan`` as it is (a plan without figures, one over its budget, or
    one whose calls all fit a chunk).

    Args:
        rows: [G] the loss rows of each group of ``sched`` (the predictions its loss terms read): the
            rows the walk runs, so each call's decision is the simulated one (a second pass over the same
            schedule, with other terms, decides again: ``StepPlanner._with_kept_head``).
        retain_tokens: tokens of groups with children the walk retains (as :func:`refine` got).
    """
    if not _can_keep(plan):
        return plan
    rows = [int(r) for r in rows]
    thresholds = sorted({r for r in rows if r > plan.logprob_chunk}, reverse=True)
    if not thresholds:
        return plan
    kept = _kept(plan, sched, rows, retain_tokens, thresholds[0])  # the usual answer, one simulation
    if kept.predicted_peak_bytes <= plan.budget_bytes:
        return kept
    # the simulated total adds the same terms in another order: a threshold within rounding is simulated
    near = plan.budget_bytes * (1 + 1e-9) - plan.parts["kv_stack"]
    for threshold, peak in zip(thresholds[1:], threshold_peaks(plan, sched, rows, retain_tokens, thresholds[1:])):
        if peak > near:
            continue
        kept = _kept(plan, sched, rows, retain_tokens, threshold)
        if kept.predicted_peak_bytes <= plan.budget_bytes:
            return kept
    return plan


def threshold_peaks(plan: MemoryPlan, sched: Schedule, rows: list[int], retain_tokens: float,
                    thresholds: Sequence[int]) -> np.ndarray:
    """[len(thresholds)] :func:`dtree.plan.memory_model.simulate_peak`'s peak (the stacks' growth left out) with
    each threshold as ``kept_head_rows``, from one walk: a visit whose backward follows its forward and whose
    rows are over the chunk takes its rows as its chunk where they are at most the threshold."""
    fig, path = plan_walk(plan)
    grads = plan.step_grad_bytes
    fixed, over_rows, in_chunks, in_one = 0.0, [], [], []
    for v in peak_visits(sched, retain_tokens, plan.checkpoint_layers, path, fig, grads):
        r = rows[v.group]
        as_planned = v.peak(fig, r, grads, fig.chunk)[0]
        if v.backward_now and r > fig.chunk:
            over_rows.append(r)
            in_chunks.append(as_planned)
            in_one.append(v.peak(fig, r, grads, r)[0])
        else:
            fixed = max(fixed, as_planned)
    order = np.argsort(over_rows, kind="stable")
    by_rows = np.asarray(over_rows, dtype=np.int64)[order]
    # visits [0, i) of by_rows keep their logits, [i, n) run in chunks
    keeping = np.maximum.accumulate(np.concatenate([[0.0], np.asarray(in_one, dtype=float)[order]]))
    chunking = np.concatenate([np.maximum.accumulate(np.asarray(in_chunks, dtype=float)[order][::-1])[::-1], [0.0]])
    i = np.searchsorted(by_rows, np.asarray(thresholds, dtype=np.int64), side="right")
    return np.maximum(fixed, np.maximum(keeping[i], chunking[i]))


def keep_head_logits_reference(plan: MemoryPlan, sched: Schedule, rows: Sequence[int],
                               retain_tokens: float) -> MemoryPlan:
    """:func:`keep_head_logits` by its definition: each threshold, largest first, simulated until one fits."""
    if not _can_keep(plan):
        return plan
    rows = [int(r) for r in rows]
    for threshold in sorted({r for r in rows if r > plan.logprob_chunk}, reverse=True):
        kept = _kept(plan, sched, rows, retain_tokens, threshold)
        if kept.predicted_peak_bytes <= plan.budget_bytes:
            return kept
    return plan


def _can_keep(plan: MemoryPlan) -> bool:
    """Whether the plan has the figures to price kept logits and fits its budget as it is."""
    return not (plan.call_bytes is None or plan.spec is None or math.isinf(plan.predicted_peak_bytes)
                or "kv_stack" not in plan.parts or plan.predicted_peak_bytes > plan.budget_bytes)


def _kept(plan: MemoryPlan, sched: Schedule, rows: list[int], retain_tokens: float, threshold: int) -> MemoryPlan:
    return with_simulated_peak(plan, sched, rows, retain_tokens, plan.parts["kv_stack"], threshold,
                               f"calls of up to {threshold} loss rows keep their head's logits: ")
