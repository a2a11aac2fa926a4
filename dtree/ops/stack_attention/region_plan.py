"""How one stack-attention call splits into plain varlen attention calls ("regions")
whose results merge by log-sum-exp (:mod:`dtree.ops.stack_attention.regions`).

A query row of segment ``i`` sees its prefix slots ``layout.prefix_ranges[i]`` without a
mask and its own keys causally. Softmax over a union of disjoint key sets is the
log-sum-exp merge of the softmaxes over each set, so the call is

* one **own** region: every segment against its own K/V, causal (``cu_seqlens`` = the
  segments' offsets, empty segments dropped), and
* **prefix levels**: non-causal varlen calls whose sequences are *pairs* (query rows
  ``[q_lo, q_hi)``, stack slots ``[k_lo, k_hi)``): every query row of the pair sees every
  slot of it. All the rows that share a slot range are one pair when they are adjacent
  (a GRPO group's answers under its prompt: one pair of 8 x 512 rows against the 2048
  prompt slots), so siblings share each prefix key tile, as in the fused kernel.

A varlen call writes one output per row and, in the backward, one dK/dV per key, so
the pairs of one level must be disjoint in rows *and* in slots; they are also sorted
in both (flash-attn's padded scratch offsets follow the batch order). Pairs are built
from elementary slot intervals (cut at every range end of the call): for each interval,
its reader runs grouped into adjacent blocks; adjacent intervals with the same reader
block are joined. Pairs are then placed greedily, in row order, into the first level
they fit. A GRPO group is one level; an agentic call whose branches share a task prefix
and each add a branch history is two (the shared prefix, then the histories).

Everything here is host-side numpy, built once per layout (every layer of a call reuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .segment_layout import SegmentLayout

__all__ = ["RegionLevel", "RegionPlan", "region_plan"]


@dataclass(frozen=True)
class RegionLevel:
    """One non-causal varlen call over the stack: sequence ``b`` is query rows
    ``[q_start[b], q_start[b] + q_len[b])`` against stack slots ``[k_start[b], k_start[b] +
    k_len[b])``. Sorted and disjoint in rows and in slots.

    Attributes:
        q_start, q_len, k_start, k_len: [B] int64.
    """

    q_start: np.ndarray
    q_len: np.ndarray
    k_start: np.ndarray
    k_len: np.ndarray

    @property
    def span(self) -> tuple[int, int]:
        """``(lo, hi)``: the stack slots from the first pair's to the last one's end."""
        return int(self.k_start[0]), int(self.k_start[-1] + self.k_len[-1])

    @property
    def gapless(self) -> bool:
        """Whether the pairs' slots tile :attr:`span` (no slot in it goes unread)."""
        return bool(np.all(self.k_start[1:] == self.k_start[:-1] + self.k_len[:-1]))

    @property
    def num_pairs(self) -> int:
        return len(self.q_start)


@dataclass(frozen=True)
class RegionPlan:
    """A call as regions.

    Attributes:
        levels: the prefix levels (none when no segment has ancestors).
        own_offsets: [S'+1] int64 row offsets of the non-empty segments (the own
            region's ``cu_seqlens``, for queries and keys alike).
        num_rows: T, the call's rows.
        slots_end: one past the last stack slot any level reads (0 without levels).
    """

    levels: tuple[RegionLevel, ...]
    own_offsets: np.ndarray
    num_rows: int
    slots_end: int

    @property
    def max_own_len(self) -> int:
        return int(np.diff(self.own_offsets).max())


def region_plan(layout: SegmentLayout) -> RegionPlan:
    """The regions of ``layout`` (cached on it)."""
    return layout.cached(("regions", "plan"), lambda: _build_plan(layout))


def _build_plan(layout: SegmentLayout) -> RegionPlan:
    q_off = np.asarray(layout.q_offsets, dtype=np.int64)
    for ranges in layout.prefix_ranges:
        for lo, hi in ranges:
            if not 0 <= lo <= hi:
                raise ValueError(f"prefix ranges must satisfy 0 <= lo <= hi, got {(lo, hi)}")
    own = np.unique(q_off)  # empty segments dropped
    levels = _levels(_pairs(layout))
    return RegionPlan(levels, own, int(q_off[-1]), max((lv.span[1] for lv in levels), default=0))


def _pairs(layout: SegmentLayout) -> list[tuple[int, int, int, int]]:
    """(q_lo, q_hi, k_lo, k_hi) rectangles that cover every (row, prefix slot) the call
    sees exactly once: per elementary slot interval, its reader runs in blocks of
    adjacent runs; an interval continues the previous one's pair when it starts where
    that ends and has the same reader block."""
    runs = layout.runs()
    cuts = sorted({b for run in runs for lo, hi in run.ranges if lo < hi for b in (lo, hi)})
    if not cuts:
        return []
    edges = np.asarray(cuts, dtype=np.int64)
    # reads[r, e]: run r reads elementary interval e = [edges[e], edges[e + 1])
    reads = np.zeros((len(runs), len(edges) - 1), dtype=bool)
    for r, run in enumerate(runs):
        for lo, hi in run.ranges:
            if lo < hi:
                reads[r, np.searchsorted(edges, lo) : np.searchsorted(edges, hi)] = True
    pairs, open_pairs = [], {}  # (first run, last run) -> index in pairs of the pair that may grow
    for e in range(len(edges) - 1):
        lo, hi = int(edges[e]), int(edges[e + 1])
        readers = np.flatnonzero(reads[:, e])
        if not len(readers):
            continue
        # blocks of consecutive run indices (consecutive runs are adjacent in rows)
        breaks = np.flatnonzero(np.diff(readers) > 1)
        for first, last in zip(np.r_[readers[0], readers[breaks + 1]], np.r_[readers[breaks], readers[-1]]):
            key = (int(first), int(last))
            i = open_pairs.get(key)
            if i is not None and pairs[i][3] == lo:
                pairs[i] = (*pairs[i][:3], hi)
            else:
                open_pairs[key] = len(pairs)
                pairs.append((runs[first].row_lo, runs[last].row_hi, lo, hi))
    return pairs


def _levels(pairs: list[tuple[int, int, int, int]]) -> tuple[RegionLevel, ...]:
    """Pairs into levels, each sorted and disjoint in rows and in slots: in row order,
    each pair into the first level whose last pair ends before it in both."""
    levels: list[list[tuple[int, int, int, int]]] = []
    for pair in sorted(pairs):
        q_lo, _, k_lo, _ = pair
        for level in levels:
            if level[-1][1] <= q_lo and level[-1][3] <= k_lo:
                level.append(pair)
                break
        else:
            levels.append([pair])
    out = []
    for level in levels:
        a = np.asarray(level, dtype=np.int64)
        out.append(RegionLevel(a[:, 0], a[:, 1] - a[:, 0], a[:, 2], a[:, 3] - a[:, 2]))
    return tuple(out)
