"""Schedule invariants: chunks, packed groups, DFS events, stack slots, predictions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import sequence_batches

from dtree import Forest
from dtree.plan.loss_terms import LossTerms, all_predictions, every_term, prediction_lin, select_loss_terms
from dtree.plan.schedule import BACKWARD, FORWARD, build_schedule


@given(sequence_batches(max_sequences=8, max_len=16, alphabet=4), st.sampled_from([1, 2, 5, 100]), st.sampled_from([0, 3, 8, 1000]))
def test_schedule_invariants(seqs, chunk, budget):
    f = Forest.from_sequences(seqs)
    s = build_schedule(f, chunk_size=chunk, group_tokens=budget)
    # every unique token is one row of exactly one group
    assert sorted(s.row_unique.tolist()) == list(range(f.num_unique_tokens))
    # group sizes: within budget unless a single segment
    for g in s.groups:
        assert g.num_tokens == g.seg_q_offsets[-1]
        assert budget == 0 and g.num_segments == 1 or g.num_tokens <= max(budget, chunk) or g.num_segments == 1
        assert np.all(np.diff(g.seg_q_offsets) <= chunk)
    # events: each group forwards once, backwards once, properly nested, parents first
    open_groups, seen = [], set()
    slot_of = np.full(f.num_unique_tokens, -1)
    for kind, gid in s.events:
        g = s.groups[gid]
        if kind == FORWARD:
            assert gid not in seen and (g.parent == -1 or g.parent in open_groups)
            assert g.parent == -1 or open_groups[-1] == g.parent  # depth first
            seen.add(gid)
            open_groups.append(gid)
            r0, r1 = s.row_offsets[gid], s.row_offsets[gid + 1]
            slot_of[s.row_unique[r0:r1]] = g.stack_start + np.arange(r1 - r0)
            parent_top = 0 if g.parent < 0 else s.groups[g.parent].stack_start + s.groups[g.parent].num_tokens
            assert g.stack_start == parent_top
            # the stack holds every group that writes its K/V there (read by children or
            # by its own segments), and every prefix a segment reads
            assert g.writes_stack == (g.num_children > 0 or g.in_call_ancestors)
            assert not g.writes_stack or g.stack_start + g.num_tokens <= s.stack_tokens
            assert all(hi <= s.stack_tokens for r in g.seg_prefix_ranges for _, hi in r)
            # each segment's prefix ranges are exactly its ancestors' slots, root first
            for i, seg_ranges in enumerate(g.seg_prefix_ranges):
                first = s.row_unique[r0 + g.seg_q_offsets[i]]
                anc = []
                y = f.predecessor[first]
                while y >= 0:
                    anc.append(y)
                    y = f.predecessor[y]
                want = slot_of[np.array(anc[::-1], dtype=np.int64)].tolist()
                got = [x for lo, hi in seg_ranges for x in range(lo, hi)]
                assert got == want
        else:
            assert kind == BACKWARD and open_groups.pop() == gid
    assert not open_groups and len(seen) == s.num_groups
    # predictions: each predicted unique token once, from its predecessor's row
    t = every_term(s.predictions, f)
    assert sorted(t.pred_unique.tolist()) == np.flatnonzero(f.predecessor >= 0).tolist()
    for gid in range(s.num_groups):
        p0, p1 = t.pred_offsets[gid], t.pred_offsets[gid + 1]
        r0 = s.row_offsets[gid]
        assert np.array_equal(s.row_unique[r0 + t.pred_hidden_row[p0:p1]], f.predecessor[t.pred_unique[p0:p1]])
        e0, e1 = t.loss_offsets[gid], t.loss_offsets[gid + 1]
        assert np.array_equal(t.pred_unique[p0 + t.loss_pred[e0:e1]], f.lin_unique[t.loss_lin[e0:e1]])
    assert t.loss_offsets[-1] == f.num_linearized_tokens - f.num_sequences


def test_dfs_stack_is_the_longest_path():
    f = Forest.from_sequences([[1] * 10 + [2] * 5, [1] * 10 + [3] * 7, [4] * 3])
    s = build_schedule(f, chunk_size=4, group_tokens=0)
    # unbatched DFS: the stack never holds more than one path, less its last segment
    # (a leaf: nothing reads its K/V): 10 + 4 of the 17-token path
    assert s.stack_tokens == 14
    assert s.num_groups == s.num_segments == 3 + 2 + 2 + 1


def test_stack_holds_only_the_slots_written():
    """Issue 20: GRPO, a 2,048-token prompt and 16 answers of 1,024 in 8,192-token calls:
    the answers' calls are leaves without in-call ancestors, so only the prompt's 2,048
    slots are written (the stack used to be sized 2,048 + 8 x 1,024 = 10,240)."""
    prompt = list(range(2048))
    f = Forest.from_sequences([prompt + [3000 + a] * 1024 for a in range(16)])
    s = build_schedule(f, chunk_size=2048, group_tokens=8192)
    assert [(g.num_tokens, g.writes_stack) for g in s.groups] == [(2048, True), (8192, False), (8192, False)]
    assert s.stack_tokens == 2048
    # one call for a whole small tree: its segments read each other through the stack
    s = build_schedule(Forest.from_sequences([[1, 2, 3, 4], [1, 2, 5]]), chunk_size=64, group_tokens=64)
    assert s.groups[0].in_call_ancestors and s.groups[0].writes_stack and s.stack_tokens == 5


def test_siblings_and_trees_share_calls():
    grpo = [[1, 2, 3] + [10 + g] * 4 for g in range(8)] + [[5, 6] + [20 + g] * 3 for g in range(4)]
    f = Forest.from_sequences(grpo)
    # both trees (35 + 14 tokens) fit one call: one group, 14 segments
    s = build_schedule(f, chunk_size=64, group_tokens=64)
    assert [g.num_segments for g in s.groups] == [14]
    assert s.groups[0].in_call_ancestors and s.groups[0].is_leaf
    # budget 33: the first tree does not fit; its prompt runs alone, the second tree whole,
    # then the 8 answers (32 tokens) together
    s = build_schedule(f, chunk_size=64, group_tokens=33)
    assert [(g.num_segments, g.num_tokens) for g in s.groups] == [(1, 3), (5, 14), (8, 32)]
    assert [g.parent for g in s.groups] == [-1, -1, 0]


def check_terms(f: Forest, s, t, kept_lin: np.ndarray) -> None:
    """``t`` holds exactly the terms ``kept_lin``, each reading its unique token's
    prediction from the predecessor's row, and only the predictions they read."""
    assert sorted(t.loss_lin.tolist()) == sorted(kept_lin.tolist())
    read = set()
    for gid in range(s.num_groups):
        p0, p1 = t.pred_offsets[gid], t.pred_offsets[gid + 1]
        e0, e1 = t.loss_offsets[gid], t.loss_offsets[gid + 1]
        assert np.all((t.loss_pred[e0:e1] >= 0) & (t.loss_pred[e0:e1] < p1 - p0))
        assert np.array_equal(t.pred_unique[p0 + t.loss_pred[e0:e1]], f.lin_unique[t.loss_lin[e0:e1]])
        r0 = s.row_offsets[gid]
        assert np.array_equal(s.row_unique[r0 + t.pred_hidden_row[p0:p1]], f.predecessor[t.pred_unique[p0:p1]])
        read.update((p0 + t.loss_pred[e0:e1]).tolist())
    assert read == set(range(len(t.pred_unique)))  # no prediction that no term reads


