"""One stack-attention call as a single masked attention (dtree/ops/stack_attention/call_mask.py).

CPU only. For the calls of real schedules (small agentic and GRPO forests, several call
sizes) and hand-built layouts (no prefix, siblings, in-call chains, empty segments, lengths
around the 128 tile, two roots), the per-slot row intervals give exactly the layout's
visibility (``dense_visibility``) and the full / partial block lists, per row tile and per
slot tile, equal a tile-by-tile classification of the dense mask. Layouts the tables cannot
express (own slots off the rows, a slot read by two separate runs of rows, in-call segments
not depth first; a few real calls at small budgets) give None. Cached on the layout.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_stack_attention import nested_layout

from dtree.ops.stack_attention import call_mask as tree_mask_module
from dtree.ops.stack_attention.segment_layout import SegmentLayout
from dtree.ops.stack_attention.call_mask import (
    BLOCK,
    PACKED_MAX_ROWS,
    CallMask,
    call_mask,
    dense_visibility,
    kernel_tables,
    packed_bounds,
    table_length,
    visible_from_packed,
    visible_from_tables,
)
from dtree.plan.schedule import build_schedule
from dtree.workloads import make_workload

WORKLOADS = {  # small forests: a few calls per schedule, each of a few hundred to ~1.5k rows
    "agentic": {
        "num_trees": 1,
        "system_prompt_len": 64,
        "trajectories": 3,
        "turn_len": (4, 40),
        "target_unique_tokens": 1500,
    },
    "grpo": {"num_prompts": 2, "prompt_len": (100, 300), "group_size": (2, 4), "answer_len": (20, 150)},
}


def layout_of(lens, prefixes, base):
    """SegmentLayout of segments ``lens`` whose own slots follow ``base`` stack slots
    (row r is slot base + r). Local copy of test_stack_attention_triton's helper, whose
    module is skipped without Triton."""
    q_off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return SegmentLayout(q_off, base + q_off[:-1], [tuple(map(tuple, p)) for p in prefixes])


def call_layouts(name, seed, group_tokens):
    """The SegmentLayouts of one forest's calls, built as dtree.engine.walk builds them
    (as benchmarks/flash4_compile_keys.py does)."""
    sched = build_schedule(make_workload(name, seed=seed, **WORKLOADS[name]), 2048, group_tokens)
    for plan in sched.groups:
        yield SegmentLayout(plan.seg_q_offsets, plan.stack_start + plan.seg_q_offsets[:-1], plan.seg_prefix_ranges)


def dense_tiles(visible):
    """(partial, full) [row tiles, slot tiles] bool of a dense [T, N] mask: a tile is full
    when every real element (row < T, slot < N) is visible, partial when some element is
    visible and it is not full."""
    t, n = visible.shape
    rt, kt = -(-t // BLOCK), -(-n // BLOCK)
    vis = np.zeros((rt * BLOCK, kt * BLOCK), dtype=bool)
    real = np.zeros_like(vis)
    vis[:t, :n], real[:t, :n] = visible, True
    vis4, real4 = (a.reshape(rt, BLOCK, kt, BLOCK) for a in (vis, real))
    full = (vis4 | ~real4).all(axis=(1, 3)) & real4.any(axis=(1, 3))
    partial = vis4.any(axis=(1, 3)) & ~full
    return partial, full


def assert_lists(lists, partial, full):
    """The packed block lists (counts, then that many ascending indices per tile) are
    exactly the dense classification's."""
    for cnt, idx, want in ((lists.partial_cnt, lists.partial_idx, partial), (lists.full_cnt, lists.full_idx, full)):
        assert cnt.dtype == np.int32 and idx.dtype == np.int32
        np.testing.assert_array_equal(cnt, want.sum(axis=1))
        for i, row in enumerate(want):
            np.testing.assert_array_equal(idx[i, : cnt[i]], np.flatnonzero(row))


def check_mask(layout):
    """call_mask(layout) exists, its tables give exactly the layout's visibility and its
    block lists (both directions) equal the dense tile classification. Returns it."""
    mask = call_mask(layout)
    assert mask is not None
    assert mask.num_rows == int(layout.q_offsets[-1]) and mask.slot_row_lo.dtype == mask.slot_row_hi.dtype == np.int32
    assert mask.slot_row_lo.shape == mask.slot_row_hi.shape == (mask.num_keys,)
    dense = dense_visibility(layout, mask.num_keys)
    np.testing.assert_array_equal(visible_from_tables(mask), dense)
    words = packed_bounds(mask)
    assert words.dtype == np.int32 and words.shape == (mask.num_keys,)
    np.testing.assert_array_equal(visible_from_packed(words, mask.num_rows), dense)
    check_kernel_tables(mask, dense)
    partial, full = dense_tiles(dense)
    assert_lists(mask.by_row_tile, partial, full)
    assert_lists(mask.by_slot_tile, partial.T, full.T)
    return mask


