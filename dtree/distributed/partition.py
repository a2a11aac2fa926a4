"""Split a forest over data-parallel ranks, balancing a cost model, exactly.

**Unit of assignment: whole sequences.** Every sequence goes to exactly one rank,
with all its tokens and fields. A rank's forest is ``forest.subset(its sequences)``,
so every (sequence, token) loss term of the linearized loss is computed exactly
once, on the rank that owns the sequence: running ``TreeRuntime.forward_backward``
on every rank's forest with a ``sum`` loss and summing the gradients over ranks
gives the single-process gradient. ``token_mean`` and ``sequence_mean`` need the
global counts (:class:`dtree.losses.Normalization`, summed over ranks), which
:mod:`dtree.distributed.trainer` passes.

**Trees are split at subtree boundaries when that shortens the step.** A piece of a
tree is the subtrees below some node ``a`` plus the path from the root to ``a``; the
path is recomputed on every rank that holds a piece below it. No context-only path
with zeroed loss weights is needed: the ancestor tokens are the first tokens of the
piece's own sequences, and their loss terms for *those* sequences belong to this
rank (the same tokens' terms for other sequences are computed by the ranks owning
those; docs/design.md section 7). No loss weight is ever zeroed, so the returned
forests carry the user's fields untouched. Sequences that end inside a
split node ``a`` (a prefix of the others) join the first piece below ``a``, where
they add no unique tokens.

How trees are split (default, adaptive): start from whole trees; balance them over
the ranks (LPT or Karmarkar-Karp, :mod:`dtree.distributed.balance`); compute every
rank's exact predicted cost (pieces of one tree on one rank share their prefix
again); bisect the largest splittable piece on the most expensive rank at its top
branch point (two halves of balanced subtree cost, each with a copy of the path
above); re-balance; repeat while it helps, keeping the best plan. Only what sits on
the most loaded rank is cut, so prefixes are recomputed only where that shortens
the predicted step (a batch that balances as whole trees is not cut at all). A
single root-to-leaf path cannot be cut. With ``split_threshold=T``,
every tree is instead bisected until its pieces cost at most ``T`` (where it can)
and balanced once. ``method="auto"`` runs both balancers and keeps the plan with the
lower predicted makespan; ``benchmarks/results/partition_lpt_vs_kk.md`` compares
them (KK is better or equal in nearly every case).

**Determinism.** Pure functions of the forest and the cost model: stable sorts,
ties broken by index, costs summed in a fixed order. Every rank computes the same
assignment from the same inputs; :meth:`Partition.digest` lets a trainer check.

**Empty ranks.** With fewer pieces than ranks, some ranks get no sequence; their
entry is ``None`` (not an empty ``Forest``, which cannot exist). The trainer still
takes part in every collective for such a rank and contributes zero gradient.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from ..forest.forest import Forest
from .balance import karmarkar_karp, lpt
from .cost_model import CostModel
from .features import CostFeatures, TreeIndex

__all__ = ["plan_partition", "Partition", "PartitionReport", "Piece", "split_forest"]

PARTITION_METHODS = ("auto", "lpt", "kk")
_BALANCERS = {"lpt": lpt, "kk": karmarkar_karp}


@dataclass(frozen=True)
class Piece:
    """Whole sequences of one tree, assigned to a rank as a unit.

    The piece is the path from the tree's root to ``anchor`` (-1: no path, the piece
    is a whole tree) plus the complete subtrees rooted at ``subtrees`` (children of
    ``anchor``, or the tree's root). Its sequences are those ending in these subtrees
    plus ``riders``: sequences ending on the path itself.
    """

    tree: int
    anchor: int
    subtrees: tuple[int, ...]
    riders: np.ndarray
    sequences: np.ndarray
    features: CostFeatures
    cost: float


@dataclass
class PartitionReport:
    """What a partition did and what it is predicted to cost.

    ``rank_costs`` are the cost model's predictions (seconds for a calibrated or
    FLOP-derived model) of each rank's forest, exact features included (pieces of one
    tree on one rank share their prefix). ``recomputed_tokens`` counts ancestor-path
    tokens computed on more than one rank.
    """

    method: str
    world_size: int
    split_threshold: float
    rank_costs: list[float]
    rank_sequences: list[int]
    rank_unique_tokens: list[int]
    unique_tokens: int
    num_pieces: int
    split_trees: list[int] = field(default_factory=list)

    @property
    def max_cost(self) -> float:
        return max(self.rank_costs, default=0.0)

    @property
    def mean_cost(self) -> float:
        return sum(self.rank_costs) / len(self.rank_costs) if self.rank_costs else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean rank cost (1.0 is perfect balance)."""
        mean = self.mean_cost
        return self.max_cost / mean if mean > 0 else 1.0

    @property
    def recomputed_tokens(self) -> int:
        return int(sum(self.rank_unique_tokens) - self.unique_tokens)

    @property
    def recompute_overhead(self) -> float:
        """Recomputed tokens as a fraction of the forest's unique tokens."""
        return self.recomputed_tokens / self.unique_tokens if self.unique_tokens else 0.0

    @property
    def empty_ranks(self) -> list[int]:
        return [r for r, n in enumerate(self.rank_sequences) if n == 0]

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out.update(imbalance=self.imbalance, recomputed_tokens=self.recomputed_tokens,
                   recompute_overhead=self.recompute_overhead, max_cost=self.max_cost, mean_cost=self.mean_cost,
                   empty_ranks=self.empty_ranks)
        return out

    def format(self) -> str:
        lines = [
            f"partition over {self.world_size} ranks ({self.method}, {self.num_pieces} pieces): "
            f"imbalance {self.imbalance:.3f} (max/mean predicted cost), "
            f"recomputed {self.recomputed_tokens:,} tokens ({100 * self.recompute_overhead:.1f}%), "
            f"split trees {self.split_trees or 'none'}",
            f"{'rank':>4}  {'sequences':>9}  {'unique tokens':>13}  {'predicted cost':>14}",
        ]
        for r in range(self.world_size):
            lines.append(
                f"{r:>4}  {self.rank_sequences[r]:>9,}  {self.rank_unique_tokens[r]:>13,}  {self.rank_costs[r]:>14.4g}"
            )
        return "\n".join(lines)


