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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .memory_model import MemoryPlan, with_simulated_peak
from .schedule import Schedule

__all__ = ["keep_head_logits"]


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
    if (plan.call_bytes is None or plan.spec is None or math.isinf(plan.predicted_peak_bytes)
            or "kv_stack" not in plan.parts or plan.predicted_peak_bytes > plan.budget_bytes):
        return plan
    rows = [int(r) for r in rows]
    for threshold in sorted({r for r in rows if r > plan.logprob_chunk}, reverse=True):
        kept = with_simulated_peak(plan, sched, rows, retain_tokens, plan.parts["kv_stack"], threshold,
                                   f"calls of up to {threshold} loss rows keep their head's logits: ")
        if kept.predicted_peak_bytes <= plan.budget_bytes:
            return kept
    return plan
