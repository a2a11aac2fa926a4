"""Execution plan for one forest: chunks, model calls, DFS order, stack slots.

Terms (the glossary of docs/design.md section 3):

* **segment**: a run of at most ``chunk_size`` tokens of one trie node. A long node
  becomes a chain of segments, so one huge node never sets the memory peak.
  Segments form a tree like the trie's nodes.
* **group**: the segments that go through the model in one call (packed varlen).
  Every segment's parent is in the same group or an ancestor group, so a group can
  run as soon as its parent group has pushed its K/V. With ``group_tokens=0`` every
  group holds one segment: plain node-by-node DFS. Otherwise the children of a
  group's segments (its *frontier*) are packed into as few child groups of at most
  ``group_tokens`` tokens as first fit finds (:mod:`dtree.plan.unit_bins`): siblings that
  share a prefix, and nodes of different trees, run in one call, and a segment whose whole subtree fits comes with its
  subtree (small subtrees take one call, not one per level).
* **events**: the depth-first walk over the group tree: ``forward(g)``, then all
  child groups, then ``backward(g)``. Built iteratively, so deep trees never hit
  Python's recursion limit.
* **predictions**: each non-root unique token is predicted once, from its predecessor's
  row (:class:`dtree.plan.loss_terms.Predictions`); a pass makes the loss terms it needs
  from them (:func:`dtree.plan.loss_terms.select_loss_terms`).
* **stack slots**: a group's K/V lives in the KV stack at ``[stack_start, stack_start +
  num_tokens)``, above its parent group; the capacity is the high-water mark of the groups
  that write there (:attr:`GroupPlan.writes_stack`; GRPO 2048 + 16 x 1024: 2,048 slots).

All metadata is host-side numpy, computed once per step. Per-group arrays are
concatenated over groups (``*_offsets`` give each group's slice) so the runtime moves
them to the device in a few copies.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..forest.forest import Forest
from . import unit_bins
from .loss_terms import Predictions, every_prediction

__all__ = ["BACKWARD", "FORWARD", "GroupPlan", "Packing", "Schedule", "SlotExtents", "build_schedule",
           "pack_budgets", "slot_extents"]

FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True)
class GroupPlan:
    """One model call.

    Attributes:
        parent: parent group id, -1 for a top-level group.
        stack_start: first stack slot of this group's K/V.
        num_tokens: rows in the call (``T``).
        segments: the segment ids of the call, in row order.
        seg_q_offsets: [S_g+1] row offsets of the group's segments (packed varlen).
        seg_prefix_ranges: per segment, the stack slot ranges ``[(lo, hi), ...]`` of all
            its ancestors, root first, adjacent ranges merged. The segment's own K/V is
            at ``stack_start + seg_q_offsets[i]`` onward and is read causally.
        num_children: child groups (they read this group's K/V from the stack).
    """

    parent: int
    stack_start: int
    num_tokens: int
    segments: list[int]
    seg_q_offsets: np.ndarray
    seg_prefix_ranges: list[tuple[tuple[int, int], ...]]
    num_children: int
    in_call_ancestors: bool  # some segment attends to another segment of this call

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def is_leaf(self) -> bool:
        """No child group: nothing ever reads this group's K/V."""
        return self.num_children == 0

    @property
    def writes_stack(self) -> bool:
        """A child group or its own segments read its K/V there (else no slot is touched)."""
        return not self.is_leaf or self.in_call_ancestors


@dataclass(frozen=True)
class SlotExtents:
    """How far the groups of a schedule reach into the KV stack (slot counts), as
    :func:`build_schedule` packs them under one call budget: every group's (leaf calls'
    included), the groups' that write their K/V there (:attr:`Schedule.stack_tokens`), and
    the groups' with a child group (whose slots collect gradients: the most of their tokens a
    walk holds at once). And what the memory policy scores the budget's calls on: the groups
    (model calls), the largest one's tokens, and the groups with children and their tokens
    (what the path's retention keeps or its recompute runs again)."""

    group_tokens: int
    every: int
    writing: int
    with_children: int
    calls: int = 0
    largest_call: int = 0
    calls_with_children: int = 0
    tokens_with_children: int = 0

    def kv_slots(self, own_in_stack: bool) -> int:
        """The KV-stack capacity: the slots the groups write, or with ``own_in_stack`` (a backend
        that reads every call's own K/V from its slots) every group's, the leaf calls' too."""
        return self.every if own_in_stack else self.writing

    def grad_slots(self, leaf_grads: bool) -> int:
        """The gradient slots: those of the groups with children, or with ``leaf_grads`` (leaf
        calls whose segments read each other take gradients too) every slot the groups write."""
        return self.writing if leaf_grads else self.with_children


@dataclass(frozen=True)
class Schedule:
    """The plan for one forest (see module docstring).

    Concatenated per-group arrays (``G`` groups, ``U`` unique tokens, ``S`` segments):
        row_unique:  [U] unique-token index of every row, group after group
        row_offsets: [G+1] group ``g``'s rows are ``[row_offsets[g], row_offsets[g+1])``
        predictions: every prediction, per group (:class:`Predictions`)
        segment_parent: [S] parent segment of every segment, -1 at a root
    ``packing``: the budget's packing the schedule froze (:func:`pack_budgets`).
    """

    groups: list[GroupPlan]
    events: list[tuple[int, int]]
    chunk_size: int
    group_tokens: int
    row_unique: np.ndarray
    row_offsets: np.ndarray
    predictions: Predictions
    num_segments: int
    segment_parent: np.ndarray
    packing: Packing

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def stack_tokens(self) -> int:
        """The KV-stack slots the step writes (its stack capacity)."""
        return self.packing.extents.writing

    @property
    def extents(self) -> SlotExtents:
        """How far this schedule's groups reach into the KV stack: its packing's
        (:attr:`Packing.extents`, computed once)."""
        return self.packing.extents


@dataclass(frozen=True)
class _Segments:
    """Phase 1: trie nodes cut into chunks (``S`` segments).

    Segment ids follow node preorder with a node's chunks consecutive, so parents come
    before children and segment ``s``'s subtree is the id range ``[s, s + sub_count[s])``.
        start, length:        [S] first unique token and token count of each segment
        parent:               [S] parent segment, -1 at a tree's root
        children:             child segments of each segment, in node order
        sub_count, sub_tokens: [S] segments and tokens in each segment's subtree
    """

    start: np.ndarray
    length: np.ndarray
    parent: np.ndarray
    children: list[list[int]]
    sub_count: np.ndarray
    sub_tokens: np.ndarray

    num_segments = property(lambda self: len(self.start))


def _split_segments(forest: Forest, chunk_size: int) -> _Segments:
    """Cut every node into chunks of at most ``chunk_size`` tokens, chained parent to child."""
    n_chunks = np.maximum(1, -(-forest.node_length // chunk_size))
    first_seg = np.zeros(forest.num_nodes + 1, dtype=np.int64)
    np.cumsum(n_chunks, out=first_seg[1:])
    total = int(first_seg[-1])
    node_of = np.repeat(np.arange(forest.num_nodes), n_chunks)
    chunk_idx = np.arange(total) - first_seg[node_of]
    start = forest.node_start[node_of] + chunk_idx * chunk_size
    length = np.minimum(chunk_size, forest.node_start[node_of] + forest.node_length[node_of] - start)
    parent = np.where(chunk_idx > 0, np.arange(total) - 1, -1)
    last_seg = first_seg[1:] - 1
    np_parent = forest.node_parent[node_of]
    heads = chunk_idx == 0
    parent[heads & (np_parent >= 0)] = last_seg[np_parent[heads & (np_parent >= 0)]]
    children: list[list[int]] = [[] for _ in range(total)]
    for s in range(total):
        if chunk_idx[s] + 1 < n_chunks[node_of[s]]:
            children[s].append(s + 1)
        else:
            n = node_of[s]
            kids = forest.child_index[forest.child_offsets[n] : forest.child_offsets[n + 1]]
            children[s].extend(int(first_seg[c]) for c in kids)
    sub_count, sub_tokens = _subtree_sizes(parent, length)
    return _Segments(start, length, parent, children, sub_count, sub_tokens)


def _subtree_sizes(parent: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[S] segments and [S] tokens in each subtree; children have larger ids than parents."""
    sub_count = np.ones(len(parent), dtype=np.int64)
    sub_tokens = length.astype(np.int64).copy()
    for s in range(len(parent) - 1, -1, -1):
        p = parent[s]
        if p >= 0:
            sub_count[p] += sub_count[s]
            sub_tokens[p] += sub_tokens[s]
    return sub_count, sub_tokens


@dataclass
class _PackedGroup:
    """A group while the walk still packs its children (phase 2); frozen into a
    :class:`GroupPlan` once every group's stack slots are known."""

    parent: int
    stack_start: int
    segments: list[int]
    seg_q_offsets: np.ndarray
    num_children: int = 0


class _GroupPacker:
    """Phase 2: packs frontiers of segments into groups of at most ``group_tokens`` tokens.

    A segment whose whole subtree fits the budget is *closed*: it brings the subtree
    along, its descendants attending to their in-call ancestors through the stack,
    which saves a call per level of a deep, thin tree. An *open* segment (its subtree
    is too large) brings the parts below it that are too large as well, while they fit
    (:meth:`_open_unit`). Closed and open units go into separate groups: a group with
    no child group runs once with grad and backpropagates at once in every mode, while
    a group with children must keep its graph (retain) or run again (recompute); mixing
    the two would recompute the closed part too.
    """

    def __init__(self, segs: _Segments, group_tokens: int) -> None:
        self.segs, self.budget = segs, group_tokens
        self.groups: list[_PackedGroup] = []
        self.seg_group = np.full(segs.num_segments, -1, dtype=np.int64)
        self.seg_row = np.zeros(segs.num_segments, dtype=np.int64)  # first row of the segment in its group

    def _closed(self, s: int) -> bool:
        return bool(self.budget) and self.segs.sub_tokens[s] <= self.budget

    def _open_unit(self, s: int) -> list[int]:
        """``s`` and, breadth first, those of its descendants that would need a group
        of their own anyway (their subtrees do not fit one call), while they fit the
        budget: a long prompt's chunk chain and the first branch levels below it
        share a call. Descendants whose subtrees fit one call are left to closed
        groups, which run once even in recompute mode. The unit is laid out depth
        first, as closed units are (the flash-attn backend's one-call mask needs it)."""
        length, sub_tokens, budget = self.segs.length, self.segs.sub_tokens, self.budget
        unit, size = [s], int(length[s])
        queue = deque(self.segs.children[s] if budget else ())
        while queue:
            c = queue.popleft()
            if sub_tokens[c] > budget and size + length[c] <= budget:
                unit.append(c)
                size += int(length[c])
                queue.extend(self.segs.children[c])
        return sorted(unit)  # depth first (segment ids are preorder): every subtree a run of rows

    def pack(self, frontier: list[int], parent: int, stack_start: int) -> list[int]:
        """Packs ``frontier``'s units into groups (:mod:`dtree.plan.unit_bins`), open units first;
        returns the new group ids. Each group's segments are sorted, so every unit stays a run of
        rows in preorder (the one-call mask's layout)."""
        open_units = [self._open_unit(s) for s in frontier if not self._closed(s)]
        closed_units = [list(range(s, s + self.segs.sub_count[s])) for s in frontier if self._closed(s)]
        bins: list[list[int]] = []
        for units in (open_units, closed_units):
            sizes = [int(self.segs.length[u].sum()) for u in units]
            bins += [sorted(s for i in b for s in units[i]) for b in unit_bins.PACK(sizes, self.budget)]
        return [self._add_group(b, parent, stack_start) for b in bins]

    def holds_ancestors(self, gid: int) -> bool:
        """Some segment of group ``gid`` has its parent in the same group (then an ancestor's
        K/V is read from this call's own slots: :attr:`GroupPlan.in_call_ancestors`)."""
        parents = self.segs.parent[self.groups[gid].segments]
        return bool(np.any(self.seg_group[parents[parents >= 0]] == gid))

    def _add_group(self, segments: list[int], parent: int, stack_start: int) -> int:
        gid = len(self.groups)
        offs = np.zeros(len(segments) + 1, dtype=np.int64)
        np.cumsum(self.segs.length[segments], out=offs[1:])
        self.groups.append(_PackedGroup(parent, stack_start, segments, offs))
        self.seg_group[segments] = gid
        self.seg_row[segments] = offs[:-1]
        return gid


def _walk_groups(segs: _Segments, group_tokens: int) -> tuple[_GroupPacker, list[tuple[int, int]]]:
    """Phase 2: the group tree and the DFS events over it, with an explicit stack (trees
    may be deeper than Python's recursion limit). A group's child groups are packed
    when it is entered, from the children of its segments that it does not hold.
    Returns (the packer with every group, events)."""
    packer = _GroupPacker(segs, group_tokens)
    roots = np.flatnonzero(segs.parent < 0).tolist()
    events: list[tuple[int, int]] = []
    todo: list[tuple[int, bool]] = [(g, True) for g in reversed(packer.pack(roots, -1, 0))]
    while todo:
        gid, entering = todo.pop()
        if not entering:
            events.append((BACKWARD, gid))
            continue
        group = packer.groups[gid]
        events.append((FORWARD, gid))
        top = group.stack_start + int(group.seg_q_offsets[-1])
        frontier = [c for s in group.segments for c in segs.children[s] if packer.seg_group[c] != gid]
        todo.append((gid, False))
        kids = packer.pack(frontier, gid, top)
        group.num_children = len(kids)
        todo.extend((g, True) for g in reversed(kids))
    return packer, events


def _prefix_ranges(segs: _Segments, seg_slot: np.ndarray) -> list[tuple[tuple[int, int], ...]]:
    """Phase 3: per segment, the stack slot ranges of all its ancestors, root first,
    adjacent ranges merged (parents precede children in segment order).

    Args:
        seg_slot: [S] first stack slot of each segment's K/V.
    """
    ranges: list[tuple[tuple[int, int], ...]] = [()] * segs.num_segments
    for s in range(segs.num_segments):
        p = segs.parent[s]
        if p < 0:
            continue
        lo, hi = int(seg_slot[p]), int(seg_slot[p] + segs.length[p])
        above = ranges[p]
        if above and above[-1][1] == lo:
            ranges[s] = above[:-1] + ((above[-1][0], hi),)
        else:
            ranges[s] = above + ((lo, hi),)
    return ranges


def _group_plans(packer: _GroupPacker, seg_ranges: list[tuple[tuple[int, int], ...]]) -> list[GroupPlan]:
    """Phase 3: the packed groups, frozen with their segments' ancestor ranges."""
    plans = []
    for gid, g in enumerate(packer.groups):
        ranges = [seg_ranges[s] for s in g.segments]
        plans.append(GroupPlan(
            parent=g.parent, stack_start=g.stack_start, num_tokens=int(g.seg_q_offsets[-1]), segments=g.segments,
            seg_q_offsets=g.seg_q_offsets, seg_prefix_ranges=ranges, num_children=g.num_children,
            in_call_ancestors=packer.holds_ancestors(gid),
        ))
    return plans


def _rows(segs: _Segments, groups: list[GroupPlan]) -> tuple[np.ndarray, np.ndarray]:
    """Phase 4: ([U] unique token of every row, group after group in pack order, [G+1] row offsets)."""
    row_offsets = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum([g.num_tokens for g in groups], out=row_offsets[1:])
    row_unique = np.concatenate(
        [np.concatenate([np.arange(segs.start[s], segs.start[s] + segs.length[s]) for s in g.segments]) for g in groups]
    )
    return row_unique, row_offsets


@dataclass(frozen=True)
class Packing:
    """How one call budget packs a forest (phases 1 and 2 of :func:`build_schedule`): the memory
    policy scores every budget's :attr:`extents`, and the schedule it runs freezes the chosen
    budget's packing instead of packing again."""

    chunk_size: int
    group_tokens: int
    segs: _Segments
    packer: _GroupPacker
    events: list[tuple[int, int]]

    @functools.cached_property
    def extents(self) -> SlotExtents:
        """The budget's :class:`SlotExtents`, from the packing alone (no rows or predictions)."""
        every = writing = with_children = largest = inner_calls = inner_tokens = 0
        for gid, g in enumerate(self.packer.groups):
            tokens = int(g.seg_q_offsets[-1])
            top = g.stack_start + tokens
            every, largest = max(every, top), max(largest, tokens)
            if g.num_children:
                with_children = max(with_children, top)
                inner_calls, inner_tokens = inner_calls + 1, inner_tokens + tokens
            if g.num_children or self.packer.holds_ancestors(gid):  # GroupPlan.writes_stack
                writing = max(writing, top)
        return SlotExtents(self.group_tokens, every, writing, with_children, len(self.packer.groups), largest,
                           inner_calls, inner_tokens)


def _check_sizes(chunk_size: int, group_tokens: int) -> None:
    if chunk_size < 1 or group_tokens < 0:
        raise ValueError(f"chunk_size must be >= 1 and group_tokens >= 0, got {chunk_size} and {group_tokens}")


def pack_budgets(forest: Forest, chunk_size: int, budgets: tuple[int, ...]) -> dict[int, Packing]:
    """The :class:`Packing` of each call budget of ``budgets`` over one cut of ``forest`` into
    segments: ~0.5-1.3 ms a budget on a 64k-token agentic tree, where a whole
    :func:`build_schedule` takes ~7 ms."""
    for budget in budgets:
        _check_sizes(chunk_size, budget)
    segs = _split_segments(forest, chunk_size)
    return {budget: Packing(chunk_size, budget, segs, *_walk_groups(segs, budget)) for budget in budgets}


def build_schedule(forest: Forest, chunk_size: int = 2048, group_tokens: int = 0, packing: Packing | None = None
                   ) -> Schedule:
    """Plan the DFS over ``forest``: segments, groups and events, stack slots, rows, predictions.

    Args:
        chunk_size: longest segment; longer nodes are split into chains.
        group_tokens: token budget of one model call; 0 runs one segment per call.
        packing: this forest's packing under ``chunk_size`` and ``group_tokens``
            (:func:`pack_budgets`), when the caller has it: it is frozen, not packed again.
    """
    if packing is None:  # pack_budgets checks the sizes (a given packing's were checked when it was packed)
        packing = pack_budgets(forest, chunk_size, (group_tokens,))[group_tokens]
    elif (packing.chunk_size, packing.group_tokens) != (chunk_size, group_tokens):
        raise ValueError(f"a packing of chunk_size {packing.chunk_size} and group_tokens {packing.group_tokens} "
                         f"cannot schedule chunk_size {chunk_size} and group_tokens {group_tokens}")
    segs, packer = packing.segs, packing.packer
    seg_slot = np.array([packer.groups[g].stack_start for g in packer.seg_group], dtype=np.int64) + packer.seg_row
    groups = _group_plans(packer, _prefix_ranges(segs, seg_slot))
    row_unique, row_offsets = _rows(segs, groups)
    return Schedule(
        groups=groups, events=list(packing.events), chunk_size=chunk_size, group_tokens=group_tokens, row_unique=row_unique, row_offsets=row_offsets,
        predictions=every_prediction(forest, row_unique, row_offsets), num_segments=segs.num_segments,
        segment_parent=segs.parent, packing=packing,
    )


def slot_extents(forest: Forest, chunk_size: int, budgets: tuple[int, ...]) -> tuple[SlotExtents, ...]:
    """The :class:`SlotExtents` of the schedule each call budget of ``budgets`` would give
    (:attr:`Packing.extents`)."""
    packings = pack_budgets(forest, chunk_size, budgets)
    return tuple(packings[b].extents for b in budgets)
