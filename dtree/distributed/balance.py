"""Multiway number partitioning: put items with costs on W bins, minimizing the largest bin.

Two classic heuristics (both NP-hard to beat in general; both O(n log n)):

* :func:`lpt` (Graham's Longest Processing Time): items from largest to smallest,
  each onto the currently lightest bin. Makespan at most ``4/3 - 1/(3W)`` of optimal.
* :func:`karmarkar_karp` (multiway largest differencing, Karmarkar & Karp 1982;
  Korf's generalization to W bins): every item starts as a W-tuple of bin sums
  ``(c, 0, ..., 0)``; repeatedly merge the two tuples with the largest spread
  (max - min), pairing the heaviest bin of one with the lightest of the other. It
  "commits" the big differences early and usually beats LPT when there are many
  items of similar size.

Both are deterministic: ties are broken by item index and bin index, never by hash
order, so every rank computes the same assignment from the same costs.
"""

from __future__ import annotations

import heapq
from typing import Sequence

__all__ = ["lpt", "karmarkar_karp", "makespan", "METHODS"]

METHODS = ("lpt", "kk")


def _check(costs: Sequence[float], bins: int) -> list[float]:
    if bins < 1:
        raise ValueError(f"need at least one bin, got {bins}")
    out = [float(c) for c in costs]
    if any(not (c >= 0) for c in out):  # also rejects NaN
        raise ValueError("item costs must be >= 0 (and not NaN)")
    return out


def makespan(costs: Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    """Largest bin sum of an assignment (lists of item indices per bin)."""
    return max((sum(costs[i] for i in b) for b in assignment), default=0.0)


def lpt(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Longest-processing-time-first. Returns per bin the item indices, ascending."""
    c = _check(costs, bins)
    order = sorted(range(len(c)), key=lambda i: (-c[i], i))
    heap = [(0.0, b) for b in range(bins)]  # (load, bin): lightest first, then lowest bin index
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + c[i], b))
    return [sorted(b) for b in out]


def karmarkar_karp(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Multiway Karmarkar-Karp (largest differencing). Returns per bin the item
    indices, ascending; bin 0 gets the heaviest set."""
    c = _check(costs, bins)
    if not c:
        return [[] for _ in range(bins)]
    # A partial solution: bin sums sorted heaviest first, with their item tuples.
    # Heap key: (-spread, creation counter) -> the largest spread first, ties by age.
    # Tuples, not lists: the empty bins of every item share the one empty tuple, so a
    # partition over many ranks does not allocate items x bins lists (at 64 ranks, the
    # garbage collector walking those took most of a 12 s plan; now 2 s).
    heap: list[tuple[float, int, list[float], list[tuple[int, ...]]]] = []
    counter = 0
    empty: tuple[int, ...] = ()
    for i in sorted(range(len(c)), key=lambda i: (-c[i], i)):
        sums = [c[i]] + [0.0] * (bins - 1)
        sets = [(i,)] + [empty] * (bins - 1)
        heap.append((-c[i], counter, sums, sets))
        counter += 1
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, sa, xa = heapq.heappop(heap)
        _, _, sb, xb = heapq.heappop(heap)
        # heaviest of one with lightest of the other: both lists are sorted heaviest first
        merged = [(sa[k] + sb[bins - 1 - k], xa[k] + xb[bins - 1 - k]) for k in range(bins)]
        # stable sort by sum, heaviest first; equal sums keep their order (deterministic)
        merged.sort(key=lambda p: -p[0])
        sums = [p[0] for p in merged]
        sets = [p[1] for p in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), counter, sums, sets))
        counter += 1
    _, _, sums, sets = heap[0]
    # heaviest bin first; equal loads ordered by their smallest item, empty bins last
    order = sorted(range(bins), key=lambda k: (-sums[k], min(sets[k], default=len(c))))
    return [sorted(sets[k]) for k in order]
