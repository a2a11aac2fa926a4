"""The memory policy's candidate plans, scored: one plan at a time (:func:`candidate`, the
reference) and all of a step's at once (:func:`candidate_scores`, what the policy runs).

A step scores ~770 candidates (GRPO case 1) to ~1,300 (a 64k agentic tree): call budgets x
checkpointed layers x how the path is kept x LM-head chunks x whether checkpointed layers
keep their attention outputs. One at a time that took 7-9 ms of the H100 host's time before
the first kernel of every step. :func:`candidate_scores` computes the same figures in
numpy: everything that depends on one knob only (bytes per token at a checkpoint count,
the head's bytes at a chunk and call size, a call's overhead at its size) is taken from
the scalar functions :func:`candidate` calls, once per distinct value, and the arithmetic
that combines them runs in the same order on float64 arrays, so every peak and cost is
bit for bit :func:`candidate`'s (``tests/test_plan_candidates.py``). The candidates are
columns (:class:`KnobGrid`, in the order of the nested loops that used to make them):
3.4 -> 0.65 ms per step on the development CPU.

:func:`choose` (the reference) and :func:`choose_index` pick the plan to run the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..models.protocol import ModelSpec
from .memory_model import (
    RECOMPUTE,
    RERUN_MATMUL_SHARE,
    SMALL_CALL_TOKENS,
    StepShape,
    _Figures,
    call_count,
    call_overhead_at,
    grads_at_peak,
    head_bytes,
)

__all__ = ["HEAD_CHUNK_PENALTY", "LEANER", "SLACK", "TIE", "KnobGrid", "Knobs", "Packed", "candidate", "candidate_scores",
           "choose", "choose_index", "fit_reason", "knob_grid", "kv_stack_bytes", "packed"]

# Plans within this fraction of the fastest predicted one count as equally fast; the
# one with the least memory among them is taken when it saves at least LEANER of the
# fastest one's peak (a colocated engine, a larger batch or a longer path can use it).
SLACK = 0.02  # at 5%, GRPO case 1's default checkpointed 9 layers once re-runs were priced as measured
LEANER = 0.2
# Plans predicted within this fraction of the fastest one are as fast as it as far as any run has
# told them apart: the leanest of them counts as the fastest. Session X: under memory=14.5 on the
# 64k tree, 27 checkpointed layers (predicted 0.2% faster than 28) ran 1.920 s at 13.19 GiB where
# 28 had run 1.850-1.896 s at 12.47; on the 256k tree under 19.9 GiB, 7.549 s at 17.00 GiB against
# 7.32-7.47 s at 15.57.
TIE = 0.005
HEAD_CHUNK_PENALTY = {4096: 0.0, 2048: 0.05, 1024: 0.15}  # of the LM head's share of a token
_OTHER_CHUNK_PENALTY = 0.15


@dataclass(frozen=True)
class Knobs:
    """One candidate plan's decisions."""

    group_tokens: int
    checkpoint: int
    path: int  # layers checkpointed in retained groups with children, or RECOMPUTE
    chunk: int
    keep: bool = False  # checkpointed layers keep their attention outputs


def _call_tokens(group_tokens: int, unique: int) -> int:
    return max(1, min(group_tokens if group_tokens > 0 else SMALL_CALL_TOKENS, unique))


def kv_stack_bytes(shape: StepShape, group_tokens: int, call: int, fixed: dict, windowed: bool = False) -> float:
    """Bytes of the KV stack a plan of ``group_tokens``-token calls (``call`` tokens each) takes:
    its schedule's K/V and gradient slots where the shape has them (:attr:`StepShape.stack_needs`),
    else the bound, the longest path plus a call with gradients in every slot. ``windowed``
    (every layer checkpointed, a backend whose leaf calls can run in a KV window: ``fixed["window"]``):
    the stack holds the groups with children (the gradient slots' reach) and the window every
    call's reach, for one layer (:func:`dtree.plan.stack_sizes.stack_sizes`)."""
    need = shape.stack_need(group_tokens)
    if need is None:
        return min(shape.unique_tokens, shape.longest_path + call) * fixed["slot_bytes"]
    kv, grads = need
    if windowed:
        return grads * fixed["slot_bytes"] + kv * fixed["window_slot_bytes"]
    return kv * (fixed["slot_bytes"] - fixed["grad_slot_bytes"]) + grads * fixed["grad_slot_bytes"]


@dataclass(frozen=True)
class Packed:
    """What a plan of ``group_tokens``-token calls is scored on: the largest call's tokens, the
    calls, the tokens of the path its walk retains at most, the tokens of the groups with children
    and their calls (what the path's retention keeps or its recompute runs again). From the
    budget's packing where the shape has it (:attr:`StepShape.packings`); else the bound: calls as
    large as the budget (:func:`call_count` of them), the longest path, the trie's nodes with
    children re-run in calls of the budget. On the 64k agentic tree's 32k-token schedule the
    groups with children hold 5.9k tokens where the trie's nodes with children hold 25.5k: the
    bound priced a recomputed path 4x and a retained one's memory 1.4x."""

    call: int
    calls: float
    path: int
    shared: int
    shared_calls: float
    shared_call: float  # tokens per call of the groups with children