@dataclass
class Partition:
    """The assignment of a forest's sequences to ranks.

    Attributes:
        sequence_ids: per rank, the original indices of its sequences, ascending.
        report: see :class:`PartitionReport`.
    """

    source: Forest
    sequence_ids: list[np.ndarray]
    report: PartitionReport

    @property
    def world_size(self) -> int:
        return len(self.sequence_ids)

    def forest(self, rank: int) -> Forest | None:
        """Rank ``rank``'s forest, or ``None`` when it received no sequence. Build only
        your own rank's forest: it is a new trie (host work proportional to its size)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        ids = self.sequence_ids[rank]
        return self.source.subset(ids) if len(ids) else None

    def forests(self) -> list[Forest | None]:
        return [self.forest(r) for r in range(self.world_size)]

    def digest(self) -> int:
        """A 63-bit fingerprint of the assignment, equal on ranks that agree on it."""
        h = hashlib.blake2b(digest_size=8)
        for ids in self.sequence_ids:
            h.update(np.int64(len(ids)).tobytes())
            h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------------- splitting
_EMPTY = np.zeros(0, dtype=np.int64)


def _make_piece(index: TreeIndex, cost_model: CostModel, tree: int, anchor: int, subtrees, riders) -> Piece:
    prefix = 0 if anchor < 0 else int(index.node_end_pos[anchor])
    feats = index.piece(prefix, subtrees)
    seqs = np.sort(np.concatenate([riders] + [index.sequences_in_subtree(k) for k in subtrees]))
    return Piece(tree, anchor, tuple(subtrees), riders, seqs, feats, cost_model.cost(feats))


def whole_trees(index: TreeIndex, cost_model: CostModel) -> list[Piece]:
    """One piece per tree."""
    return [
        _make_piece(index, cost_model, t, -1, [int(r)], _EMPTY) for t, r in enumerate(index.forest.tree_roots)
    ]


def splittable(index: TreeIndex, piece: Piece) -> bool:
    """A piece can be cut unless it is a single root-to-leaf chain."""
    return len(piece.subtrees) > 1 or index.subtree_nodes(piece.subtrees[0]) > 1


def bisect(index: TreeIndex, cost_model: CostModel, piece: Piece) -> tuple[Piece, Piece]:
    """Cut a piece in two at its top branch point, balancing the two halves' subtree
    costs (two-way Karmarkar-Karp). Both halves keep a copy of the path above the
    branch point; sequences ending on that path ride with the first half."""
    anchor, subs, riders = piece.anchor, list(piece.subtrees), piece.riders
    while len(subs) == 1:  # one subtree: its root becomes the path's end, cut below it
        c = subs[0]
        anchor, subs = c, [int(k) for k in index.children[c]]
        riders = np.concatenate([riders, index.sequences_ending_in(c)])
        if not subs:
            raise ValueError("cannot bisect a single root-to-leaf path")
    halves = karmarkar_karp([cost_model.cost(index.subtree(k)) for k in subs], 2)
    groups = sorted(sorted(subs[i] for i in h) for h in halves)
    first = _make_piece(index, cost_model, piece.tree, anchor, groups[0], riders)
    second = _make_piece(index, cost_model, piece.tree, anchor, groups[1], _EMPTY)
    return first, second


def split_forest(
    forest: Forest, cost_model: CostModel, threshold: float, *, index: TreeIndex | None = None
) -> list[Piece]:
    """Cut every tree into pieces costing at most ``threshold`` where the tree allows
    it, by repeated :func:`bisect`. Pieces are listed tree by tree, depth first;
    ``threshold=inf`` keeps every tree whole."""
    index = index or TreeIndex(forest)
    out: list[Piece] = []
    todo = list(reversed(whole_trees(index, cost_model)))
    while todo:
        p = todo.pop()
        if p.cost > threshold and splittable(index, p):
            first, second = bisect(index, cost_model, p)
            todo += [second, first]
        else:
            out.append(p)
    return out


# ---------------------------------------------------------------------- assignment
def _rank_report(
    index: TreeIndex, cost_model: CostModel, pieces: list[Piece], bins: list[list[int]], method: str, threshold: float
) -> tuple[list[np.ndarray], PartitionReport]:
    f = index.forest
    seq_ids: list[np.ndarray] = []
    costs, uniq, nseq = [], [], []
    for items in bins:
        ids = np.sort(np.concatenate([pieces[i].sequences for i in items])) if items else np.zeros(0, dtype=np.int64)
        feats = index.sequences(ids)
        seq_ids.append(ids)
        costs.append(cost_model.cost(feats))
        uniq.append(int(feats.tokens))
        nseq.append(int(ids.size))
    rank_of_piece = {i: r for r, items in enumerate(bins) for i in items}
    ranks_of_tree: dict[int, set[int]] = {}
    for i, p in enumerate(pieces):
        ranks_of_tree.setdefault(p.tree, set()).add(rank_of_piece[i])
    split = sorted(t for t, rs in ranks_of_tree.items() if len(rs) > 1)
    report = PartitionReport(
        method=method, world_size=len(bins), split_threshold=threshold, rank_costs=costs, rank_sequences=nseq,
        rank_unique_tokens=uniq, unique_tokens=f.num_unique_tokens, num_pieces=len(pieces), split_trees=split,
    )
    return seq_ids, report


def _evaluate(index, cost_model, pieces, balancer_name, world_size, threshold):
    bins = _BALANCERS[balancer_name]([p.cost for p in pieces], world_size)
    seq_ids, report = _rank_report(index, cost_model, pieces, bins, balancer_name, threshold)
    return bins, seq_ids, report


def _improves(new: PartitionReport, best: PartitionReport, min_gain: float) -> bool:
    """A plan recomputing more prefix tokens must shorten the predicted step by at
    least ``min_gain`` (a fraction): smaller predicted gains are within the cost
    model's error, while the recomputation is real work."""
    if new.recomputed_tokens <= best.recomputed_tokens:
        return (new.max_cost, new.recomputed_tokens) < (best.max_cost, best.recomputed_tokens)
    return new.max_cost < best.max_cost * (1.0 - min_gain)


