"""The host side of every launch of the fused ``triton`` stack-attention kernels: the
configs tried per kernel and tile, the launch that falls through to the next config that
fits, the tile sizes, and the work tables (query blocks, own and prefix dK/dV items)
built once per layout.
"""

from __future__ import annotations

import numpy as np
import torch

from ...device.transfer import upload
from ..fast_launch import fast_launch
from .segment_layout import SegmentLayout
from .triton_backward import _dkdv_kernel, _dq_kernel
from .triton_common import _INTERPRET, _OWN, _PREFIX, PREFIX_ITEM_ROWS, InterpreterTiles, _Tuning, triton
from .triton_forward import _fwd_kernel

# --------------------------------------------------------------------------- tuning
# Candidates as (inner tile, num_warps, num_stages), per kernel and per work-table tile
# (chosen on the host by _tiles). The inner tile is BLOCK_N (keys per step) for the
# forward and dq, BLOCK_M (rows per step) for dK/dV. The first candidate that fits the
# GPU's shared memory runs (fp32: the smallest first).
#
# 128-row/key tables (16-bit, head dims up to 128): first come the configs the
# autotuner picked on an H200 (bf16, 32/8 heads of 128, every layout of
# benchmarks/bench_stack_attention.py: benchmarks/results/stack_attention_nvidia_h200.md).
# They compile for sm_90 without register spills at head dims 64 and 128, with and
# without options (benchmarks/kernel_registers.py: ptxas through triton.compile, no GPU
# needed; the dK/dV kernel keeps 240 registers plain, 247-254 with options). The forward's 128-key step needs 224 KB of shared
# memory at head dim 128: an A100 (164 KB) falls through to the next candidate.
# 64 tables (fp32, head dims above 128): 8 warps first, the only configs found
# without spills at head dims 192/128 (MLA) and 256 in bf16 and 64/128 in fp32
# (4 warps spill 300-1700 bytes in dq and dK/dV there; 88 bytes remain in the MLA
# dK/dV kernel with every option on).
# Dropped for spilling at 128: 4 warps on 128-row tiles (forward and dq 136-352 bytes,
# dK/dV over 1 KB), 64-row inner tiles in dK/dV (16-1720 bytes) and 32-row ones with 3
# stages. (A timed autotuning path, DTREE_TRITON_AUTOTUNE=1, was removed: its first
# call compiled and timed every candidate and gave different results from the second.)
#
# Calls without softcap or ALiBi (the flags that add score transforms to the backward)
# first try _PLAIN_FIRST, the fastest configs of an H100 sweep (bf16, head dim 128,
# 12/2 and 32/8 heads, grpo and agentic: benchmarks/bench_triton_tuning.py,
# results/h100/kernel_session2): dq 128-key steps -22 to -26% against 64-key ones,
# dK/dV 64-row steps -12 to -21% against 32-row ones; the same winner on every layout
# and head count, so one config serves all. They run near the register limit (dq 255
# registers, no spill; dK/dV 192 bytes of spill at head dim 128, which cost less than
# the smaller step's extra passes over the keys); with softcap or ALiBi they would
# spill 340-620 bytes, so those calls keep the candidates below (dq's 64-key step with
# 3 stages, no spill with every option, came second in the sweep).
#
# The fused backward's dK/dV kernel ("fused": FUSED_DQ, not yet timed on a GPU) takes the
# dK/dV candidates, and the same 64-row step first for plain calls (ptxas, sm_90, head
# dim 128: 255 registers and 220 bytes of spill, against 192 for the split one); the
# 32-row step spills nothing (238 registers) but its dq product, 32 rows tall, is below
# the warpgroup MMA's 64 and runs on mma.sync. bench_triton_tuning.py times both.
_CANDIDATES = {
    ("fwd", 128): [(128, 8, 3), (64, 8, 3), (64, 8, 2), (32, 8, 2)],
    ("fwd", 64): [(64, 8, 2), (64, 4, 3), (32, 8, 2), (32, 4, 2)],
    ("dq", 128): [(64, 8, 3), (64, 8, 2), (32, 8, 3), (32, 8, 2)],
    ("dq", 64): [(32, 8, 2), (32, 4, 3), (64, 4, 3), (32, 4, 2)],
    ("dkdv", 128): [(32, 8, 2), (16, 8, 2), (16, 8, 3)],
    ("dkdv", 64): [(16, 8, 2), (16, 4, 2), (16, 4, 3), (32, 8, 2)],
    ("fused", 128): [(32, 8, 2), (16, 8, 2), (16, 8, 3)],
    ("fused", 64): [(16, 8, 2), (16, 4, 2), (16, 4, 3), (32, 8, 2)],
}
_PLAIN_FIRST = {("dq", 128): (128, 8, 2), ("dkdv", 128): (64, 8, 2), ("fused", 128): (64, 8, 2)}
_INNER_NAME = {"fwd": "BLOCK_N", "dq": "BLOCK_N", "dkdv": "BLOCK_M", "fused": "BLOCK_M"}
_TABLE_NAME = {"fwd": "BLOCK_M", "dq": "BLOCK_M", "dkdv": "BLOCK_N", "fused": "BLOCK_N"}
_FLAGS = {
    "fwd": ["HAS_SOFTCAP", "HAS_SINKS", "HAS_ALIBI", "HAS_WINDOW"],
    "dq": ["HAS_SOFTCAP", "HAS_ALIBI", "HAS_WINDOW"],
    "dkdv": ["HAS_SOFTCAP", "HAS_ALIBI", "HAS_WINDOW"],
    "fused": ["HAS_SOFTCAP", "HAS_ALIBI", "HAS_WINDOW"],
}