def packed(shape: StepShape, group_tokens: int) -> Packed:
    """:class:`Packed` for ``shape``'s schedule of ``group_tokens``-token calls."""
    u, p = shape.unique_tokens, shape.packing(group_tokens)
    if p is not None:
        inner = p.calls_with_children
        return Packed(p.largest_call, float(p.calls), p.with_children, p.tokens_with_children, float(inner),
                      p.tokens_with_children / inner if inner else 0.0)
    call, shared = _call_tokens(group_tokens, u), min(shape.shared_tokens, u)
    reruns = float(math.ceil(shared / max(call, 1)))
    return Packed(call, call_count(u, call), min(shape.longest_path, shared), shared, reruns, min(call, shared))


def _windowed(fixed: dict, checkpoint, layers: int):
    """Whether plans checkpointing ``checkpoint`` of ``layers`` layers run leaf calls in a KV window."""
    return fixed.get("window", False) and checkpoint >= layers


def candidate(shape: StepShape, knobs: Knobs, fig: _Figures, spec: ModelSpec, fixed: dict) -> tuple[float, float, dict]:
    """(predicted peak bytes the step adds, predicted cost, parts) of one plan: its calls and path
    from the budget's packing where the shape has it, else from bounds (:func:`packed`); the KV
    stack likewise (:func:`kv_stack_bytes`). ``fixed``: the
    figures every candidate of the step shares (``memory_policy._shared_figures``)."""
    u = shape.unique_tokens
    pk = packed(shape, knobs.group_tokens)  # group_tokens=0 (one segment per call): calls of SMALL_CALL_TOKENS
    call, calls = pk.call, pk.calls
    cb = fig.call_bytes if not knobs.keep else fig.call_bytes_keeping
    retained = 0.0 if knobs.path == RECOMPUTE else pk.path * cb.call(knobs.path)
    kv = kv_stack_bytes(shape, knobs.group_tokens, call, fixed, _windowed(fixed, knobs.checkpoint, spec.num_layers))
    stack = max(0.0, kv + shape.state_slots * fixed["state_bytes"] - fixed["stack_held"])
    head = head_bytes(spec, fig.itemsize, knobs.chunk, call, fig.fused_head)
    layer = call * cb.backward(knobs.checkpoint)
    grads = grads_at_peak(fixed["step_grads"], calls, call * cb.freed_at_last_layer(knobs.checkpoint),
                          max(0.0, head - layer))
    parts = {
        "gradients": float(grads),
        "kv_stack": stack,
        "path_graphs": retained,
        "call_activations": call * cb.call(knobs.checkpoint),
        "backward_transient": max(head, layer),
    }
    (s, head_share, scale), L = fixed["rates"], max(1, spec.num_layers)
    # a re-run layer: its matmuls and its attention, unless a checkpointed layer's forward kept its outputs
    attention = fixed["attention_rerun"]
    rerun = RERUN_MATMUL_SHARE * s + (0.0 if knobs.keep else attention)
    shared = pk.shared
    cost = u + (u - shared) * rerun * knobs.checkpoint / L
    if knobs.path == RECOMPUTE:
        cost += shared * (s + attention + rerun * knobs.checkpoint / L)
        cost += pk.shared_calls * call_overhead_at(scale, pk.shared_call, knobs.checkpoint / L)
    else:
        cost += shared * rerun * knobs.path / L
    cost += calls * call_overhead_at(scale, u / calls, knobs.checkpoint / L)
    cost += u * head_share * HEAD_CHUNK_PENALTY.get(knobs.chunk, _OTHER_CHUNK_PENALTY)
    return sum(parts.values()), cost, parts


@dataclass(frozen=True)
class KnobGrid:
    """A step's candidate plans as columns, in the order of nested loops over call budgets,
    checkpointed layers, paths, head chunks and keep (False before True): [n] arrays."""

    group_tokens: np.ndarray
    checkpoint: np.ndarray
    path: np.ndarray
    chunk: np.ndarray
    keep: np.ndarray

    def __len__(self) -> int:
        return len(self.group_tokens)

    def knob(self, i: int) -> Knobs:
        return Knobs(int(self.group_tokens[i]), int(self.checkpoint[i]), int(self.path[i]), int(self.chunk[i]),
                     bool(self.keep[i]))

    def knobs(self) -> list[Knobs]:
        return [self.knob(i) for i in range(len(self))]

    def rows_of(self, knobs: Knobs) -> np.ndarray:
        """[n] whether each candidate is ``knobs``."""
        return ((self.group_tokens == knobs.group_tokens) & (self.checkpoint == knobs.checkpoint)
                & (self.path == knobs.path) & (self.chunk == knobs.chunk) & (self.keep == knobs.keep))