def _adaptive(
    index: TreeIndex, cost_model: CostModel, balancer_name: str, world_size: int, max_splits: int, min_gain: float
):
    """Split the bottleneck, re-balance, keep the best.

    Start from whole trees. Each round: balance the pieces, measure every rank's exact
    predicted cost, then bisect the largest splittable piece on the most expensive
    rank. Splitting only what limits the step keeps the recomputed prefixes few (a
    tree that fits is never cut), and bisecting at branch points adapts the piece
    sizes to the tree instead of to a fixed threshold. Stops when the bottleneck rank
    holds only unsplittable paths, after ``world_size`` rounds without improvement,
    or after ``max_splits`` cuts; returns the best (sequence ids, report) seen.
    """
    pieces = whole_trees(index, cost_model)
    best = None
    stale = 0
    for _ in range(max_splits + 1):
        bins, seq_ids, report = _evaluate(index, cost_model, pieces, balancer_name, world_size, math.nan)
        if best is None or _improves(report, best[1], min_gain):
            best, stale = (seq_ids, report), 0
        else:
            stale += 1
            if stale > world_size:
                break
        costs = report.rank_costs
        bottleneck = max(range(world_size), key=lambda r: (costs[r], -r))
        candidates = [i for i in bins[bottleneck] if splittable(index, pieces[i])]
        if not candidates:
            break
        i = max(candidates, key=lambda i: (pieces[i].cost, -i))
        pieces = pieces[:i] + list(bisect(index, cost_model, pieces[i])) + pieces[i + 1 :]
    return best


