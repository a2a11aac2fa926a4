"""The multi-turn tool-use shape: :func:`agentic` trajectory trees (tau^2-bench-like),
grown in named phases: check the shape (:class:`AgenticShape`), then per tree a prompt,
a first trajectory (:func:`_roll_out`) and forks off random inner nodes (:func:`_fork`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..forest.forest import Forest
from .arguments import (
    DEFAULT_VOCAB_SIZE,
    check_vocab,
    draw,
    int_at_least,
    length_range,
    lognormal_length,
    make_rng,
    positive_float,
    probability,
)
from .skeleton import TreeSkeleton, materialize

__all__ = ["AgenticShape", "agentic"]


def agentic(
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    num_trees: int = 4,
    system_prompt_len: int | tuple[int, int] = (4500, 5500),
    task_len: int | tuple[int, int] = (50, 400),
    trajectories: int | tuple[int, int] = (16, 32),
    depth: int | tuple[int, int] = (3, 10),
    max_branching: int = 4,
    stop_prob: float = 0.5,
    turn_len: int | tuple[int, int] = (30, 2000),
    turn_len_median: float = 100.0,
    turn_len_sigma: float = 1.0,
    target_unique_tokens: int | None = None,
    context_window: int | None = None,
) -> Forest:
    """Multi-turn tool-use trajectory trees (tau^2-bench-like), one tree per task.

    Shape of one tree: a root of ``system_prompt_len + task_len`` prompt tokens (loss 0;
    the ~5k-token system prompt is the domain policy that every trajectory of the task
    shares), then turns that alternate assistant (loss 1) and environment (tool result
    or simulated user, loss 0), starting with the assistant.

    * **Trajectories.** The first trajectory is rolled out from the prompt. Each
      further one (``trajectories`` per tree, drawn per tree) forks from a uniformly
      random inner node that has fewer than ``max_branching`` children: after an
      assistant turn it is an alternative tool call / tool result, after a tool result
      a retry of the assistant turn, at the root an independent sample. Every fork
      adds one leaf, so branch points have 2 to ``max_branching`` (4) children.
    * **Depth.** A trajectory has ``depth`` (3 to 10) turns: once it has ``depth[0]``
      turns it may end after each assistant turn (a final answer, probability
      ``stop_prob``), and it is truncated at ``depth[1]`` turns (a turn limit).
    * **Turn lengths** are long-tailed: lognormal with median ``turn_len_median``
      (100: a tool call or a short reply) and log-sd ``turn_len_sigma``, clipped to
      ``turn_len`` (30 to 2000 tokens: big tool outputs, long reasoning).
    * **Context window** (``context_window``, default none): no path is longer. A
      trajectory whose context is full ends there, its last turn cut to the room left,
      as a rollout stops at the inference engine's ``max_model_len``; a node with less
      room than the shortest turn is never forked from.

    Compression: real tau^2-bench-like rollouts compress about 9x (linearized /
    unique tokens; the figure this project calibrates against). A tree's ratio tends
    to ``(prompt + path) / (unique tokens a fork adds)``: with a ~5.2k prompt, paths
    of ~7 turns x ~165 tokens and forks adding ~2.5 turns (``stop_prob=0.5``), that
    is about 9x once a tree has a few dozen trajectories, hence 16 to 32. Measured
    with the defaults over seeds 0-49: mean 9.2x, sd 0.65, range 7.8x to 10.5x;
    about 600k linearized and 66k unique tokens.

    ``target_unique_tokens``: keep forking each tree until it has at least this many
    unique tokens (``trajectories`` is then a minimum). Use it for large agent trees,
    e.g. 64k+ unique tokens, too many for one packed sequence.
    """
    rng = make_rng(seed)
    num_trees = int_at_least("num_trees", num_trees, 1)
    shape = AgenticShape.checked(
        system_prompt_len, task_len, trajectories, depth, max_branching, stop_prob, turn_len, turn_len_median,
        turn_len_sigma, target_unique_tokens, context_window,
    )
    vocab_size = check_vocab(vocab_size, max(num_trees, shape.max_branching))
    trees = [shape.tree(rng) for _ in range(num_trees)]
    return materialize(trees, rng, vocab_size)


@dataclass(frozen=True)
class AgenticShape:
    """The checked per-tree parameters of :func:`agentic` (ranges as inclusive pairs)."""

    system_prompt: tuple[int, int]
    task: tuple[int, int]
    trajectories: tuple[int, int]
    min_turns: int
    max_turns: int
    max_branching: int
    stop_prob: float
    turn: tuple[int, int]
    turn_median: float
    turn_sigma: float
    target_unique_tokens: int | None
    context_window: int | None = None

    @classmethod
    def checked(
        cls, system_prompt_len, task_len, trajectories, depth, max_branching, stop_prob, turn_len, turn_len_median,
        turn_len_sigma, target_unique_tokens=None, context_window=None,
    ) -> "AgenticShape":
        # checked in the order of the signature: the first bad argument is the one named
        system_prompt = length_range("system_prompt_len", system_prompt_len)
        task = length_range("task_len", task_len, low=0)
        traj_spec = length_range("trajectories", trajectories)
        min_turns, max_turns = length_range("depth", depth)
        max_branching = int_at_least("max_branching", max_branching, 1)
        stop_prob = probability("stop_prob", stop_prob)
        turn = length_range("turn_len", turn_len)
        turn_median = positive_float("turn_len_median", turn_len_median)
        turn_sigma = positive_float("turn_len_sigma", turn_len_sigma)
        if target_unique_tokens is not None:
            target_unique_tokens = int_at_least("target_unique_tokens", target_unique_tokens, 1)
        if context_window is not None:
            # the longest prompt must leave room for one turn, or a tree could have no trajectory
            context_window = int_at_least("context_window", context_window, system_prompt[1] + task[1] + turn[0])
        shape = cls(
            system_prompt, task, traj_spec, min_turns, max_turns, max_branching, stop_prob, turn, turn_median,
            turn_sigma, target_unique_tokens, context_window,
        )
        if max_branching < 2 and (traj_spec[1] > 1 or target_unique_tokens is not None):
            raise ValueError("max_branching must be >= 2 for more than one trajectory per tree")
        return shape

    def tree(self, rng: np.random.Generator) -> TreeSkeleton:
        """One task's tree (see :func:`_grow_tree`)."""
        return _grow_tree(self, rng)

    def has_room(self, tree: TreeSkeleton, node: int) -> bool:
        """Whether the shortest turn still fits in the context after ``node``."""
        return self.context_window is None or tree.end[node] + self.turn[0] <= self.context_window