def knob_grid(budgets, checkpoints, paths, chunks, can_keep: bool) -> KnobGrid:
    """Every combination of the options, keep True only where some layer is checkpointed
    (``checkpoint > 0`` or ``path > 0``) and the backend can keep attention outputs."""
    g, k, p, c, kp = (x.ravel() for x in np.meshgrid(
        np.asarray(budgets, dtype=np.int64), np.asarray(checkpoints, dtype=np.int64), np.asarray(paths, dtype=np.int64),
        np.asarray(chunks, dtype=np.int64), np.array([False, True]), indexing="ij"))
    valid = ~kp | (can_keep & ((k > 0) | (p > 0)))
    return KnobGrid(g[valid], k[valid], p[valid], c[valid], kp[valid])


class _Lookup:
    """``lookup(fn, *columns)``: [n] ``fn`` of each row of ``columns`` (Python ints), computed once
    per distinct row. The rows are keyed as one integer (a sort of ~1,000 int64, not of structured
    rows), each set of columns once per scoring (several figures share one), and ``fn`` gets the
    distinct rows as Python ints taken out in one ``tolist`` per column: per element, numpy's
    scalar indexing and ``int`` cost more than ``fn`` (most of the policy's host time on GRPO
    case 1 before session AM)."""

    def __init__(self) -> None:
        # by the columns' ids; each entry holds its columns, so no id is reused while the entry lives
        self._rows: dict[tuple[int, ...], tuple[tuple, list, np.ndarray]] = {}

    def __call__(self, fn, *columns: np.ndarray) -> np.ndarray:
        ident = tuple(id(col) for col in columns)
        if ident not in self._rows:
            ints = [col.astype(np.int64) for col in columns]
            key = np.zeros(len(columns[0]), dtype=np.int64)
            for col in ints:
                low = int(col.min())
                key = key * (int(col.max()) - low + 1) + (col - low)
            _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
            rows = list(zip(*(col[first].tolist() for col in ints)))
            self._rows[ident] = (columns, rows, inverse.reshape(-1))
        _, rows, inverse = self._rows[ident]
        return np.array([fn(*row) for row in rows], dtype=np.float64)[inverse]


def candidate_scores(
    shape: StepShape, grid: KnobGrid, fig_of: dict[int, _Figures], spec: ModelSpec, fixed: dict
) -> tuple[np.ndarray, np.ndarray]:
    """([n] predicted peak bytes, [n] predicted costs) of the candidates of ``grid``
    (``fig_of``: the figures per LM-head chunk), equal to :func:`candidate`'s one by one."""
    u = shape.unique_tokens
    _lookup = _Lookup()  # the columns it is given are not changed while it is used
    of = {int(g): packed(shape, int(g)) for g in np.unique(grid.group_tokens)}
    calls = _lookup(lambda g: of[g].call, grid.group_tokens).astype(np.int64)  # a call's tokens
    call = calls.astype(np.float64)
    ckpt = grid.checkpoint.astype(np.float64)
    keep = grid.keep
    recompute = grid.path == RECOMPUTE

    def cb(chunk: int, kept: int):
        fig = fig_of[chunk]
        return fig.call_bytes if not kept else fig.call_bytes_keeping

    path = _lookup(lambda g: of[g].path, grid.group_tokens)
    retained = np.where(recompute, 0.0, path * _lookup(
        lambda c, kp, p: cb(c, kp).call(p) if p != RECOMPUTE else 0.0, grid.chunk, keep, grid.path))
    kv = _lookup(lambda g, c, k: kv_stack_bytes(shape, g, c, fixed, _windowed(fixed, k, spec.num_layers)),
                 grid.group_tokens, calls, grid.checkpoint)
    stack = np.maximum(0.0, kv + shape.state_slots * fixed["state_bytes"] - fixed["stack_held"])
    head = _lookup(lambda c, rows: head_bytes(spec, fig_of[c].itemsize, c, rows, fig_of[c].fused_head),
                   grid.chunk, calls)
    per_token = _lookup(lambda c, kp, n: cb(c, kp).call(n), grid.chunk, keep, grid.checkpoint)
    backward = _lookup(lambda c, kp, n: cb(c, kp).backward(n), grid.chunk, keep, grid.checkpoint)
    num_calls = _lookup(lambda g: of[g].calls, grid.group_tokens)
    freed = _lookup(lambda c, kp, n: cb(c, kp).freed_at_last_layer(n), grid.chunk, keep, grid.checkpoint)
    layer = call * backward
    peak = 0 + grads_at_peak(fixed["step_grads"], num_calls, call * freed, np.maximum(0.0, head - layer))
    peak = peak + stack + retained + call * per_token + np.maximum(head, layer)  # candidate's parts order

    (s, head_share, scale), L = fixed["rates"], max(1, spec.num_layers)
    attention = fixed["attention_rerun"]
    rerun = RERUN_MATMUL_SHARE * s + np.where(keep, 0.0, attention)
    shared = _lookup(lambda g: of[g].shared, grid.group_tokens)
    cost = u + (u - shared) * rerun * ckpt / L
    reruns = _lookup(lambda g: of[g].shared_calls, grid.group_tokens)
    recomputed = cost + shared * (s + attention + rerun * ckpt / L)
    recomputed = recomputed + reruns * _lookup(lambda g, k: call_overhead_at(scale, of[g].shared_call, k / L),
                                               grid.group_tokens, grid.checkpoint)
    cost = np.where(recompute, recomputed, cost + shared * rerun * np.where(recompute, 0, grid.path) / L)
    cost = cost + num_calls * _lookup(lambda g, k: call_overhead_at(scale, u / of[g].calls, k / L),
                                      grid.group_tokens, grid.checkpoint)
    penalty = _lookup(lambda c: HEAD_CHUNK_PENALTY.get(c, _OTHER_CHUNK_PENALTY), grid.chunk)
    cost = cost + u * head_share * penalty
    return peak, cost