def check_kernel_tables(mask: CallMask, dense: np.ndarray) -> None:
    """The tables as the kernel reads them cover every key tile and one more, and give the layout's visibility
    on the call's rows and keys and none past them: not to the rows of the last row tile past the call, nor to
    the padding's keys (the per-key path reads those without a check against the call's length)."""
    lo, hi, words = kernel_tables(mask)
    n = table_length(mask.num_keys)
    assert n >= -(-mask.num_keys // BLOCK) * BLOCK + BLOCK and n % BLOCK == 0
    assert lo.shape == hi.shape == words.shape == (n,) and lo.dtype == hi.dtype == words.dtype == np.int32
    rows = -(-mask.num_rows // BLOCK) * BLOCK
    want = np.zeros((rows, n), dtype=bool)
    want[: mask.num_rows, : mask.num_keys] = dense
    r = np.arange(rows)[:, None]
    np.testing.assert_array_equal((lo[None, :] <= r) & (r < hi[None, :]), want)
    np.testing.assert_array_equal(visible_from_packed(words, rows), want)


def expressible(layout):
    """Dense oracle: own slots are base + row and every slot's visible rows are one run.
    For layouts whose in-call ranges are whole earlier segments (a schedule's), exactly
    those the two tables can express."""
    q_off = np.asarray(layout.q_offsets)
    seg = np.flatnonzero(np.diff(q_off))
    base = int(layout.own_slot[seg[0]] - q_off[seg[0]])
    if base < 0 or np.any(np.asarray(layout.own_slot)[seg] != base + q_off[seg]):
        return False
    dense = dense_visibility(layout, base + int(q_off[-1]))
    count, first, last = dense.sum(0), dense.argmax(0), len(dense) - dense[::-1].argmax(0)
    return bool(np.all((count == 0) | (count == last - first)))


# --------------------------------------------------------------------------- real schedules
@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(WORKLOADS)), st.integers(0, 10_000), st.sampled_from([256, 700, 4096]))
@example("agentic", 6, 256)  # two calls that were not depth first while open units were laid out breadth first
def test_real_schedule_calls_match_dense(name, seed, group_tokens):
    """Every call of a real schedule (built as the walk builds them) is expressible: the
    packer lays calls out depth first (open units sorted into preorder, closed units whole
    subtrees), so the dense oracle agrees and call_mask's tables and block lists match the
    dense reference."""
    for layout in call_layouts(name, seed, group_tokens):
        assert expressible(layout), "a call of the schedule is not laid out depth first"
        check_mask(layout)


# --------------------------------------------------------------------------- hand-built layouts
def _in_call(lens, parent, base):
    """Segments ``lens`` under stack slots ``[0, base)``, segment i's in-call parent
    ``parent[i]`` (-1: none): its prefix is the stack slots and its ancestors' own slots."""
    own = base + np.concatenate([[0], np.cumsum(lens)])
    prefixes = []
    for i, p in enumerate(parent):
        up = [p] if p >= 0 else []
        while up and parent[up[-1]] >= 0:
            up.append(parent[up[-1]])
        prefixes.append([(0, base)] * (base > 0) + [(int(own[a]), int(own[a + 1])) for a in reversed(up)])
    return layout_of(lens, prefixes, base)


EDGE = {
    "alone_no_prefix": lambda: layout_of([300], [[]], 0),
    "under_prefix_odd": lambda: layout_of([77], [[(0, 200)]], 200),
    "under_prefix_129": lambda: layout_of([129], [[(0, 127)]], 127),
    "siblings": lambda: layout_of([50, 130, 77], [[(0, 200)]] * 3, 200),
    "siblings_128": lambda: layout_of([128, 128], [[(0, 256)]] * 2, 256),
    "chain_in_call": lambda: _in_call([40, 150, 70], [-1, 0, 1], 90),
    "chain_no_stack": lambda: _in_call([128, 1, 200], [-1, 0, 1], 0),
    "tree_in_call": lambda: _in_call([30, 130, 1, 60, 90, 20], [-1, 0, 1, 0, -1, 4], 100),  # depth first
    "not_depth_first_reordered": lambda: _in_call([10, 20, 40, 30], [-1, 0, 1, 0], 50),  # the None case, fixed
    "chain_split_ranges": lambda: nested_layout(60)[0],  # A -> B -> C plus B's sibling D
    "two_roots": lambda: layout_of([100, 60], [[(0, 300)], [(300, 500)]], 500),
    "partial_prefix_runs": lambda: layout_of([30, 200], [[(0, 10), (25, 140)], [(0, 10)]], 150),
}


