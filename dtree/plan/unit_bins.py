"""Sibling units of a frontier into calls: which units share a call of at most ``budget`` tokens.

A frontier's units (a closed segment with its subtree, or an open segment with the large parts
below it: :class:`dtree.plan.schedule._GroupPacker`) are siblings: they attend to the same stack
below their parent group's top and to nothing of each other, so any of them may share a call.
Packing them in frontier order (next fit) leaves a small call wherever the next unit does not fit:
six calls where five hold the 64k agentic tree at 16k tokens. A small call's host work is what the
GPU waits for once the launch queue drains (session AJ's queue depths), and every call adds its
fixed per-layer host cost.

:func:`pack_units` takes first fit over the units largest first, or the frontier order where that
needs fewer calls (first fit decreasing is not always optimal). :data:`PACKERS` names both for
the benchmarks that compare them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["PACK", "PACKERS", "first_fit_decreasing", "frontier_order", "pack_units"]


def frontier_order(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Next fit in frontier order: a new bin whenever the next unit does not fit the current one.

    ``sizes[i]``: unit ``i``'s tokens -> bins of unit indices, in order. ``budget=0``: one bin per
    unit. A unit larger than ``budget`` gets a bin of its own."""
    bins: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if i == 0 or budget == 0 or size + n > budget:
            bins.append([])
            size = 0
        bins[-1].append(i)
        size += n
    return bins


def first_fit_decreasing(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """First fit, largest unit first (ties in frontier order): each unit into the first bin it fits.

    Same contract as :func:`frontier_order`; bins in the order they were opened (largest first unit
    first), each bin's units in the order they were added."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fit = next((b for b, r in enumerate(room) if sizes[i] <= r), None) if budget else None
        if fit is None:
            bins.append([i])
            room.append(budget - sizes[i])
        else:
            bins[fit].append(i)
            room[fit] -= sizes[i]
    return bins


def pack_units(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """The fewer bins of :func:`first_fit_decreasing` and :func:`frontier_order` (ties: the first)."""
    packed = first_fit_decreasing(sizes, budget)
    in_order = frontier_order(sizes, budget)
    return in_order if len(in_order) < len(packed) else packed


PACKERS: dict[str, Callable[[Sequence[int], int], list[list[int]]]] = {
    "fewest": pack_units, "first_fit_decreasing": first_fit_decreasing, "frontier_order": frontier_order}

PACK = pack_units
"""The packer every schedule uses; a process setting (``benchmarks/options_ab.py``'s ``packing=``
arms set it to one of :data:`PACKERS` before each step), read at each :func:`~dtree.plan.schedule.pack_budgets`."""