def _every_term_filtered(every, weights: np.ndarray) -> LossTerms:
    """The selection by its definition: every term, those with a non-zero weight kept in
    order, and only the predictions they read (renumbered)."""
    g = len(every.loss_offsets) - 1
    group = np.repeat(np.arange(g), np.diff(every.loss_offsets))
    keep = weights[every.loss_lin] != 0
    lin, grp = every.loss_lin[keep], group[keep]
    read = sorted(set((every.pred_offsets[grp] + every.loss_pred[keep]).tolist()))
    rank = {p: i for i, p in enumerate(read)}
    pred_offsets = np.searchsorted(np.array(read, dtype=np.int64), every.pred_offsets)
    loss_pred = [rank[int(every.pred_offsets[q] + p)] - pred_offsets[q] for q, p in zip(grp, every.loss_pred[keep])]
    return LossTerms(every.pred_hidden_row[read], every.pred_unique[read], pred_offsets, lin,
                     np.array(loss_pred, dtype=np.int64), np.searchsorted(grp, np.arange(g + 1)))


@given(
    sequence_batches(max_sequences=8, max_len=12, alphabet=3),
    st.sampled_from([1, 3, 100]),
    st.sampled_from([0, 4, 1000]),
    st.integers(0, 2**32 - 1),
)
def test_loss_term_selection(seqs, chunk, budget, seed):
    f = Forest.from_sequences(seqs)
    s = build_schedule(f, chunk_size=chunk, group_tokens=budget)
    lin = prediction_lin(f)
    want = [i for k in range(f.num_sequences) for i in range(f.seq_offsets[k] + 1, f.seq_offsets[k + 1])]
    assert lin.tolist() == want
    every = every_term(s.predictions, f)
    check_terms(f, s, every, lin)
    weights = np.random.default_rng(seed).choice([0.0, 0.0, 0.5, -1.0], size=f.num_linearized_tokens)
    weights[f.seq_offsets[:-1]] = 0.0  # as TokenLoss.weights: a sequence's first token has no term
    chosen = select_loss_terms(s.predictions, f, weights)
    check_terms(f, s, chosen, np.flatnonzero(weights != 0))
    want = _every_term_filtered(every, weights)
    for name in ("pred_hidden_row", "pred_unique", "pred_offsets", "loss_lin", "loss_pred", "loss_offsets"):
        assert np.array_equal(getattr(chosen, name), getattr(want, name)), name
    everything = all_predictions(s.predictions)
    assert everything.loss_lin.size == 0 and not np.any(everything.loss_offsets)
    assert np.array_equal(everything.pred_unique, every.pred_unique)
    assert np.array_equal(everything.pred_hidden_row, every.pred_hidden_row)
    assert np.array_equal(everything.pred_offsets, every.pred_offsets)