def _grow_tree(shape: AgenticShape, rng: np.random.Generator) -> TreeSkeleton:
    """One task's tree: the prompt, a first trajectory, then forks until it has its
    drawn number of trajectories (and ``target_unique_tokens``)."""
    tree = TreeSkeleton()
    root = tree.add(-1, int(draw(rng, shape.system_prompt)) + int(draw(rng, shape.task)), loss=0)
    _roll_out(tree, root, shape, rng)  # depth[0] >= 1, so the root has a child and _fork finds a node
    for _ in range(int(draw(rng, shape.trajectories)) - 1):
        _fork(tree, shape, rng)
    while shape.target_unique_tokens is not None and tree.unique_tokens < shape.target_unique_tokens:
        _fork(tree, shape, rng)
    return tree


def _add_turn(tree: TreeSkeleton, node: int, shape: AgenticShape, rng: np.random.Generator) -> int:
    """A turn after ``node``, of the other speaker (assistant <-> environment), cut to
    the room left in the context window."""
    length = lognormal_length(rng, shape.turn, shape.turn_median, shape.turn_sigma)
    if shape.context_window is not None:
        length = min(length, shape.context_window - tree.end[node])
    return tree.add(node, length, loss=1 - tree.loss[node])


def _roll_out(tree: TreeSkeleton, node: int, shape: AgenticShape, rng: np.random.Generator) -> None:
    """Continue one trajectory from ``node`` until it ends (iterative, any depth)."""
    while True:
        turns = tree.depth[node]  # the root prompt is turn 0
        if turns >= shape.max_turns:
            return  # truncated at the turn limit
        if not shape.has_room(tree, node):
            return  # truncated at the context window
        if turns >= shape.min_turns and tree.loss[node] == 1 and rng.random() < shape.stop_prob:
            return  # final assistant answer
        node = _add_turn(tree, node, shape, rng)


def _fork(tree: TreeSkeleton, shape: AgenticShape, rng: np.random.Generator) -> None:
    """Branch a new trajectory off a random inner node with room for another child."""
    node = _open_node(tree, shape, rng)
    _roll_out(tree, _add_turn(tree, node, shape, rng), shape, rng)


def _open_node(tree: TreeSkeleton, shape: AgenticShape, rng: np.random.Generator) -> int:
    """A uniformly random inner node with fewer than ``max_branching`` children (and
    room in the context window for another turn).

    Rejection sampling: most nodes of a tree are inner nodes with one child, so this
    takes a few draws (a scan settles the rare case of none). Inner nodes are below
    the turn limit by construction.
    """
    max_branching = shape.max_branching

    def is_open(n: int) -> bool:
        return 0 < len(tree.children[n]) < max_branching and shape.has_room(tree, n)

    for _ in range(64):
        node = int(rng.integers(len(tree.length)))
        if is_open(node):
            return node
    candidates = [n for n in range(len(tree.length)) if is_open(n)]
    if not candidates:
        raise ValueError(
            f"no room for another trajectory: every branch point already has max_branching={max_branching} "
            "children (or a full context window) and every trajectory ends there; raise max_branching, depth "
            "or context_window, or lower stop_prob"
        )
    return candidates[int(rng.integers(len(candidates)))]
