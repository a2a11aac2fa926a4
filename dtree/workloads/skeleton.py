"""A rollout tree before it has tokens (:class:`TreeSkeleton`), and
:func:`materialize`, which draws the tokens and the loss fields of a list of them and
builds the :class:`~dtree.forest.forest.Forest` (one sequence per leaf)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..forest.forest import Forest

__all__ = ["TreeSkeleton", "materialize"]


@dataclass
class TreeSkeleton:
    """A rollout tree before it has tokens: node lengths, loss flags and links."""

    length: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)  # 1 = model-generated, 0 = prompt / environment
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)  # nodes above (root = 0)
    end: list[int] = field(default_factory=list)  # tokens on the path from the root through this node
    children: list[list[int]] = field(default_factory=list)

    def add(self, parent: int, length: int, loss: int) -> int:
        node = len(self.length)
        self.length.append(int(length))
        self.loss.append(int(loss))
        self.parent.append(parent)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
        self.end.append(int(length) + (0 if parent < 0 else self.end[parent]))
        self.children.append([])
        if parent >= 0:
            self.children[parent].append(node)
        return node

    @property
    def unique_tokens(self) -> int:
        return sum(self.length)

    def leaves(self) -> list[int]:
        return [n for n, kids in enumerate(self.children) if not kids]

    def path(self, node: int) -> list[int]:
        """Nodes from the root down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]


def materialize(trees: list[TreeSkeleton], rng: np.random.Generator, vocab_size: int, fields: bool = True) -> Forest:
    """Draw tokens and fields for the skeletons and build the forest (one sequence per leaf).

    ``fields=False`` builds the token ids only (the same ones), for uses that need the
    trie's shape alone (planning partitions at scale): per-token fields are most of the
    memory of a large batch."""
    lengths = np.concatenate([np.asarray(t.length, dtype=np.int64) for t in trees])
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    tree_base = np.cumsum([0] + [len(t.length) for t in trees])  # first global node id of each tree
    tokens = rng.integers(0, vocab_size, size=int(lengths.sum()), dtype=np.int64)

    # Distinct first tokens for the trees and for the children of every branch point,
    # so no random collision merges two branches and the trie is exactly this shape.
    tokens[starts[tree_base[:-1]]] = rng.choice(vocab_size, size=len(trees), replace=False)
    for t, tree in enumerate(trees):
        for kids in tree.children:
            if len(kids) > 1:
                tokens[starts[tree_base[t] + np.asarray(kids)]] = rng.choice(vocab_size, size=len(kids), replace=False)

    def path_index(t: int, leaf: int) -> np.ndarray:
        """Positions in ``tokens`` of the path from tree ``t``'s root to ``leaf``."""
        nodes = tree_base[t] + np.asarray(trees[t].path(leaf))
        return np.concatenate([np.arange(starts[n], starts[n] + lengths[n]) for n in nodes])

    if not fields:
        return Forest.from_sequences(
            [tokens[path_index(t, leaf)] for t, tree in enumerate(trees) for leaf in tree.leaves()]
        )
    loss = np.repeat(np.concatenate([np.asarray(t.loss, dtype=np.float64) for t in trees]), lengths)
    # Sampled tokens mostly have log-probs near 0 with a tail; the reference policy
    # stays close to the behaviour policy (small per-token KL).
    old = -np.abs(rng.normal(0.0, 0.7, size=len(tokens)))
    ref = -np.abs(old + rng.normal(0.0, 0.1, size=len(tokens)))
    sequences, masks, olds, refs, advs = [], [], [], [], []
    for t, tree in enumerate(trees):
        leaves = tree.leaves()
        # Continuous rewards, normalized within the tree (GRPO's group = one prompt or
        # task). Binary rewards would give all-equal groups zero advantage; DAPO's
        # dynamic sampling drops such groups, so trained batches look like this.
        rewards = rng.normal(size=len(leaves))
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6) if len(leaves) > 1 else np.zeros(1)
        for leaf, a in zip(leaves, adv):
            idx = path_index(t, leaf)
            sequences.append(tokens[idx])
            masks.append(loss[idx])
            olds.append(old[idx])
            refs.append(ref[idx])
            advs.append(np.full(len(idx), a))
    return Forest.from_sequences(sequences, loss_mask=masks, advantages=advs, old_logprobs=olds, ref_logprobs=refs)
