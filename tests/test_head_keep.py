"""Calls that run their LM head in one chunk and keep its logits (``dtree.plan.head_keep``): the
threshold the plan takes under its budget, the peak it predicts with it, and the walk that runs
it, exact against HF per path."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
from hf_models import make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import grad_errors, path_logprobs
from setups import FP32_TOL, assert_exact, reference, run_dtree
from strategies import sequence_batches

import dtree
from dtree.engine import walk as walk_module
from dtree.models import ModelSpec
from dtree.plan import memory_model as mm
from dtree.plan import step_plan
from dtree.plan.head_keep import keep_head_logits, keep_head_logits_reference, threshold_peaks
from dtree.plan.memory_probe import CallBytes
from dtree.plan.schedule import FORWARD, build_schedule

# a head much larger than the layers, so that the head's chunk sets the peak
SPEC = ModelSpec(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=100_000)
CB = CallBytes(64.0, 16.0, 2, 8.0)
CHUNK = 4


def _plan(sched, retain_tokens: float, budget: float = math.inf) -> mm.MemoryPlan:
    plan = mm.MemoryPlan(
        group_tokens=sched.group_tokens, checkpoint_layers=0, logprob_chunk=CHUNK, retain_bytes=math.inf,
        retained_bytes_per_token=0.0, predicted_peak_bytes=0.0, predicted_cost=0.0, budget_bytes=budget,
        setting="auto", call_bytes=CB, fused_head=True, spec=SPEC, itemsize=2,
    )
    return mm.refine(plan, sched, retain_tokens, (0, 0), 0, stack_slots=0, grad_slots=0)


def _expected_peak(sched, rows, threshold: int, retained: bool) -> float:
    """The step's peak written out for a schedule without checkpointing or gradients: the largest
    call's activations plus the larger of its head (one chunk of its rows where it keeps them) and
    its layers' backward, on top of the retained groups' graphs where they are alive."""
    best, alive = 0.0, 0.0
    for kind, g in sched.events:
        group = sched.groups[g]
        n, r = group.num_tokens, rows[g]
        backward_now = group.is_leaf or not retained
        if kind == FORWARD and not group.is_leaf and retained:
            alive += n * CB.call(0)
        if (kind == FORWARD) != group.is_leaf:  # a leaf's backward follows its forward; others at the exit
            continue
        if not group.is_leaf and retained:
            alive -= n * CB.call(0)
        chunk = r if backward_now and CHUNK < r <= threshold else CHUNK
        head = mm.head_bytes(SPEC, 2, chunk, r, True)
        best = max(best, alive + n * CB.call(0) + max(head, n * CB.backward(0)))
    return best


def _forest():
    """A 40-token trunk with branches of 6, 12, 20 and 30 tokens: the trunk one call with children,
    the branches leaf calls of different sizes."""
    trunk = list(range(1, 41))
    return dtree.Forest.from_sequences([trunk + list(range(100 + 50 * b, 100 + 50 * b + n))
                                        for b, n in enumerate((6, 12, 20, 30))])


@pytest.mark.parametrize("retained", [True, False])
def test_the_largest_threshold_that_fits_is_taken(retained):
    sched = build_schedule(_forest(), 64, 40)
    rows = np.diff(sched.predictions.pred_offsets).tolist()
    assert len(sched.groups) >= 3 and any(not g.is_leaf for g in sched.groups)
    retain = math.inf if retained else 0.0
    base = _plan(sched, retain)
    assert base.kept_head_rows == 0 and base.predicted_peak_bytes == pytest.approx(_expected_peak(sched, rows, 0, retained))
    over = sorted({r for r in rows if r > CHUNK})
    peaks = {t: _expected_peak(sched, rows, t, retained) for t in over}
    assert peaks[over[-1]] > base.predicted_peak_bytes  # the head sets the peak: keeping costs memory
    for budget in sorted(set(peaks.values())) + [base.predicted_peak_bytes]:
        got = keep_head_logits(dataclasses.replace(base, budget_bytes=budget), sched, rows, retain)
        fitting = [t for t in over if peaks[t] <= budget]
        want = max(fitting) if fitting else 0
        assert got.kept_head_rows == want, (budget, peaks)
        assert got.predicted_peak_bytes == pytest.approx(peaks[want] if want else base.predicted_peak_bytes)
        assert got.predicted_peak_bytes <= budget
        assert got.describe()["kept_head_rows"] == want
        if want:
            assert "keep their head's logits" in got.reason


def test_a_retained_group_never_keeps_its_logits():
    """The trunk (its backward after its branches') keeps a chunk of its rows whatever the threshold:
    its predicted peak is priced so, and the largest threshold can be the trunk's rows at no cost."""
    sched = build_schedule(_forest(), 64, 40)
    rows = np.diff(sched.predictions.pred_offsets).tolist()
    trunk = next(g for g, group in enumerate(sched.groups) if not group.is_leaf)
    assert rows[trunk] == max(rows)  # the trunk's rows are the most of any call
    got = keep_head_logits(_plan(sched, math.inf, budget=1e18), sched, rows, math.inf)
    assert got.kept_head_rows == rows[trunk]
    assert got.predicted_peak_bytes == pytest.approx(_expected_peak(sched, rows, rows[trunk], True))
    recomputed = keep_head_logits(_plan(sched, 0.0, budget=1e18), sched, rows, 0.0)
    assert recomputed.predicted_peak_bytes > got.predicted_peak_bytes  # re-run: its backward follows at once


def test_plans_it_cannot_price_or_that_are_over_budget_are_left_alone():
    sched = build_schedule(_forest(), 64, 40)
    rows = np.diff(sched.predictions.pred_offsets).tolist()
    base = _plan(sched, math.inf)
    assert keep_head_logits(dataclasses.replace(base, call_bytes=None), sched, rows, math.inf).kept_head_rows == 0
    over = dataclasses.replace(base, budget_bytes=base.predicted_peak_bytes / 2)
    assert keep_head_logits(over, sched, rows, math.inf) is over
    small = [min(r, CHUNK) for r in rows]  # every call fits one chunk already
    assert keep_head_logits(base, sched, small, math.inf) is base


@settings(max_examples=40, deadline=None)
@given(seqs=sequence_batches(max_sequences=7, max_len=14), data=st.data())
def test_one_walk_finds_what_simulating_each_threshold_finds(seqs, data):
    """:func:`keep_head_logits` (every threshold priced from one walk) against its reference (a
    simulation per threshold, largest first): the same plan, field for field, on random trees, call
    sizes, loss rows, checkpointing, retained paths, gradients and budgets, the budgets at each
    threshold's own peak included; and each priced peak is the simulated one."""
    sched = build_schedule(dtree.Forest.from_sequences(seqs), data.draw(st.integers(2, 6)),
                           data.draw(st.sampled_from([0, 3, 8, 20])))
    rows = data.draw(st.lists(st.integers(0, 3 * CHUNK), min_size=len(sched.groups), max_size=len(sched.groups)))
    retain = data.draw(st.sampled_from([0.0, 5.0, math.inf]))
    base = dataclasses.replace(_plan(sched, retain), checkpoint_layers=data.draw(st.integers(0, 2)),
                               step_grad_bytes=data.draw(st.sampled_from([0.0, 3e5, 3e6])))
    base = mm.with_simulated_peak(base, sched, rows, retain, base.parts["kv_stack"])
    thresholds = sorted({r for r in rows if r > CHUNK}, reverse=True)
    fig, path = mm.plan_walk(base)
    peaks = threshold_peaks(base, sched, rows, retain, thresholds)
    for t, peak in zip(thresholds, peaks):
        assert peak == mm.simulate_peak(sched, rows, retain, base.checkpoint_layers, path, fig,
                                        base.step_grad_bytes, t)[0]
    grow = base.parts["kv_stack"]
    budgets = [base.predicted_peak_bytes, base.predicted_peak_bytes / 2, math.inf]
    budgets += [p + grow for p in peaks] + [np.nextafter(p + grow, 0.0) for p in peaks]
    for budget in budgets:
        plan = dataclasses.replace(base, budget_bytes=budget)
        assert keep_head_logits(plan, sched, rows, retain) == keep_head_logits_reference(plan, sched, rows, retain)


def _planned_with(monkeypatch, keep) -> list[tuple[int, int, bool]]:
    """Steps planned with ``keep`` in place of :func:`keep_head_logits`; returns the list their walks'
    LM-head calls are recorded in: (rows, chunk, keep_logits) each."""
    seen = []
    original = walk_module.weighted_terms

    def spy(fn, head_in, *args, **kwargs):
        seen.append((head_in.shape[0], args[6], kwargs["keep_logits"]))
        return original(fn, head_in, *args, **kwargs)

    monkeypatch.setattr(step_plan, "keep_head_logits", keep)
    monkeypatch.setattr(walk_module, "weighted_terms", spy)
    return seen


@pytest.mark.parametrize("mode, group_tokens", [("auto", 0), ("auto", 12), ("recompute", 12)])
def test_the_walk_runs_kept_calls_in_one_chunk_exactly(monkeypatch, mode, group_tokens):
    """A plan whose calls of at most ``t`` loss rows keep their logits: those that run their
    backward at once get one chunk of their rows, the rest the plan's one-row chunks; every
    gradient against HF per path."""
    threshold = {}

    def keep(memory, sched, rows, retain_tokens):
        over = sorted({int(r) for r in rows if r > 1})
        threshold["t"] = over[(len(over) - 1) // 2]  # some calls keep, some do not
        return dataclasses.replace(memory, logprob_chunk=1, kept_head_rows=threshold["t"])

    seen = _planned_with(monkeypatch, keep)
    model = make_model("qwen2", tied=True)
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=group_tokens)
    t = threshold["t"]
    assert t > 1 and seen
    for rows, chunk, keep_logits in seen:
        assert chunk == (rows if keep_logits and 1 < rows <= t else 1), (rows, chunk, keep_logits, t)
    assert any(chunk > 1 for _, chunk, _ in seen), (seen, t)
    assert any(chunk == 1 < rows for rows, chunk, _ in seen), (seen, t)
    assert out.metrics["memory_plan"]["kept_head_rows"] == t
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_the_two_pass_path_decides_on_its_training_pass_rows(monkeypatch):
    """A loss that is not a sum of per-token terms runs a log-prob pass, then a training pass over
    the same schedule with its own loss terms: only the training pass is given calls that keep their
    logits, decided on its own rows per call; every gradient against HF per path."""
    asked = []

    def keep(memory, sched, rows, retain_tokens):
        rows = [int(r) for r in rows]
        asked.append(rows)
        return dataclasses.replace(memory, logprob_chunk=1, kept_head_rows=max(rows))

    seen = _planned_with(monkeypatch, keep)
    seqs = [[1, 2, 3, 4, 8, 9], [1, 2, 3, 5, 6], [1, 2, 7, 10, 11, 12, 13]]

    def loss_fn(lps, forest):
        return sum(lp.mean() ** 2 for lp in lps) / len(lps)

    model = make_model("mistral")
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    out = dtree.TreeRuntime(tree_model, chunk_size=2, group_tokens=4).forward_backward(
        dtree.Forest.from_sequences(seqs), loss_fn)
    loss_fn([path_logprobs(ref_model, s) for s in seqs], None).backward()
    assert len(asked) == 1 and seen  # the training pass only
    assert sorted(r for r, _, _ in seen) == sorted(r for r in asked[0] if r)
    assert any(keep_logits and chunk == rows > 1 for rows, chunk, keep_logits in seen), seen
    assert out.metrics["memory_plan"]["kept_head_rows"] == max(asked[0])
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < FP32_TOL, errs
