"""Two of the rollout shapes: :func:`grpo` (one prompt, G sampled answers) and
:func:`search` (wide, deep trees of short reasoning steps). The third,
:func:`dtree.workloads.tool_use.agentic`, has its own module.

Each shape is a checked, frozen description (:class:`GrpoShape`, :class:`SearchShape`)
whose ``tree(rng)`` draws one tree's skeleton, so :mod:`dtree.workloads.mixed` can
draw trees of several shapes into one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..forest.forest import Forest
from .arguments import DEFAULT_VOCAB_SIZE, check_vocab, choices, draw, int_at_least, length_range, make_rng
from .skeleton import TreeSkeleton, materialize

__all__ = ["GrpoShape", "SearchShape", "grpo", "search"]


@dataclass(frozen=True)
class GrpoShape:
    """The checked per-tree parameters of :func:`grpo` (ranges as inclusive pairs)."""

    prompt: tuple[int, int]
    groups: tuple[int, ...]
    answer: tuple[int, int]

    @classmethod
    def checked(cls, prompt_len, group_size, answer_len) -> "GrpoShape":
        return cls(length_range("prompt_len", prompt_len), choices("group_size", group_size),
                   length_range("answer_len", answer_len))

    @property
    def max_branching(self) -> int:
        return max(self.groups)

    def tree(self, rng: np.random.Generator) -> TreeSkeleton:
        """One group: a prompt node (loss 0) with G answer children (loss 1)."""
        tree = TreeSkeleton()
        root = tree.add(-1, draw(rng, self.prompt), loss=0)
        g = int(rng.choice(self.groups))
        for length in draw(rng, self.answer, size=g):
            tree.add(root, length, loss=1)
        return tree


def grpo(
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    num_prompts: int = 8,
    prompt_len: int | tuple[int, int] = (512, 4096),
    group_size: int | Sequence[int] = (4, 8, 16),
    answer_len: int | tuple[int, int] = (256, 4096),
) -> Forest:
    """GRPO groups: ``num_prompts`` trees, each one prompt with G sampled answers.

    Shape: a prompt node (loss 0) with G answer children (loss 1); one sequence per
    answer. G is drawn per prompt from ``group_size`` (or fixed when an int); prompt
    and answer lengths are uniform in their inclusive ranges (or fixed when ints).

    Where the numbers come from: DeepSeekMath's GRPO samples 64 outputs per question
    and DAPO 16; open GRPO recipes (verl / OpenRLHF / TRL examples) mostly use 4 to 16,
    hence G in {4, 8, 16}. The length ranges span the prompt and response budgets of
    those setups: prompts from a short problem statement to few-shot or long-context
    prompts (512 to 4k), answers from a short solution to a long chain of thought
    (256 to 4k; DeepSeekMath capped answers at 1k, DAPO at 20k). Uniform draws keep
    the ranges' extremes well represented, which is what a benchmark needs.

    The fixed case ``prompt_len=2048, group_size=8, answer_len=512`` has compression
    ratio exactly ``(2048 + 512) * 8 / (2048 + 8 * 512)``.
    """
    rng = make_rng(seed)
    num_prompts = int_at_least("num_prompts", num_prompts, 1)
    shape = GrpoShape.checked(prompt_len, group_size, answer_len)
    vocab_size = check_vocab(vocab_size, max(num_prompts, shape.max_branching))
    return materialize([shape.tree(rng) for _ in range(num_prompts)], rng, vocab_size)


@dataclass(frozen=True)
class SearchShape:
    """The checked per-tree parameters of :func:`search` (ranges as inclusive pairs)."""

    prompt: tuple[int, int]
    branching: tuple[int, int]
    beam_width: int
    depth: int
    step: tuple[int, int]

    @classmethod
    def checked(cls, prompt_len, branching, beam_width, depth, step_len) -> "SearchShape":
        # checked in the order of the signature: the first bad argument is the one named
        return cls(length_range("prompt_len", prompt_len), length_range("branching", branching),
                   int_at_least("beam_width", beam_width, 1), int_at_least("depth", depth, 1),
                   length_range("step_len", step_len))

    @property
    def max_branching(self) -> int:
        return self.branching[1]

    def tree(self, rng: np.random.Generator) -> TreeSkeleton:
        """One search tree: a prompt, then ``depth`` levels of beam expansion."""
        tree = TreeSkeleton()
        live = [tree.add(-1, draw(rng, self.prompt), loss=0)]
        for level in range(self.depth):
            candidates = []
            for u in live:
                k = int(draw(rng, self.branching))
                candidates.extend(tree.add(u, length, loss=1) for length in draw(rng, self.step, size=k))
            if level + 1 < self.depth and len(candidates) > self.beam_width:
                keep = rng.choice(len(candidates), size=self.beam_width, replace=False)
                candidates = [candidates[i] for i in sorted(keep)]
            live = candidates
        return tree


def search(
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    num_trees: int = 4,
    prompt_len: int | tuple[int, int] = (256, 1024),
    branching: int | tuple[int, int] = 4,
    beam_width: int = 4,
    depth: int = 8,
    step_len: int | tuple[int, int] = (16, 128),
) -> Forest:
    """Tree-search rollouts (beam search / MCTS over reasoning steps): wide, deep, short nodes.

    Shape of one tree: a prompt (loss 0); at every level each of the ``beam_width``
    live nodes expands into ``branching`` candidate steps (loss 1, ``step_len``
    tokens); ``beam_width`` of the candidates, picked at random (the value model's
    choice is random here), stay live, the others become leaves. After ``depth``
    levels all candidates are leaves. One sequence per leaf, so pruned branches are
    trained too, as in step-level tree RL (TreeRL, ReST-MCTS*).

    Where the numbers come from: step-level search in ToT / ReST-MCTS* / TreeRL-style
    rollouts uses steps of one reasoning line or paragraph (tens to ~100 tokens),
    branching 2 to 8, 4 to 10+ levels, on math prompts of a few hundred tokens. The
    defaults (4 x 4 beam, 8 levels) give ~100 leaves and ~10x compression per tree.
    """
    rng = make_rng(seed)
    num_trees = int_at_least("num_trees", num_trees, 1)
    shape = SearchShape.checked(prompt_len, branching, beam_width, depth, step_len)
    vocab_size = check_vocab(vocab_size, max(num_trees, shape.max_branching))
    return materialize([shape.tree(rng) for _ in range(num_trees)], rng, vocab_size)