def _with_empty(first):
    """Segments 40, 0, 50 rows (and an empty one first when ``first``): an empty segment
    holds no rows, its (arbitrary) prefix must not leak into the tables."""
    q_off = np.array([0] * first + [0, 40, 40, 90])
    ranges = [((0, 7),)] * first + [((0, 200),), ((0, 5),), ((0, 200),)]
    return SegmentLayout(q_off, 200 + q_off[:-1], ranges)


EDGE.update(empty_segment=lambda: _with_empty(False), empty_first_segment=lambda: _with_empty(True))


@pytest.mark.parametrize("case", sorted(EDGE))
def test_hand_built_layouts_match_dense(case):
    """Edge cases the schedules rarely or never produce (no stack, lengths at and around
    the 128 tile, in-call chains, empty segments, roots reading different stack runs)
    give exact tables and block lists."""
    check_mask(EDGE[case]())


def _bounds_only(lo, hi, rows: int) -> CallMask:
    """A CallMask with just the two tables (packed_bounds reads nothing else)."""
    return CallMask(0, rows, np.asarray(lo, dtype=np.int32), np.asarray(hi, dtype=np.int32), None, None)


def test_packed_bounds_at_the_row_limit():
    """A call of PACKED_MAX_ROWS rows packs (its last row, 32767, is the largest word half that fits an int32),
    including a slot seen by every row, one seen by the last row alone and one no row reads; one row more gives
    None (the backward then takes the two tables)."""
    rows = PACKED_MAX_ROWS
    mask = _bounds_only([0, rows - 1, 0, 5, 0], [rows, rows, 0, 6, 1], rows)
    words = packed_bounds(mask)
    assert words.dtype == np.int32 and np.all(words >= 0)
    r = np.arange(rows)[:, None]
    want = (mask.slot_row_lo[None, :] <= r) & (r < mask.slot_row_hi[None, :])
    np.testing.assert_array_equal(visible_from_packed(words, rows), want)
    assert packed_bounds(_bounds_only([0], [rows + 1], rows + 1)) is None


@pytest.mark.parametrize("length", [1, 127, 128, 129, 256, 300])
@pytest.mark.parametrize("prefix", [0, 1, 128, 200])
def test_tile_boundaries(length, prefix):
    """One segment of every length around the tile under prefixes around the tile: the
    full / partial split of the diagonal and prefix tiles is exact."""
    check_mask(layout_of([length], [[(0, prefix)] if prefix else []], prefix))


def test_table_values_of_two_roots_and_a_chain():
    """The intervals themselves, spelled out: a stack slot is seen by the rows of the
    segments reading it ([0, 0) when none), an own slot by its row up to its subtree's end."""
    mask = check_mask(layout_of([100, 60], [[(0, 300)], [(300, 500)]], 500))
    assert mask.base == 500 and mask.num_keys == 660
    np.testing.assert_array_equal(mask.slot_row_lo[:500], [0] * 300 + [100] * 200)
    np.testing.assert_array_equal(mask.slot_row_hi[:500], [100] * 300 + [160] * 200)
    np.testing.assert_array_equal(mask.slot_row_lo[500:], np.arange(160))
    np.testing.assert_array_equal(mask.slot_row_hi[500:], [100] * 100 + [160] * 60)
    chain = check_mask(_in_call([40, 150, 70], [-1, 0, 1], 90))
    assert np.all(chain.slot_row_hi == 260) and np.all(chain.slot_row_lo[:90] == 0)
    gap = check_mask(layout_of([30], [[(0, 10)]], 20))  # slots 10..20 read by nobody
    assert not gap.slot_row_lo[10:20].any() and not gap.slot_row_hi[10:20].any()


# --------------------------------------------------------------------------- not expressible
def _shifted_own():
    """Segment 1's own slots start 3 slots after base + its first row."""
    layout = layout_of([50, 60], [[(0, 100)]] * 2, 100)
    layout.own_slot[1] += 3
    return layout


def _not_depth_first():
    """Segments 1 and 2 are children of 0, and 3 is a child of 1 placed after 2: 1's
    subtree (rows of 1 and 3) is not a contiguous run, so 2 would appear under 1."""
    return _in_call([10, 20, 30, 40], [-1, 0, 0, 1], 50)


