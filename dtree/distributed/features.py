"""Work features of a forest, of a set of its sequences, and of a subtree.

The cost model (:mod:`dtree.distributed.cost_model`) is linear in these four
numbers, the terms of AREAL-DTA's time model:

* ``fixed``: 1 for a non-empty forest, 0 for a piece of one. The per-step overhead
  a rank pays once (planning, host-to-device copies, the loss sync).
* ``nodes``: trie nodes. Each node is at least one segment of the schedule, so at
  least one model call with ``group_tokens=0``, and a share of one when calls are
  packed: the launch-bound term.
* ``tokens``: unique tokens, i.e. rows through the model (the matmul FLOPs).
* ``attention``: (query, key) pairs, ``sum over unique tokens of (position + 1)``,
  which equals ``sum over nodes of prefix_len x node_len + node_len (node_len + 1) / 2``:
  the attention FLOPs.

Everything is computed from the original forest's arrays, without building the
sub-forest, and equals the features of ``forest.subset(...)`` exactly (tests check
this): a subset's trie is the original trie restricted to the covered tokens, with
single-child chains merged, because its branch points are a subset of the original
ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from ..forest.forest import Forest

__all__ = ["FEATURES", "CostFeatures", "forest_features", "sequence_features", "TreeIndex"]

FEATURES = ("fixed", "nodes", "tokens", "attention")


@dataclass(frozen=True)
class CostFeatures:
    """One row of the cost model's design matrix (see module docstring)."""

    fixed: float = 0.0
    nodes: float = 0.0
    tokens: float = 0.0
    attention: float = 0.0

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(float(getattr(self, f.name)) for f in fields(self))

    def __add__(self, other: "CostFeatures") -> "CostFeatures":
        return CostFeatures(*(x + y for x, y in zip(self.as_tuple(), other.as_tuple())))

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.as_tuple()))


