"""The ``mixed`` workload: GRPO groups, agentic trees and search trees in one global batch.

A trainer that serves several tasks at once (math with GRPO, tool use, step-level
search) gets batches whose trees differ in every way that decides their cost:

* a **GRPO group** is one 1k-3k-token prompt with 8 or 16 short answers (64-512
  tokens): few nodes, short contexts;
* an **agentic tree** is a 4k-8k-token system prompt and task, then 8 to 20 turns
  per trajectory with long-tailed tool outputs (up to 4k tokens), in a 32k context
  window: paths of ~10k to 32k tokens, so attention costs as much as the matmuls;
* a **search tree** is a 1k-2k-token prompt with ~100 steps of 16-96 tokens: many
  small nodes.

Counting unique tokens prices a token at position 30k like one at position 1k,
which is what this batch exposes (issue 22); a cost model with an attention term
does not. Every sequence is 1k to 32k tokens long (``min_sequence_len``,
``max_sequence_len``): the shapes are chosen so, and the bounds are checked after
drawing.

Trees of the three kinds are drawn from one seeded generator and put in a seeded
random order (the order in which rollouts of different tasks finish), then get
their tokens and fields as every workload does
(:func:`dtree.workloads.skeleton.materialize`). :func:`mixed_batch` also says which
kind each sequence is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..forest.forest import Forest
from .arguments import DEFAULT_VOCAB_SIZE, check_vocab, int_at_least, make_rng
from .shapes import GrpoShape, SearchShape, grpo, search
from .skeleton import materialize
from .tool_use import AgenticShape, agentic

__all__ = ["KINDS", "MIXED_SHAPES", "MixedBatch", "mixed", "mixed_batch"]

KINDS = ("grpo", "agentic", "search")

# The per-tree shape of each kind (parameters of grpo / agentic / search, without
# their tree counts). Override any of them with ``grpo_args=`` etc.
MIXED_SHAPES: dict[str, dict[str, Any]] = {
    # GRPO with short answers: 1k-3k-token problem statements, G in {8, 16}, 64-512-token answers
    "grpo": dict(prompt_len=(1024, 3072), group_size=(8, 16), answer_len=(64, 512)),
    # deep agent trajectories under a long system prompt: 8-20 turns (stopping less often
    # than the default), long-tailed turns up to 4k tokens (file reads, web pages), a 32k
    # context window; 3-6 trajectories keep one tree at ~30-60k unique tokens
    "agentic": dict(
        system_prompt_len=(4000, 6000), task_len=(100, 2000), trajectories=(3, 6), depth=(8, 20), stop_prob=0.3,
        turn_len=(64, 4000), turn_len_median=700.0, turn_len_sigma=1.0, context_window=32768,
    ),
    # step-level search: ~100 steps of 16-96 tokens per tree (many small nodes)
    "search": dict(prompt_len=(1024, 2048), branching=(3, 4), beam_width=4, depth=8, step_len=(16, 96)),
}
_SHAPES = {"grpo": (GrpoShape, grpo), "agentic": (AgenticShape, agentic), "search": (SearchShape, search)}


@dataclass(frozen=True)
class MixedBatch:
    """A mixed forest and the kind of each of its sequences.

    Attributes:
        forest: the batch (sequence ``i`` is the ``i``-th leaf drawn).
        sequence_kinds: [num_sequences] int, an index into :data:`KINDS`.
    """

    forest: Forest
    sequence_kinds: np.ndarray

    def sequences_of(self, kind: str) -> np.ndarray:
        """Indices of the sequences of ``kind`` (ascending)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; the kinds are {KINDS}")
        return np.flatnonzero(self.sequence_kinds == KINDS.index(kind))

    def part(self, kind: str) -> Forest | None:
        """The forest of the ``kind`` trees alone (``None`` when the batch has none)."""
        ids = self.sequences_of(kind)
        return self.forest.subset(ids) if len(ids) else None

    def tree_kinds(self) -> list[str]:
        """The kind of each tree of ``forest``, in the forest's tree order."""
        first_seq = np.full(self.forest.num_trees, -1, dtype=np.int64)
        tree_of = self.forest.sequence_tree()
        first_seq[tree_of[::-1]] = np.arange(len(tree_of))[::-1]
        return [KINDS[int(self.sequence_kinds[s])] for s in first_seq]


_COUNTS = {"grpo": "grpo_groups", "agentic": "agentic_trees", "search": "search_trees"}