NONE = {
    "own_slots_shifted": _shifted_own,
    # slots 100..200 are read by segments 0 and 2, not by segment 1 between them
    "slot_read_by_two_runs": lambda: layout_of([20, 30, 40], [[(100, 200)], [(0, 100), (200, 300)], [(100, 200)]], 300),
    "not_depth_first": _not_depth_first,
    "reads_a_later_segment": lambda: layout_of([10, 20], [[(0, 50), (60, 80)], [(0, 50)]], 50),
    # conservative: row intervals could express it, but no tree reads part of a segment
    "reads_part_of_a_segment": lambda: layout_of([10, 20], [[(0, 50)], [(0, 55)]], 50),
    "no_rows": lambda: SegmentLayout(np.array([0, 0]), np.array([0]), [()]),
}


@pytest.mark.parametrize("case", sorted(NONE))
def test_inexpressible_layouts_give_none(case):
    """Layouts the two per-slot intervals cannot express give None (the caller keeps its
    region path) rather than a wrong mask; the dense oracle confirms None is forced there
    (not_depth_first: segment 1's slots are seen by its rows and segment 3's, not 2's)."""
    layout = NONE[case]()
    assert call_mask(layout) is None
    if case not in ("no_rows", "reads_part_of_a_segment"):
        assert not expressible(layout)  # None is forced, not merely conservative


# --------------------------------------------------------------------------- caching
def test_cached_on_the_layout(monkeypatch):
    """A layout's mask is built once and shared by its layers: the second call returns
    the same object (None included) without building again."""
    builds = []
    build = tree_mask_module._build
    monkeypatch.setattr(tree_mask_module, "_build", lambda layout: builds.append(1) or build(layout))
    layout = layout_of([50, 60], [[(0, 100)]] * 2, 100)
    first = call_mask(layout)
    assert first is not None and call_mask(layout) is first
    bad = _shifted_own()
    assert call_mask(bad) is None and call_mask(bad) is None
    assert len(builds) == 2


# --------------------------------------------------------------------------- the builder against its reference
def _same_mask(layout):
    """call_mask's builder and its one-interval-at-a-time reference give the same tables and block lists (None
    alike)."""
    fast, slow = tree_mask_module._build(layout), tree_mask_module._build_reference(layout)
    assert (fast is None) == (slow is None)
    if fast is None:
        return
    assert (fast.base, fast.num_rows) == (slow.base, slow.num_rows)
    for a, b in ((fast.slot_row_lo, slow.slot_row_lo), (fast.slot_row_hi, slow.slot_row_hi)):
        np.testing.assert_array_equal(a, b)
    for x, y in ((fast.by_row_tile, slow.by_row_tile), (fast.by_slot_tile, slow.by_slot_tile)):
        for f in ("partial_cnt", "partial_idx", "full_cnt", "full_idx"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


@st.composite
def random_layouts(draw):
    """Segments under a stack prefix: as a tree laid out depth first (expressible), or with ranges drawn at random
    over the slots below each segment (mostly inexpressible: partial segments, gaps, overlaps, reordered runs)."""
    lens = draw(st.lists(st.integers(0, 150), min_size=1, max_size=7))
    base = draw(st.integers(0, 300))
    if draw(st.booleans()):
        parent = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, len(lens))]
        return _in_call(lens, parent, base)
    own = base + np.concatenate([[0], np.cumsum(lens)])
    prefixes = []
    for i in range(len(lens)):
        ranges = []
        for _ in range(draw(st.integers(0, 3))):
            top = int(own[i])
            lo = draw(st.integers(0, top))
            ranges.append((lo, draw(st.integers(lo, top))))
        prefixes.append(ranges)
    return layout_of(lens, prefixes, base)


@settings(max_examples=200, deadline=None)
@given(random_layouts())
def test_builder_matches_its_reference_on_random_layouts(layout):
    _same_mask(layout)


@pytest.mark.parametrize("case", sorted(EDGE) + sorted(NONE))
def test_builder_matches_its_reference_on_the_edge_cases(case):
    _same_mask({**EDGE, **NONE}[case]())


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(sorted(WORKLOADS)), st.integers(0, 10_000), st.sampled_from([256, 700, 4096]))
def test_builder_matches_its_reference_on_real_calls(name, seed, group_tokens):
    for layout in call_layouts(name, seed, group_tokens):
        _same_mask(layout)


def test_builder_matches_its_reference_on_the_256k_trees_calls():
    """The calls the builder was made faster for: 32k-token calls of the 256k agentic tree."""
    forest = make_workload("agentic", seed=0, num_trees=1, target_unique_tokens=262144)
    sched = build_schedule(forest, 2048, 32768)
    for plan in sched.groups[:4]:
        _same_mask(SegmentLayout(plan.seg_q_offsets, plan.stack_start + plan.seg_q_offsets[:-1], plan.seg_prefix_ranges))
