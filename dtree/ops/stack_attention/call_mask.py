"""One stack-attention call as a single masked attention over stack slots ``[0, base + T)``.

When the call's own K/V sit in the stack right after the slots below it (row ``r`` of the
call is slot ``base + r``), every row's keys are slots of one tensor, ``stack[:base + T]``,
and the call is one attention with a mask: no prefix levels, no log-sum-exp merge. The
mask is the call's tree, encoded as one row interval per slot::

    visible(r, s) = slot_row_lo[s] <= r < slot_row_hi[s]

* a slot of the call (``s >= base``) is seen by its own row and the rows after it in its
  segment's subtree: ``[s - base, subtree end - base)`` (the call's segments are laid out
  depth first, so a subtree is a contiguous run of rows);
* a slot below the call is seen by the rows of the segments that have it in their prefix,
  which are one contiguous run of rows for the same reason (``[0, 0)`` when none read it).

:func:`call_mask` builds the two tables from a :class:`.SegmentLayout` and checks that
they give exactly the layout's prefix ranges; a layout they cannot express (not depth
first, own slots elsewhere) gives None and the caller keeps its region path. The kernel's
mask function reads two integers per key column.

The block tables: for tiles of :data:`BLOCK` rows x :data:`BLOCK` slots, which tiles are
fully visible (no mask needed), partially visible (masked) or skipped, per row tile (the
forward's lists) and per slot tile (the backward's), as flash-attn-4's block sparsity
takes them. Computed per (segment, row tile) piece from interval counts, not per element.

Host-side numpy, built once per call layout (cached on it) and shared by its layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .segment_layout import SegmentLayout

__all__ = ["BLOCK", "PACKED_MAX_ROWS", "CallMask", "call_mask", "dense_visibility", "inclusive_bounds",
           "kernel_tables", "packed_bounds", "table_length", "visible_from_packed", "visible_from_tables"]

BLOCK = 128  # rows and slots per tile of the block tables (flash-attn-4's sparse block on Hopper)
PACKED_MAX_ROWS = 1 << 15  # a packed bound's last row stays under 2**15: lo + 65536 * last fits an int32


@dataclass(frozen=True)
class BlockLists:
    """For each of ``n`` tiles along one side, the tiles of the other side it meets:
    ``partial_cnt [n]``, ``partial_idx [n, max(1, most)]`` (ascending, padded with 0),
    and likewise ``full_cnt``/``full_idx``. int32."""

    partial_cnt: np.ndarray
    partial_idx: np.ndarray
    full_cnt: np.ndarray
    full_idx: np.ndarray


@dataclass(frozen=True)
class CallMask:
    """A call as one masked attention (see the module docstring).

    Attributes:
        base: the call's first stack slot; T = ``num_rows``, ``num_keys`` = base + T.
        slot_row_lo, slot_row_hi: [num_keys] int32.
        by_row_tile: the forward's block lists (per row tile, the slot tiles).
        by_slot_tile: the backward's (per slot tile, the row tiles).
    """

    base: int
    num_rows: int
    slot_row_lo: np.ndarray
    slot_row_hi: np.ndarray
    by_row_tile: BlockLists
    by_slot_tile: BlockLists

    @property
    def num_keys(self) -> int:
        return self.base + self.num_rows


def call_mask(layout: SegmentLayout) -> CallMask | None:
    """The call of ``layout`` as one masked attention, or None when the two tables
    cannot express it (cached on the layout)."""
    return layout.cached(("call_mask",), lambda: _build(layout))


def _coalesce(ranges) -> list[list[int]]:
    out: list[list[int]] = []
    for lo, hi in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and out[-1][1] >= lo:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


class _CallSegments(NamedTuple):
    """A call's non-empty segments (``S``), in row order: [S] first row ``q0``, ``length``, one past the last row
    ``q1``, first own slot ``start`` and one past the last ``end``; the call's ``rows`` and first own slot ``base``."""

    q0: np.ndarray
    length: np.ndarray
    q1: np.ndarray
    start: np.ndarray
    end: np.ndarray
    rows: int
    base: int