def _attention_pairs(first_position: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Keys attended by ``length`` tokens at positions ``first_position ...``: sum of (p + 1)."""
    return length * (first_position + 1) + length * (length - 1) // 2


def forest_features(forest: Forest | None) -> CostFeatures:
    """Features of a whole forest (one rank's step). ``None`` is an empty rank: all zero."""
    if forest is None or forest.num_sequences == 0:
        return CostFeatures()
    return CostFeatures(
        fixed=1.0,
        nodes=float(forest.num_nodes),
        tokens=float(forest.num_unique_tokens),
        attention=float((forest.positions + 1).sum()),
    )


class TreeIndex:
    """Per-node and per-sequence arrays of one forest that feature queries reuse.

    Building it is O(nodes + sequences); each query after that is vectorized numpy
    (:meth:`sequences`) or O(1) per subtree (:meth:`subtree`).
    """

    def __init__(self, forest: Forest) -> None:
        self.forest = forest
        f = forest
        self.first_pos = f.positions[f.node_start]
        self.node_end_pos = self.first_pos + f.node_length  # tokens on the path root..node, inclusive
        node_attn = _attention_pairs(self.first_pos, f.node_length)
        # Prefix sums over preorder: a subtree is the node range [i, subtree_end[i]).
        self._cum_tokens = np.concatenate([[0], np.cumsum(f.node_length)])
        self._cum_attn = np.concatenate([[0], np.cumsum(node_attn)])
        last = f.lin_unique[f.seq_offsets[1:] - 1]
        self.seq_end_node = np.searchsorted(f.node_start, last, side="right") - 1
        self.seq_end_offset = last - f.node_start[self.seq_end_node] + 1  # tokens of the end node it covers
        self.seq_tree = f.sequence_tree()
        self.children = [f.child_index[f.child_offsets[n] : f.child_offsets[n + 1]] for n in range(f.num_nodes)]

    # -- subtrees ------------------------------------------------------------------
    def subtree_nodes(self, n: int) -> int:
        return int(self.forest.node_subtree_end[n] - n)

    def subtree_tokens(self, n: int) -> int:
        return int(self._cum_tokens[self.forest.node_subtree_end[n]] - self._cum_tokens[n])

    def subtree_attention(self, n: int) -> int:
        return int(self._cum_attn[self.forest.node_subtree_end[n]] - self._cum_attn[n])

    def subtree(self, n: int) -> CostFeatures:
        """Features of node ``n``'s subtree alone (its tokens keep their positions)."""
        return CostFeatures(
            nodes=float(self.subtree_nodes(n)),
            tokens=float(self.subtree_tokens(n)),
            attention=float(self.subtree_attention(n)),
        )

    def piece(self, prefix_tokens: int, subtrees: Sequence[int]) -> CostFeatures:
        """Features of a piece: the shared path of ``prefix_tokens`` tokens (positions
        ``0 .. prefix_tokens - 1``) plus the whole subtrees rooted at ``subtrees``
        (children of the path's last node, or one tree root with ``prefix_tokens=0``).

        On its own rank the path is one node when it has two or more subtrees below
        it, and merges into the subtree's root node when it has one.
        """
        nodes = sum(self.subtree_nodes(c) for c in subtrees)
        if prefix_tokens > 0 and len(subtrees) != 1:
            nodes += 1
        return CostFeatures(
            nodes=float(nodes),
            tokens=float(prefix_tokens + sum(self.subtree_tokens(c) for c in subtrees)),
            attention=float(
                prefix_tokens * (prefix_tokens + 1) // 2 + sum(self.subtree_attention(c) for c in subtrees)
            ),
        )

    def sequences_in_subtree(self, n: int) -> np.ndarray:
        """Sequences that end inside node ``n``'s subtree (their paths run through ``n``)."""
        end = self.seq_end_node
        return np.flatnonzero((end >= n) & (end < self.forest.node_subtree_end[n]))

    def sequences_ending_in(self, n: int) -> np.ndarray:
        return np.flatnonzero(self.seq_end_node == n)

    # -- arbitrary sets of sequences -----------------------------------------------
    def sequences(self, sequence_ids: Sequence[int] | np.ndarray) -> CostFeatures:
        """Features of ``forest.subset(sequence_ids)``, computed without building it."""
        f = self.forest
        ids = np.asarray(sequence_ids, dtype=np.int64)
        if ids.size == 0:
            return CostFeatures()
        m = f.num_nodes
        ends = self.seq_end_node[ids]
        cover = np.zeros(m, dtype=np.int64)  # tokens of each node on some chosen path
        np.maximum.at(cover, ends, self.seq_end_offset[ids])
        # A node with a chosen sequence ending strictly below it is covered in full.
        marks = np.zeros(m + 1, dtype=np.int64)
        np.add.at(marks, ends + 1, 1)
        below = np.cumsum(marks)  # below[k] = sequences ending in nodes < k
        strictly_below = below[f.node_subtree_end] - below[np.arange(m) + 1]
        cover = np.where(strictly_below > 0, f.node_length, cover)
        covered = cover > 0
        # The sub-trie merges a covered node into its only covered child.
        covered_kids = np.zeros(m, dtype=np.int64)
        par = f.node_parent[covered]
        np.add.at(covered_kids, par[par >= 0], 1)
        nodes = int(covered.sum()) - int(np.count_nonzero(covered & (covered_kids == 1)))
        return CostFeatures(
            fixed=1.0,
            nodes=float(nodes),
            tokens=float(cover.sum()),
            attention=float(_attention_pairs(self.first_pos, cover).sum()),
        )


def sequence_features(forest: Forest, sequence_ids: Sequence[int] | np.ndarray) -> CostFeatures:
    """Features of ``forest.subset(sequence_ids)`` without building it (see :class:`TreeIndex`)."""
    return TreeIndex(forest).sequences(sequence_ids)