def plan_partition(
    forest: Forest,
    world_size: int,
    cost_model: CostModel | None = None,
    *,
    method: str = "auto",
    split: bool = True,
    split_threshold: float | None = None,
    max_splits: int | None = None,
    min_gain: float = 0.01,
) -> Partition:
    """Assign the sequences of ``forest`` to ``world_size`` ranks (see module docstring).

    Args:
        cost_model: predicts a rank's time; default :meth:`CostModel.default` (FLOPs of a
            nominal model). Pass ``CostModel.from_spec(runtime.spec)`` or a calibrated
            model; ``CostModel.token_count()`` balances unique tokens only.
        method: ``"lpt"``, ``"kk"`` or ``"auto"`` (run both, keep the better plan).
        split: cut trees at subtree boundaries where that lowers the most loaded rank's
            cost; ``False`` assigns whole trees only.
        split_threshold: instead of the adaptive splitting, cut every tree into pieces
            costing at most this much (where the tree allows), then balance once. Use
            it to force splits (tests) or to bound a piece's size.
        max_splits: bound on the adaptive cuts (default ``4 * world_size + 8``).
        min_gain: a cut that recomputes more prefix tokens is kept only if it lowers
            the predicted makespan by at least this fraction (default 1%).

    Returns:
        A :class:`Partition`: per-rank sequence ids, ``forest(rank)``, and the report.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    world_size = int(world_size)
    if method not in PARTITION_METHODS:
        raise ValueError(f"method must be one of {PARTITION_METHODS}, got {method!r}")
    if split_threshold is not None and not split_threshold > 0:
        raise ValueError(f"split_threshold must be > 0, got {split_threshold}")
    cost_model = cost_model or CostModel.default()
    index = TreeIndex(forest)
    names = ["kk", "lpt"] if method == "auto" else [method]  # KK first: it wins ties (see the LPT vs KK note)
    max_splits = 4 * world_size + 8 if max_splits is None else int(max_splits)

    candidates = []
    for mi, name in enumerate(names):
        if split and world_size > 1 and split_threshold is None:
            seq_ids, report = _adaptive(index, cost_model, name, world_size, max_splits, min_gain)
        else:
            threshold = math.inf if not split or world_size == 1 else float(split_threshold)
            pieces = split_forest(forest, cost_model, threshold, index=index)
            _, seq_ids, report = _evaluate(index, cost_model, pieces, name, world_size, threshold)
        candidates.append(((report.max_cost, report.recomputed_tokens, mi), seq_ids, report))
    _, seq_ids, report = min(candidates, key=lambda c: c[0])
    if method == "auto":
        report.method = f"auto:{report.method}"
    return Partition(source=forest, sequence_ids=seq_ids, report=report)