def test_masked_tokens_never_reach_the_head():
    f = Forest.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]])
    s = build_schedule(f, chunk_size=8, group_tokens=0)
    weights = np.zeros(f.num_linearized_tokens)
    weights[[3, 7]] = 1.0  # the answers 4 and 5 of the first two sequences, predicted from token 3
    t = select_loss_terms(s.predictions, f, weights)
    assert sorted(f.tokens[t.pred_unique].tolist()) == [4, 5]
    assert t.loss_lin.tolist() == [3, 7]


@given(sequence_batches(max_sequences=9, max_len=20), st.integers(1, 9),
       st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True))
def test_stack_needs_are_the_schedules_slots(seqs, chunk, budgets):
    """What the memory policy scores a call budget's KV stack on (``stack_needs``, from the
    packing alone) is what the runtime then allocates for that budget's schedule, with every
    backend's slot rules (own K/V in the stack or not, leaf slots taking gradients or not)."""
    from dtree.plan.stack_sizes import grad_slots, stack_needs, stack_slots

    forest = Forest.from_sequences(seqs)
    for own in (False, True):
        for leaf_grads in (False, True):
            needs = stack_needs(forest, chunk, tuple(budgets), own, leaf_grads)
            for (budget, kv, grads), g in zip(needs, budgets):
                sched = build_schedule(forest, chunk, g)
                assert budget == g
                for plan in sched.groups:  # an ancestor in the call: a prefix range reaching into its slots
                    reaching = any(hi > plan.stack_start for r in plan.seg_prefix_ranges for _, hi in r)
                    assert plan.in_call_ancestors == reaching
                assert (kv, grads) == (stack_slots(sched, own), grad_slots(sched, leaf_grads)), (g, own, leaf_grads)


@given(sequence_batches(max_sequences=9, max_len=20), st.integers(1, 9),
       st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True))