def choose(plans: list[tuple], budget: float, keep: Knobs | None = None) -> tuple[tuple, str]:
    """The plan to run among ``(peak, cost, parts, knobs)`` candidates, and why: ``keep``'s
    when it fits; else the fastest that fits (the leanest of those within ``TIE`` of the
    least cost), or a leaner one within ``SLACK`` of its cost
    that saves at least ``LEANER`` of its memory; the leanest when none fits (the
    reference of :func:`choose_index`)."""
    fitting = [p for p in plans if p[0] <= budget]
    kept = next((p for p in fitting if p[3] == keep), None)
    if kept is not None:
        return kept, KEPT_REASON
    if not fitting:
        return min(plans, key=lambda p: (p[0], p[1])), NONE_FITS_REASON
    quickest = min(p[1] for p in fitting)
    fastest = min((p for p in fitting if p[1] <= quickest * (1 + TIE)), key=lambda p: (p[0], p[1]))
    leanest = min((p for p in fitting if p[1] <= fastest[1] * (1 + SLACK)), key=lambda p: p[0])
    chosen = leanest if leanest[0] <= (1 - LEANER) * fastest[0] else fastest
    return chosen, fit_reason(chosen is fastest, chosen[0], fastest[0], len(fitting), len(plans))


KEPT_REASON = "deterministic mode: the plan of the last step over a forest of this shape, which still fits"
NONE_FITS_REASON = "no plan is predicted to fit: the leanest one"


def fit_reason(fastest: bool, peak: float, fastest_peak: float, fitting: int, plans: int) -> str:
    reason = ("fastest predicted plan that fits" if fastest else
              f"within {SLACK:.0%} of the fastest predicted plan, with {1 - peak / fastest_peak:.0%} less memory")
    return reason + (f" ({fitting} of {plans} plans fit)" if plans > 1 else "")


def _first_min(index: np.ndarray, *keys: np.ndarray) -> int:
    """The first of ``index`` (ascending) with the least ``keys`` (compared in order), as
    ``min`` over a list returns it."""
    order = np.lexsort(tuple(k[index] for k in reversed(keys)) if len(keys) > 1 else (keys[0][index],))
    return int(index[order[0]])  # lexsort is stable: ties keep the list's order


def choose_index(peaks: np.ndarray, costs: np.ndarray, grid: KnobGrid, budget: float,
                 keep: Knobs | None = None) -> tuple[int, str]:
    """:func:`choose` over the arrays of ``grid``'s candidates: (the chosen plan's index, why)."""
    fits = peaks <= budget
    fitting = np.flatnonzero(fits)
    if keep is not None:
        kept = np.flatnonzero(fits & grid.rows_of(keep))
        if len(kept):
            return int(kept[0]), KEPT_REASON
    if len(fitting) == 0:
        return _first_min(np.arange(len(peaks)), peaks, costs), NONE_FITS_REASON
    tied = fitting[costs[fitting] <= costs[fitting].min() * (1 + TIE)]
    fastest = _first_min(tied, peaks, costs)
    near = fitting[costs[fitting] <= costs[fastest] * (1 + SLACK)]
    leanest = _first_min(near, peaks)
    chosen = leanest if peaks[leanest] <= (1 - LEANER) * peaks[fastest] else fastest
    return chosen, fit_reason(chosen == fastest, float(peaks[chosen]), float(peaks[fastest]), len(fitting), len(peaks))