_KEYED_FLAGS = ("DETERMINISTIC", "STACK_GRAD")  # besides HAS_*: constexprs that change the config that fits
# "fused" is the dK/dV kernel with FUSED_DQ (the fused backward), tuned on its own
_KERNELS = {"fwd": _fwd_kernel, "dq": _dq_kernel, "dkdv": _dkdv_kernel, "fused": _dkdv_kernel}
# (kernel, table tile, dtype, device, head dims, group, flags) -> index of the first
# candidate that launched, so the fall-through below runs once per key
_FITTING: dict = {}


def _fixed_candidates(
    kernel: str, table: int, dtype: torch.dtype, score_transform: bool = False
) -> list[tuple[int, int, int]]:
    """The configs to try in order; ``score_transform``: the call has softcap or ALiBi."""
    candidates = _CANDIDATES[(kernel, table)]
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory: smallest first, 8 warps first
        return sorted(candidates, key=lambda c: (c[0], c[2], -c[1]))
    first = _PLAIN_FIRST.get((kernel, table))
    return candidates if first is None or score_transform else [first, *candidates]


def _launch(kernel: str, table: int, dtype: torch.dtype, grid: tuple, args: tuple, meta: dict, tuning: _Tuning) -> None:
    """Launch ``kernel`` ("fwd", "dq", "dkdv") on ``grid``: under the interpreter with
    its small tiles, else the config ``tuning`` forces, else the first fixed candidate
    that fits the device (a launch that runs out of shared memory raises before the
    kernel starts, so trying the next one adds nothing twice)."""
    name = _INNER_NAME[kernel]
    if _INTERPRET:
        _KERNELS[kernel][grid](*args, **meta, **{name: tuning.interpreter_tiles.inner})
        return
    forced = dict(tuning.configs).get(kernel)
    if forced is not None:
        inner, warps, stages = forced
        fast_launch(_KERNELS[kernel], grid, *args, **meta, **{name: inner}, num_warps=warps, num_stages=stages)
        return
    flags = tuple(sorted((f, v) for f, v in meta.items() if f.startswith("HAS_") or f in _KEYED_FLAGS))
    key = (kernel, table, dtype, args[0].device, meta["HEAD_DIM"], meta["V_DIM"], meta["GROUP"], *flags)
    transform = meta.get("HAS_SOFTCAP", False) or meta.get("HAS_ALIBI", False)
    candidates = _fixed_candidates(kernel, table, dtype, transform)
    for i in range(_FITTING.get(key, 0), len(candidates)):
        inner, warps, stages = candidates[i]
        try:
            fast_launch(_KERNELS[kernel], grid, *args, **meta, **{name: inner}, num_warps=warps, num_stages=stages)
        except triton.runtime.errors.OutOfResources:
            continue
        _FITTING[key] = i
        return
    raise RuntimeError(
        f"no config of the {kernel} kernel fits this GPU's shared memory (head dims {meta['HEAD_DIM']}/"
        f"{meta['V_DIM']}, {dtype}); use attention='sdpa'"
    )