def _call_segments(layout: SegmentLayout) -> tuple[_CallSegments, np.ndarray] | None:
    """(the call's segments, [S] their indices in ``layout``), or None: no rows, or own slots that are not the rows
    shifted by one base."""
    q_off = np.asarray(layout.q_offsets, dtype=np.int64)
    own = np.asarray(layout.own_slot, dtype=np.int64)
    rows = int(q_off[-1])
    seg = np.flatnonzero(np.diff(q_off) > 0)  # non-empty segments, in row (and slot) order
    if rows == 0 or not len(seg):
        return None
    base = int(own[seg[0]] - q_off[seg[0]])
    q0, length = q_off[seg], np.diff(q_off)[seg]
    start = own[seg]
    if base < 0 or np.any(start != base + q0):
        return None
    return _CallSegments(q0, length, q0 + length, start, start + length, rows, base), seg


def _tables(s: _CallSegments, read, first_row, last_row, ancestors, owner, lo, hi) -> CallMask | None:
    """The mask from the slots below the call (``read``: [base] rows reading each, ``first_row``, ``last_row``: the
    run they form), the segments' in-call ancestors ([S, S]) and every range they read (``owner``, ``lo``, ``hi``);
    None when those rows are not one run or the segments are not laid out depth first."""
    if np.any((read > 0) & (read != last_row - first_row)):
        return None  # a slot below the call is read by rows that are not one run
    # a segment's subtree: itself and every segment that has it as an in-call ancestor
    subtree_end = np.where(ancestors | np.eye(len(s.q0), dtype=bool), s.q1[:, None], 0).max(axis=0)
    encoded = (s.q0[None, :] < s.q0[:, None]) & (s.q0[:, None] < subtree_end[None, :])
    if not np.array_equal(encoded, ancestors):
        return None  # the call's segments are not laid out depth first
    slot_row_lo = np.concatenate([np.where(read > 0, first_row, 0), np.arange(s.rows)]).astype(np.int32)
    slot_row_hi = np.concatenate([np.where(read > 0, last_row, 0), np.repeat(subtree_end, s.length)]).astype(np.int32)
    counts = _interval_tile_counts(lo, hi, owner, len(s.q0), -(-(s.base + s.rows) // BLOCK))
    by_row, by_slot = _block_lists(s.q0, s.q1, s.start, counts, s.rows, s.base + s.rows, s.base)
    return CallMask(s.base, s.rows, slot_row_lo, slot_row_hi, by_row, by_slot)


def _build(layout: SegmentLayout) -> CallMask | None:
    """The call's tables and block lists, every interval at once: on a 32k-token call of the 256k agentic tree
    the reference (:func:`_build_reference`) spent ~5 ms in numpy calls per interval over the slots below the call."""
    found = _call_segments(layout)
    if found is None:
        return None
    s, seg = found
    owner, lo, hi = _coalesced([layout.prefix_ranges[i] for i in seg])
    below = lo < s.base
    read, first_row, last_row = _below_the_call(lo[below], np.minimum(hi[below], s.base), owner[below], s.q0, s.q1,
                                                s.base)
    ancestors = _in_call_ancestors(np.maximum(lo, s.base), hi, owner, s.start, s.end, s.base)
    if ancestors is None:
        return None  # an in-call range that is not whole earlier segments of the call
    return _tables(s, read, first_row, last_row, ancestors, owner, lo, hi)


def _coalesced(ranges: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner, lo, hi) [I] int64: each segment's ranges (``ranges[owner]``) sorted, the empty ones dropped and the
    overlapping or adjacent ones merged (what :func:`_coalesce` gives per segment)."""
    counts = [len(r) for r in ranges]
    flat = np.array([x for r in ranges for x in r], dtype=np.int64).reshape(-1, 2)
    owner, lo, hi = np.repeat(np.arange(len(ranges)), counts), flat[:, 0], flat[:, 1]
    keep = hi > lo
    owner, lo, hi = owner[keep], lo[keep], hi[keep]
    if not len(lo):
        return owner, lo, hi
    order = np.lexsort((lo, owner))
    owner, lo, hi = owner[order], lo[order], hi[order]
    shift = owner * (int(hi.max()) + 1)  # one owner's ranges above every earlier owner's
    reach = np.maximum.accumulate(hi + shift)  # the furthest any earlier range of the owner reaches
    cuts = np.flatnonzero(np.r_[True, lo[1:] + shift[1:] > reach[:-1]])
    return owner[cuts], lo[cuts], np.maximum.reduceat(hi, cuts)


def _below_the_call(lo, top, owner, q0, q1, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([base] rows reading each slot below the call, [base] the first of them, [base] one past the last; ``rows``
    and 0 where none reads it) from the ranges ``[lo, top)`` of segments ``owner`` (rows ``[q0, q1)`` each).
    Over the pieces the ranges' ends cut the slots into, in blocks of ranges (bounded memory)."""
    rows = int(q1[-1])
    readers = np.zeros(base + 1, dtype=np.int64)
    np.add.at(readers, lo, q1[owner] - q0[owner])
    np.add.at(readers, top, q0[owner] - q1[owner])
    first_row, last_row = np.full(base, rows, dtype=np.int64), np.zeros(base, dtype=np.int64)
    if not len(lo):
        return np.cumsum(readers[:-1]), first_row, last_row
    cuts = np.unique(np.concatenate([lo, top]))
    a, z = np.searchsorted(cuts, lo), np.searchsorted(cuts, top)  # each range: pieces [a, z)
    piece = np.arange(len(cuts) - 1)
    first, last = np.full(len(piece), rows, dtype=np.int64), np.zeros(len(piece), dtype=np.int64)
    step = max(1, (1 << 22) // max(1, len(piece)))
    for b in range(0, len(lo), step):
        cover = (piece[None, :] >= a[b : b + step, None]) & (piece[None, :] < z[b : b + step, None])
        o = owner[b : b + step, None]
        first = np.minimum(first, np.where(cover, q0[o], rows).min(axis=0))
        last = np.maximum(last, np.where(cover, q1[o], 0).max(axis=0))
    sizes = np.diff(cuts)
    first_row[cuts[0] : cuts[-1]] = np.repeat(first, sizes)
    last_row[cuts[0] : cuts[-1]] = np.repeat(last, sizes)
    return np.cumsum(readers[:-1]), first_row, last_row


def _in_call_ancestors(lo, hi, owner, start, end, base: int) -> np.ndarray | None:
    """[S, S] bool, ``[i, j]``: segment ``j`` is an in-call ancestor of ``i``, from the ranges reaching above
    ``base`` (``[lo, hi)`` of ``owner``, ``lo`` clipped to ``base``); None when one is not whole earlier segments."""
    n = len(start)
    reach = hi > base
    lo, hi, owner = lo[reach], hi[reach], owner[reach]
    first, last = np.searchsorted(start, lo), np.searchsorted(end, hi, side="right")
    whole = (first < last) & (last <= owner)
    if not np.all(whole):
        return None
    if np.any(start[first] != lo) or np.any(end[last - 1] != hi):
        return None
    marks = np.zeros((n, n + 1), dtype=np.int64)
    np.add.at(marks, (owner, first), 1)
    np.add.at(marks, (owner, last), -1)
    return np.cumsum(marks, axis=1)[:, :n] > 0


def _build_reference(layout: SegmentLayout) -> CallMask | None:
    """:func:`_build` one interval at a time (the reference it is tested on)."""
    found = _call_segments(layout)
    if found is None:
        return None
    (q0, length, q1, start, end, rows, base), seg = found
    ancestors = np.zeros((len(seg), len(seg)), dtype=bool)  # [i, j]: j is an in-call ancestor of i
    first_row = np.full(base, rows, dtype=np.int64)  # below the call: the rows that read each slot
    last_row = np.zeros(base, dtype=np.int64)
    readers = np.zeros(base + 1, dtype=np.int64)  # difference array of the rows reading each slot
    intervals: list[tuple[int, int, int]] = []  # (segment, lo, hi): every slot range a segment reads
    for a, i in enumerate(seg):
        for lo, hi in _coalesce(layout.prefix_ranges[i]):
            intervals.append((a, lo, hi))
            if lo < base:
                top = min(hi, base)
                np.minimum(first_row[lo:top], q0[a], out=first_row[lo:top])
                np.maximum(last_row[lo:top], q1[a], out=last_row[lo:top])
                readers[lo] += length[a]
                readers[top] -= length[a]
            if hi > base:
                lo = max(lo, base)
                first, last = np.searchsorted(start, lo), np.searchsorted(end, hi, side="right")
                if first >= last or start[first] != lo or end[last - 1] != hi or last > a:
                    return None  # not whole earlier segments of the call
                ancestors[a, first:last] = True
    owner, lo, hi = np.asarray(intervals, dtype=np.int64).reshape(-1, 3).T
    return _tables(found[0], np.cumsum(readers[:-1]), first_row, last_row, ancestors, owner, lo, hi)


def _interval_tile_counts(lo: np.ndarray, hi: np.ndarray, owner: np.ndarray, owners: int, tiles: int) -> np.ndarray:
    """[owners, tiles]: for intervals ``[lo, hi)`` of ``owner``, how many of each tile's
    slots they cover (intervals of one owner are disjoint)."""
    counts = np.zeros((owners, tiles + 1), dtype=np.int64)
    keep = hi > lo
    lo, hi, owner = lo[keep], hi[keep], owner[keep]
    t0, t1 = lo // BLOCK, (hi - 1) // BLOCK
    one = t0 == t1
    np.add.at(counts, (owner[one], t0[one]), (hi - lo)[one])
    many = ~one
    o, a, b, l, h = owner[many], t0[many], t1[many], lo[many], hi[many]
    np.add.at(counts, (o, a), (a + 1) * BLOCK - l)
    np.add.at(counts, (o, b), h - b * BLOCK)
    whole = np.zeros_like(counts)  # tiles a+1 .. b-1 whole: a difference array along the tiles
    np.add.at(whole, (o, a + 1), BLOCK)
    np.add.at(whole, (o, b), -BLOCK)
    counts += np.cumsum(whole, axis=1)
    return counts[:, :tiles]


def _block_lists(q0, q1, start, seg_counts, rows, num_keys, base) -> tuple[BlockLists, BlockLists]:
    """Full and partial tiles. A row's visible count in a slot tile is its segment's
    count plus its own causal part; over the rows of one segment inside one row tile the
    own part grows with the row, so the tile's least count is at a piece's first row and
    its largest at a piece's last row."""
    row_tiles, slot_tiles = -(-rows // BLOCK), -(-num_keys // BLOCK)
    first_tile, last_tile = q0 // BLOCK, (q1 - 1) // BLOCK
    per_seg = last_tile - first_tile + 1
    piece_seg = np.repeat(np.arange(len(q0)), per_seg)
    piece_tile = first_tile[piece_seg] + (np.arange(per_seg.sum()) - np.repeat(np.cumsum(per_seg) - per_seg, per_seg))
    r_first = np.maximum(q0[piece_seg], piece_tile * BLOCK)
    r_last = np.minimum(q1[piece_seg], (piece_tile + 1) * BLOCK) - 1
    tile_lo = np.arange(slot_tiles) * BLOCK
    own_lo = start[piece_seg][:, None]

    def own_count(r):  # [pieces, slot tiles]: |[own start, base + r] ∩ tile|
        hi = np.minimum((base + r + 1)[:, None], tile_lo[None, :] + BLOCK)
        return np.clip(hi - np.maximum(own_lo, tile_lo[None, :]), 0, None)

    least = seg_counts[piece_seg] + own_count(r_first)
    most = seg_counts[piece_seg] + own_count(r_last)
    # the segments' rows are one run in segment order, so their pieces come in tile order already
    cuts = np.flatnonzero(np.r_[True, piece_tile[1:] != piece_tile[:-1]])
    least = np.minimum.reduceat(least, cuts, axis=0)
    most = np.maximum.reduceat(most, cuts, axis=0)
    size = np.minimum(BLOCK, num_keys - tile_lo)
    full = least == size[None, :]
    partial = (most > 0) & ~full
    assert len(cuts) == row_tiles  # every row tile holds rows of some segment
    return _lists(partial, full), _lists(partial.T, full.T)


def _lists(partial: np.ndarray, full: np.ndarray) -> BlockLists:
    def packed(mask):
        cnt = mask.sum(axis=1).astype(np.int32)
        idx = np.zeros((mask.shape[0], max(1, int(cnt.max(initial=0)))), dtype=np.int32)
        r, c = np.nonzero(mask)  # row-major: ascending columns within a row
        pos = np.arange(len(r)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        idx[r, pos] = c
        return cnt, idx

    return BlockLists(*packed(partial), *packed(full))


def visible_from_tables(mask: CallMask) -> np.ndarray:
    """[T, num_keys] bool: the mask the two tables give (what the kernel's mask function
    computes per element)."""
    r = np.arange(mask.num_rows)[:, None]
    return (mask.slot_row_lo[None, :] <= r) & (r < mask.slot_row_hi[None, :])


def packed_bounds(mask: CallMask) -> np.ndarray | None:
    """[num_keys] int32 ``lo + 65536 * last``: row ``m`` sees slot ``n`` iff ``lo <= m <= last``, the two
    tables' ``[slot_row_lo, slot_row_hi)`` in one word (``last`` = hi - 1; a slot no row reads gets lo 1,
    last 0). None for a call of more than :data:`PACKED_MAX_ROWS` rows.

    Why one word: flash-attn-4 evaluates the mask function on every score of a partially visible tile, and
    its Hopper backward ran 9-14% faster on the 256k and 64k agentic trees' calls with the bounds decoded
    from one load (floor division and modulo by 65536) than from two (``benchmarks/mask_tile_cost.py``)."""
    if mask.num_rows > PACKED_MAX_ROWS:
        return None
    lo, last = inclusive_bounds(mask)
    return (lo + 65536 * last).astype(np.int32)


def inclusive_bounds(mask: CallMask) -> tuple[np.ndarray, np.ndarray]:
    """([num_keys] lo, [num_keys] last) int64: slot ``n`` is seen by rows ``lo <= m <= last`` (``last`` = hi - 1;
    a slot no row reads gets lo 1, last 0)."""
    lo, hi = mask.slot_row_lo.astype(np.int64), mask.slot_row_hi.astype(np.int64)
    unread = hi <= lo
    return np.where(unread, 1, lo), np.where(unread, 0, hi - 1)


def table_length(num_keys: int) -> int:
    """Entries of a kernel table for a call of ``num_keys`` slots: every key tile's whole width (a kernel
    that reads each key's bounds once per tile reads the last tile's keys past the call too), and one
    tile more, so a tile size that is not :data:`BLOCK` stays inside."""
    return -(-num_keys // BLOCK) * BLOCK + BLOCK


def kernel_tables(mask: CallMask) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(slot_row_lo, slot_row_hi, packed_bounds or None) as the kernel reads them: [table_length(num_keys)]
    int32, each padded past the call's keys with bounds no row is in (lo 0, hi 0; the word 1: lo 1, last 0),
    so those keys come out masked without a check against the call's length
    (:mod:`dtree.ops.stack_attention.flash4_slot_bounds`)."""
    n = table_length(mask.num_keys)

    def padded(table: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(n, fill, dtype=np.int32)
        out[: len(table)] = table
        return out

    packed = packed_bounds(mask)
    return (padded(mask.slot_row_lo, 0), padded(mask.slot_row_hi, 0),
            None if packed is None else padded(packed, 1))


def visible_from_packed(words: np.ndarray, num_rows: int) -> np.ndarray:
    """[num_rows, len(words)] bool: the mask the packed words give, decoded as the kernel's mask function
    decodes them."""
    r = np.arange(num_rows)[:, None]
    words = words.astype(np.int64)[None, :]
    return (words % 65536 <= r) & (r <= words // 65536)


def dense_visibility(layout: SegmentLayout, num_keys: int) -> np.ndarray:
    """[T, num_keys] bool straight from the layout: row ``r`` of segment ``i`` sees its
    prefix ranges and its own slots up to its own (the reference the tables are tested on)."""
    q_off = np.asarray(layout.q_offsets, dtype=np.int64)
    out = np.zeros((int(q_off[-1]), num_keys), dtype=bool)
    for i in range(layout.num_segments):
        for r in range(int(q_off[i]), int(q_off[i + 1])):
            for lo, hi in layout.prefix_ranges[i]:
                out[r, lo:hi] = True
            own = int(layout.own_slot[i])
            out[r, own : own + r - int(q_off[i]) + 1] = True
    return out