def _shape(kind: str, overrides: Mapping[str, Any] | None):
    """The checked shape of ``kind``: the generator's defaults, then :data:`MIXED_SHAPES`,
    then ``overrides``."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ValueError(f"{kind}_args must be a dict of {kind} parameters, got {type(overrides).__name__}")
    cls, generator = _SHAPES[kind]
    valid = list(inspect.signature(cls.checked).parameters)
    unknown = sorted(set(overrides or {}) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown {kind}_args {unknown}; valid: {', '.join(valid)} (the tree count is {_COUNTS[kind]})"
        )
    defaults = {k: p.default for k, p in inspect.signature(generator).parameters.items() if k in valid}
    return cls.checked(**{**defaults, **MIXED_SHAPES[kind], **(overrides or {})})


def mixed_batch(
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    grpo_groups: int = 12,
    agentic_trees: int = 3,
    search_trees: int = 6,
    grpo_args: Mapping[str, Any] | None = None,
    agentic_args: Mapping[str, Any] | None = None,
    search_args: Mapping[str, Any] | None = None,
    min_sequence_len: int | None = 1024,
    max_sequence_len: int | None = 32768,
    fields: bool = True,
) -> MixedBatch:
    """:func:`mixed` with the kind of every sequence (see :class:`MixedBatch`)."""
    rng = make_rng(seed)
    counts = {k: int_at_least(_COUNTS[k], n, 0) for k, n in zip(KINDS, (grpo_groups, agentic_trees, search_trees))}
    if sum(counts.values()) == 0:
        raise ValueError("the mixed batch needs at least one tree: grpo_groups, agentic_trees and search_trees are 0")
    shapes = {k: _shape(k, a) for k, a in zip(KINDS, (grpo_args, agentic_args, search_args))}
    vocab_size = check_vocab(vocab_size, max(sum(counts.values()), *(s.max_branching for s in shapes.values())))
    trees, kinds = [], []
    for i, kind in enumerate(KINDS):
        trees += [shapes[kind].tree(rng) for _ in range(counts[kind])]
        kinds += [i] * counts[kind]
    order = rng.permutation(len(trees))
    trees = [trees[i] for i in order]
    seq_kinds = np.concatenate([np.full(len(trees[j].leaves()), kinds[i]) for j, i in enumerate(order)])
    forest = materialize(trees, rng, vocab_size, fields=fields)
    _check_lengths(forest, min_sequence_len, max_sequence_len)
    return MixedBatch(forest, seq_kinds.astype(np.int64))


def _check_lengths(forest: Forest, lo: int | None, hi: int | None) -> None:
    lengths = forest.sequence_lengths()
    if lo is not None and lengths.min() < int_at_least("min_sequence_len", lo, 1):
        s = int(np.argmin(lengths))
        raise ValueError(f"sequence {s} has {lengths[s]} tokens, below min_sequence_len={lo}: lengthen the "
                         "prompts (grpo_args / search_args prompt_len) or pass min_sequence_len=None")
    if hi is not None and lengths.max() > int_at_least("max_sequence_len", hi, 1):
        s = int(np.argmax(lengths))
        raise ValueError(f"sequence {s} has {lengths[s]} tokens, above max_sequence_len={hi}: shorten the "
                         "agentic turns or depth (agentic_args turn_len / depth) or pass max_sequence_len=None")


def mixed(**kwargs: Any) -> Forest:
    """One global batch of GRPO groups, agentic trees and search trees (module docstring).

    Args:
        seed: numpy seed; the same seed and arguments give the same forest.
        vocab_size: token ids are uniform in ``[0, vocab_size)``.
        grpo_groups, agentic_trees, search_trees: trees of each kind (>= 0, at least one).
        grpo_args, agentic_args, search_args: overrides of :data:`MIXED_SHAPES` (the
            per-tree parameters of :func:`~dtree.workloads.grpo`, ``agentic``, ``search``).
        min_sequence_len, max_sequence_len: every sequence must be within these bounds
            (``None``: unchecked); a ValueError names the sequence and the argument to change.
        fields: ``False`` builds the same token ids without the loss fields (for planning
            partitions of very large batches, where only the trie's shape matters).
    """
    return mixed_batch(**kwargs).forest


# the registry reads a generator's parameters from its signature
mixed.__signature__ = inspect.signature(mixed_batch).replace(return_annotation=Forest)  # type: ignore[attr-defined]
