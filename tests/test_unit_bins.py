"""Sibling units into calls (dtree/plan/unit_bins.py): every unit once, within the budget, and
never more calls than packing them in frontier order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtree.plan import unit_bins
from dtree.plan.schedule import build_schedule

unit_sizes = st.lists(st.integers(1, 40), max_size=24)
budgets = st.sampled_from([0, 1, 7, 16, 40, 64, 1000])


@pytest.mark.parametrize("name", sorted(unit_bins.PACKERS))
@given(sizes=unit_sizes, budget=budgets)
def test_every_unit_once_and_within_the_budget(name, sizes, budget):
    bins = unit_bins.PACKERS[name](sizes, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    for b in bins:
        assert b, "an empty bin would be an empty call"
        if budget == 0:
            assert len(b) == 1
        else:
            assert len(b) == 1 or sum(sizes[i] for i in b) <= budget


@given(sizes=unit_sizes, budget=budgets)
def test_never_more_calls_than_in_frontier_order(sizes, budget):
    assert len(unit_bins.pack_units(sizes, budget)) <= len(unit_bins.frontier_order(sizes, budget))


def test_first_fit_decreasing_fills_the_gaps_next_fit_leaves():
    # frontier order: [9], [9, 4], [5] (the 5 overflows the second call); largest first: [9, 5], [9, 4]
    sizes = [9, 9, 4, 5]
    assert unit_bins.frontier_order(sizes, 14) == [[0], [1, 2], [3]]
    assert unit_bins.first_fit_decreasing(sizes, 14) == [[0, 3], [1, 2]]
    assert unit_bins.pack_units(sizes, 14) == [[0, 3], [1, 2]]


def test_frontier_order_where_first_fit_decreasing_needs_more():
    # largest first: [6, 3], [5, 2, 2], [2]; frontier order happens to fill both calls exactly
    sizes = [2, 2, 6, 2, 3, 5]
    assert unit_bins.first_fit_decreasing(sizes, 10) == [[2, 4], [5, 0, 1], [3]]
    assert unit_bins.pack_units(sizes, 10) == unit_bins.frontier_order(sizes, 10) == [[0, 1, 2], [3, 4, 5]]


def test_the_64k_agentic_tree_in_fewer_calls():
    # seed 3 at 16k-token calls: frontier order packed 6 calls (7,502 / 14,847 / 4,346 / 15,655 / 6,925 /
    # 16,322 tokens; session AJ's queue drained in the 4,346- and 6,925-token ones); first fit, 5
    from dtree.workloads import make_workload

    forest = make_workload("agentic", seed=3, num_trees=1, target_unique_tokens=65536)
    sizes = [g.num_tokens for g in build_schedule(forest, 256, 16384).groups]
    assert sizes == [7502, 16322, 16298, 16221, 9254]