def test_slot_extents_are_the_schedules_packing(seqs, chunk, budgets):
    """What the memory policy scores a call budget on before any schedule exists (``slot_extents``,
    from the packing alone: the calls, the largest, the groups with children and their tokens and
    reach) is what that budget's schedule then runs."""
    from dtree.plan.schedule import slot_extents

    forest = Forest.from_sequences(seqs)
    for extents, g in zip(slot_extents(forest, chunk, tuple(budgets)), budgets):
        sched = build_schedule(forest, chunk, g)
        assert extents == sched.extents == _extents_of_groups(sched)


def _extents_of_groups(sched):
    """The reference :class:`SlotExtents` of a built schedule, from its groups' plans (where the
    packing's own figure reads the packer's groups)."""
    from dtree.plan.schedule import SlotExtents

    groups = sched.groups
    inner = [p.num_tokens for p in groups if not p.is_leaf]
    return SlotExtents(
        sched.group_tokens, max((p.stack_start + p.num_tokens for p in groups), default=0),
        max((p.stack_start + p.num_tokens for p in groups if p.writes_stack), default=0),
        max((p.stack_start + p.num_tokens for p in groups if not p.is_leaf), default=0),
        len(groups), max((p.num_tokens for p in groups), default=0), len(inner), sum(inner),
    )


@given(sequence_batches(max_sequences=9, max_len=20), st.integers(1, 9),
       st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True))
def test_a_schedule_frozen_from_the_policys_packing_is_the_one_packed_again(seqs, chunk, budgets):
    """The planner packs every call budget once for the policy (``pack_budgets``) and freezes the
    chosen budget's packing into the schedule: the same groups, events, slots, rows and predictions
    as packing that budget again; a packing of another budget or chunk size is refused."""
    from dtree.plan.schedule import pack_budgets

    forest = Forest.from_sequences(seqs)
    packings = pack_budgets(forest, chunk, tuple(budgets))
    for g in budgets:
        frozen, again = build_schedule(forest, chunk, g, packings[g]), build_schedule(forest, chunk, g)
        assert frozen.events == again.events and frozen.stack_tokens == again.stack_tokens
        assert [(p.parent, p.stack_start, p.num_tokens, p.segments, p.seg_prefix_ranges, p.num_children)
                for p in frozen.groups] == [(p.parent, p.stack_start, p.num_tokens, p.segments, p.seg_prefix_ranges,
                                             p.num_children) for p in again.groups]
        for a, b in ((frozen.row_unique, again.row_unique), (frozen.row_offsets, again.row_offsets),
                     (frozen.predictions.pred_unique, again.predictions.pred_unique),
                     (frozen.predictions.pred_hidden_row, again.predictions.pred_hidden_row)):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="cannot schedule"):
            build_schedule(forest, chunk + 1, g, packings[g])


def test_stack_needs_on_the_64k_agentic_tree():
    # large calls: far fewer gradient slots than the bound the policy had (the longest path plus a call)
    from dtree.plan.stack_sizes import stack_needs, step_shape
    from dtree.workloads import make_workload

    forest = make_workload("agentic", seed=0, num_trees=1, target_unique_tokens=65536)
    shape = step_shape(forest, 8192)
    (_, kv, grads), = stack_needs(forest, 8192, (12288,), own_in_stack=True, leaf_grads=False)
    # seed 0: 18,899 K/V slots, 6,679 gradient slots, a longest path of 8,499: the bound 20,787 of each
    assert grads < shape.longest_path < kv <= shape.longest_path + 12288


@pytest.mark.parametrize(("chunk", "budget"), [(0, 8), (-1, 0), (4, -1)])
def test_sizes_out_of_range_are_refused_before_packing(chunk, budget):
    """A chunk size under 1 or a negative call budget is refused by name, whether the schedule packs the
    forest itself or the planner packs every budget first."""
    from dtree.plan.schedule import pack_budgets

    forest = Forest.from_sequences([[1, 2, 3], [1, 2, 4]])
    for build in (lambda: build_schedule(forest, chunk, budget), lambda: pack_budgets(forest, chunk, (16, budget))):
        with pytest.raises(ValueError, match="chunk_size must be >= 1 and group_tokens >= 0"):
            build()