def _tiles(head_dim: int, v_head_dim: int, dtype: torch.dtype, tiles: InterpreterTiles) -> tuple[int, int]:
    """(q-block rows of the forward/dq work items, kv-block keys of the dK/dV items).

    128 for 16-bit inputs; 64 for fp32 (shared memory) and for head dims above 128
    (registers of the [tile, 256] fp32 accumulators). The forest plays no part: a tile
    that followed the forest (it used to drop to 64 for short runs) compiled a second
    set of kernels whenever a later step's forest crossed the threshold."""
    if _INTERPRET:
        return tiles.q_block, tiles.kv_block
    if dtype == torch.float32 or max(head_dim, v_head_dim) > 128:
        return 64, 64
    return 128, 128


# --------------------------------------------------------------------------- tables
def _split(lo: np.ndarray, hi: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every ``[lo[i], hi[i])`` into pieces of at most ``step``: (owner i, start, end)."""
    n = -(-(hi - lo) // step)
    owner = np.repeat(np.arange(len(lo)), n)
    first = np.repeat(np.cumsum(n) - n, n)
    start = lo[owner] + (np.arange(int(n.sum())) - first) * step
    return owner, start, np.minimum(start + step, hi[owner])


def _split_on_grid(lo: np.ndarray, hi: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every non-empty ``[lo[i], hi[i])`` at the multiples of ``step``: (owner i,
    start, end), each piece inside one cell ``[j * step, (j + 1) * step)``."""
    first = lo // step
    n = np.where(hi > lo, -(-hi // step) - first, 0)
    owner = np.repeat(np.arange(len(lo)), n)
    cell = first[owner] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return owner, np.maximum(lo[owner], cell * step), np.minimum(hi[owner], (cell + 1) * step)


def _turns(table: np.ndarray, block_n: int) -> np.ndarray:
    """Each prefix item's turn among the prefix items of its stack cell (c0 // block_n),
    in table order (0 for own items)."""
    turn = np.zeros(len(table), dtype=np.int64)
    idx = np.flatnonzero(table[:, 0] == _PREFIX)
    if len(idx):
        cells = table[idx, 1] // block_n
        order = np.argsort(cells, kind="stable")
        sorted_cells = cells[order]
        starts = np.r_[0, np.flatnonzero(np.diff(sorted_cells)) + 1]
        group_start = np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        turn[idx[order]] = np.arange(len(order)) - group_start
    return turn


def _by_cost(table: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Most expensive work items first, so that the longest programs start early and
    the short ones fill the tail."""
    return np.ascontiguousarray(table[np.argsort(-cost, kind="stable")], dtype=np.int32)


def _runs(layout: SegmentLayout) -> dict:
    """Host description of the call: runs of consecutive non-empty segments with the
    same prefix ranges, and per-row segment bounds."""
    return layout.cached(("triton", "runs"), lambda: _build_runs(layout))


def _build_runs(layout: SegmentLayout) -> dict:
    q_off = np.asarray(layout.q_offsets, dtype=np.int64)
    lens = np.diff(q_off)
    flat = [(int(lo), int(hi)) for r in layout.prefix_ranges for lo, hi in r]
    bad = [(lo, hi) for lo, hi in flat if not 0 <= lo <= hi]
    if bad:
        raise ValueError(f"prefix ranges must satisfy 0 <= lo <= hi, got {bad[0]}")
    runs = layout.runs()
    ranges = [r.ranges for r in runs]
    # the run's ranges in the device tables (flattened per segment): its first segment's
    range_offsets = np.concatenate([[0], np.cumsum([len(r) for r in layout.prefix_ranges])]).astype(np.int64)
    first = np.asarray([r.segment for r in runs], dtype=np.int64)
    seg_start = np.repeat(q_off[:-1], lens)
    return {
        "row_lo": np.asarray([r.row_lo for r in runs], dtype=np.int64),
        "row_hi": np.asarray([r.row_hi for r in runs], dtype=np.int64),
        "range_begin": range_offsets[first],
        "range_end": range_offsets[first + 1],
        "prefix_len": np.asarray([sum(hi - lo for lo, hi in r) for r in ranges], dtype=np.int64),
        "ranges": ranges,
        "slots_end": max((hi for _, hi in flat), default=0),
        "seg_start": seg_start,
        "seg_end": np.repeat(q_off[1:], lens),
        "row_depth": np.arange(int(q_off[-1]), dtype=np.int64) - seg_start,  # minus the run's prefix_len
    }


def _row_tables(layout: SegmentLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``seg_start [T]`` and ``seg_end [T]`` of every row's segment."""

    def build():
        runs = _runs(layout)
        t = upload(np.stack([runs["seg_start"], runs["seg_end"]]).astype(np.int32), device)
        return t[0], t[1]

    return layout.cached(("triton", "rows", device), build)


def _q_blocks(layout: SegmentLayout, device: torch.device, block_m: int) -> torch.Tensor:
    """[NB, 5] int32 forward/dq work items: (r0, r1, range_begin, range_end, prefix_len)."""

    def build():
        runs = _runs(layout)
        run, r0, r1 = _split(runs["row_lo"], runs["row_hi"], block_m)
        plen = runs["prefix_len"][run]
        table = np.stack([r0, r1, runs["range_begin"][run], runs["range_end"][run], plen], axis=1)
        cost = (r1 - r0) * (plen + r1 - runs["seg_start"][r0])
        return upload(_by_cost(table, cost), device)

    return layout.cached(("triton", "q", device, block_m), build)


def _kv_items(
    layout: SegmentLayout,
    device: torch.device,
    block_n: int,
    with_prefix: bool,
    window: int | None = None,
    prefix_item_rows: int = PREFIX_ITEM_ROWS,
) -> torch.Tensor:
    """[NI, 8] int32 dK/dV work items: (kind, c0, c1, q0, q1, kshift, plen, turn).

    Own items: keys ``[c0, c1)`` of a run, queries ``[c0, seg_end[c1 - 1])``. Prefix
    items (only ``with_prefix``): stack slots ``[c0, c1)`` of one of the run's ranges
    inside one ``block_n`` cell of the stack (at depths ``c + kshift``), and at most
    ``prefix_item_rows`` of the run's rows; ``turn``: the item's place among the prefix
    items of its cell, in table order (the deterministic add's order). With a window,
    the ranges are cut from the first slot the run's shallowest row sees (no item
    reads a slot that no row of its run sees), and only the items some of whose rows
    see some of their slots are kept."""

    def build():
        runs = _runs(layout)
        run, c0, c1 = _split(runs["row_lo"], runs["row_hi"], block_n)
        q1 = runs["seg_end"][c1 - 1] if len(c1) else c1
        zeros = np.zeros_like(c0)
        tables = [np.stack([np.full_like(c0, _OWN), c0, c1, c0, q1, zeros, runs["prefix_len"][run]], axis=1)]
        costs = [(c1 - c0) * (q1 - c0)]
        if with_prefix:
            prefix = _prefix_items(runs, block_n, window, prefix_item_rows)
            if prefix is not None:
                tables.append(prefix)
                costs.append((prefix[:, 2] - prefix[:, 1]) * (prefix[:, 4] - prefix[:, 3]))
        table = np.concatenate(tables)
        table = table[np.argsort(-np.concatenate(costs), kind="stable")]
        table = np.concatenate([table, _turns(table, block_n)[:, None]], axis=1)
        return upload(np.ascontiguousarray(table, dtype=np.int32), device)

    return layout.cached(("triton", "kv", device, block_n, with_prefix, prefix_item_rows, window), build)


def _auto_item_rows(runs: dict, block_n: int, kv_heads: int, sms: int) -> int:
    """``prefix_item_rows`` for a call: the most rows per prefix item (1024, 512, 256,
    128) at which the dK/dV launch still has four programs per SM (one fits an SM at
    a time). Fewer rows per item only add ordered adds or atomics per slot, which
    cost little; too few programs leave SMs idle (a 2048-slot prompt under 8 x 512
    answers with 2 kv heads: 64 own + 64 prefix programs at 1024 rows on 132 SMs)."""
    own = int(np.sum(-(-(runs["row_hi"] - runs["row_lo"]) // block_n)))
    chunks = np.zeros(len(runs["row_lo"]), dtype=np.int64)
    for r, ranges in enumerate(runs["ranges"]):
        for lo, hi in ranges:
            if hi > lo:
                chunks[r] += -(-hi // block_n) - lo // block_n
    rows = runs["row_hi"] - runs["row_lo"]
    for item_rows in (1024, 512, 256):
        if (own + int(np.sum(chunks * -(-rows // item_rows)))) * kv_heads >= 4 * sms:
            return item_rows
    return 128


def _prefix_items(runs: dict, block_n: int, window: int | None, prefix_item_rows: int) -> np.ndarray | None:
    """[NP, 7] int64 prefix work items of :func:`_kv_items` (None when no run reads a
    prefix slot): every run's prefix ranges cut at the multiples of ``block_n``, times
    its rows cut into ``prefix_item_rows``."""
    flat = []  # (run, first slot to read, hi, kshift: depth of slot s is s + kshift)
    for r, ranges in enumerate(runs["ranges"]):
        depth, plen = 0, int(runs["prefix_len"][r])
        for lo, hi in ranges:
            # with a window, a run's shallowest row (depth plen) sees the deepest slots
            first = lo if window is None else max(lo, lo - depth + plen - window + 1)
            if first < hi:
                flat.append((r, first, hi, depth - lo))
            depth += hi - lo
    if not flat:
        return None
    f_run, f_lo, f_hi, f_shift = (np.asarray(x, dtype=np.int64) for x in zip(*flat))
    owner, s0, s1 = _split_on_grid(f_lo, f_hi, block_n)
    c_run, c_shift = f_run[owner], f_shift[owner]
    split_run, qa, qb = _split(runs["row_lo"], runs["row_hi"], prefix_item_rows)
    split_starts = qa
    n_splits = np.bincount(split_run, minlength=len(runs["row_lo"]))
    first_split = np.cumsum(n_splits) - n_splits
    rep = n_splits[c_run]
    chunk = np.repeat(np.arange(len(s0)), rep)
    rank = np.arange(int(rep.sum())) - np.repeat(np.cumsum(rep) - rep, rep)  # the split's place in its run
    # Split-major order (every chunk's first row split, then every chunk's second...):
    # the items of one stack cell, equal in cost, then sit apart in the cost-sorted
    # table, so the ordered adds of the deterministic mode rarely wait on each other.
    order = np.lexsort((chunk, rank))
    chunk, rank = chunk[order], rank[order]
    split = first_split[c_run[chunk]] + rank
    s0, s1, shift, qa, qb = s0[chunk], s1[chunk], c_shift[chunk], qa[split], qb[split]
    plen = runs["prefix_len"][split_run[split]]
    if window is not None and len(qa):
        # the splits tile the rows in order, so reduceat gives each one's shallowest row
        split_min = np.minimum.reduceat(runs["row_depth"], split_starts)
        keep = plen + split_min[split] - (s1 - 1 + shift) < window
        s0, s1, shift, qa, qb, plen = (x[keep] for x in (s0, s1, shift, qa, qb, plen))
    return np.stack([np.full_like(s0, _PREFIX), s0, s1, qa, qb, shift, plen], axis=1)
