"""Seeded generators of realistic forests: the shapes benchmarks and tests train on.

Only the *shape* of a rollout batch matters to dtree's cost (prompt and answer
lengths, where trajectories branch, how deep, how many leaves), so token ids are
uniform random in ``[0, vocab_size)``. Each generator follows a published rollout
shape, takes every number as an overridable keyword, and is reproducible from
``seed`` (numpy ``Generator``; the same seed and arguments give identical
sequences and fields).

Three shapes:

* :func:`grpo` -- one prompt, G sampled answers (DeepSeekMath / DAPO groups);
* :func:`agentic` -- multi-turn tool-use trajectories under a ~5k-token system
  prompt, branching at tool calls and retries (tau^2-bench-like, ~9x compression);
* :func:`search` -- wide, deep trees of short reasoning steps (beam search / MCTS).

Every forest carries the fields :mod:`dtree.losses` reads:

* ``loss_mask``: 1 on model-generated tokens (answers, assistant turns, search
  steps), 0 on prompt, system and tool-output tokens. Entry ``t`` belongs to the
  prediction of token ``t``, so the first generated token after a prompt has mask 1;
* ``advantages``: one value per sequence, broadcast over its tokens, from rewards
  normalized within each tree (GRPO's group normalization: a tree is one prompt/task);
* ``old_logprobs``, ``ref_logprobs``: plausible negative token log-probs. They are
  drawn per *unique* token, so sequences that share a prefix share its values, as
  real log-probs of one prefix do.

Length arguments take an int (exact) or an inclusive ``(lo, hi)`` range. By
construction the children of a branch point start with distinct tokens (and trees
with distinct first tokens), so the trie is exactly the generated tree and its
compression ratio is exact, not an accident of random collisions.

Use :func:`make_workload` to build one by name with checked overrides, ``tiny=True``
for CPU-sized versions (:data:`TINY`), and :func:`describe` for report figures.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .tree import Forest

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "TINY",
    "WORKLOADS",
    "agentic",
    "describe",
    "grpo",
    "make_workload",
    "search",
    "workload_parameters",
]

# Llama-2's vocabulary size; any value works, token ids are only drawn from it.
DEFAULT_VOCAB_SIZE = 32000


# ---------------------------------------------------------------------- validation
def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _int_at_least(name: str, value: Any, low: int) -> int:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _length_range(name: str, value: Any, low: int = 1) -> tuple[int, int]:
    """An int (exact) or an inclusive ``(lo, hi)`` pair, as ``(lo, hi)``."""
    if _is_int(value):
        lo = hi = int(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
        lo, hi = int(value[0]), int(value[1])
    else:
        raise ValueError(f"{name} must be an int or an inclusive (lo, hi) pair of ints, got {value!r}")
    if lo < low or hi < lo:
        raise ValueError(f"{name} must satisfy {low} <= lo <= hi, got {value!r}")
    return lo, hi


def _choices(name: str, value: Any) -> tuple[int, ...]:
    """An int (fixed) or a non-empty sequence of ints >= 1 to draw from uniformly."""
    if _is_int(value):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value or not all(_is_int(v) and v >= 1 for v in value):
        raise ValueError(f"{name} must be an int >= 1 or a non-empty sequence of ints >= 1, got {value!r}")
    return tuple(int(v) for v in value)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _probability(name: str, value: Any) -> float:
    if not _is_real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _positive_float(name: str, value: Any) -> float:
    if not _is_real(value) or not (value > 0 and np.isfinite(value)):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


def _check_vocab(vocab_size: Any, distinct_needed: int) -> int:
    """Siblings (and trees) need distinct first tokens, so the vocabulary must hold them."""
    vocab_size = _int_at_least("vocab_size", vocab_size, 1)
    if vocab_size < distinct_needed:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: this workload needs {distinct_needed} distinct first tokens "
            "(siblings of a branch point and the trees of a batch must start differently)"
        )
    return vocab_size


def _draw(rng: np.random.Generator, spec: tuple[int, int], size: int | None = None) -> Any:
    """Uniform integers in the inclusive range ``spec``."""
    return rng.integers(spec[0], spec[1] + 1, size=size)


def _lognormal_length(rng: np.random.Generator, spec: tuple[int, int], median: float, sigma: float) -> int:
    """A long-tailed length: lognormal around ``median``, clipped to the inclusive range."""
    if spec[0] == spec[1]:
        return spec[0]
    return int(np.clip(np.rint(rng.lognormal(np.log(median), sigma)), spec[0], spec[1]))


def _rng(seed: Any) -> np.random.Generator:
    # An explicit int: numpy would also take None, which silently breaks reproducibility.
    return np.random.default_rng(_int_at_least("seed", seed, 0))


# ---------------------------------------------------------------------- tree skeleton
@dataclass
class _Tree:
    """A rollout tree before it has tokens: node lengths, loss flags and links."""

    length: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)  # 1 = model-generated, 0 = prompt / environment
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)  # nodes above (root = 0)
    children: list[list[int]] = field(default_factory=list)

    def add(self, parent: int, length: int, loss: int) -> int:
        node = len(self.length)
        self.length.append(int(length))
        self.loss.append(int(loss))
        self.parent.append(parent)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
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


def _materialize(trees: list[_Tree], rng: np.random.Generator, vocab_size: int) -> Forest:
    """Draw tokens and fields for the skeletons and build the forest (one sequence per leaf)."""
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
            nodes = tree_base[t] + np.asarray(tree.path(leaf))
            idx = np.concatenate([np.arange(starts[n], starts[n] + lengths[n]) for n in nodes])
            sequences.append(tokens[idx])
            masks.append(loss[idx])
            olds.append(old[idx])
            refs.append(ref[idx])
            advs.append(np.full(len(idx), a))
    return Forest.from_sequences(sequences, loss_mask=masks, advantages=advs, old_logprobs=olds, ref_logprobs=refs)


# ---------------------------------------------------------------------- generators
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
    rng = _rng(seed)
    num_prompts = _int_at_least("num_prompts", num_prompts, 1)
    prompt_spec = _length_range("prompt_len", prompt_len)
    groups = _choices("group_size", group_size)
    answer_spec = _length_range("answer_len", answer_len)
    vocab_size = _check_vocab(vocab_size, max(num_prompts, max(groups)))

    trees = []
    for _ in range(num_prompts):
        tree = _Tree()
        root = tree.add(-1, _draw(rng, prompt_spec), loss=0)
        g = int(rng.choice(groups))
        for length in _draw(rng, answer_spec, size=g):
            tree.add(root, length, loss=1)
        trees.append(tree)
    return _materialize(trees, rng, vocab_size)


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
    rng = _rng(seed)
    num_trees = _int_at_least("num_trees", num_trees, 1)
    sys_spec = _length_range("system_prompt_len", system_prompt_len)
    task_spec = _length_range("task_len", task_len, low=0)
    traj_spec = _length_range("trajectories", trajectories)
    min_turns, max_turns = _length_range("depth", depth)
    max_branching = _int_at_least("max_branching", max_branching, 1)
    stop_prob = _probability("stop_prob", stop_prob)
    turn_spec = _length_range("turn_len", turn_len)
    median = _positive_float("turn_len_median", turn_len_median)
    sigma = _positive_float("turn_len_sigma", turn_len_sigma)
    if target_unique_tokens is not None:
        target_unique_tokens = _int_at_least("target_unique_tokens", target_unique_tokens, 1)
    if max_branching < 2 and (traj_spec[1] > 1 or target_unique_tokens is not None):
        raise ValueError("max_branching must be >= 2 for more than one trajectory per tree")
    vocab_size = _check_vocab(vocab_size, max(num_trees, max_branching))

    def roll_out(tree: _Tree, node: int) -> None:
        """Continue one trajectory from ``node`` until it ends (iterative, any depth)."""
        while True:
            turns = tree.depth[node]  # the root prompt is turn 0
            if turns >= max_turns:
                return  # truncated at the turn limit
            if turns >= min_turns and tree.loss[node] == 1 and rng.random() < stop_prob:
                return  # final assistant answer
            length = _lognormal_length(rng, turn_spec, median, sigma)
            node = tree.add(node, length, loss=1 - tree.loss[node])

    def fork(tree: _Tree) -> None:
        """Branch a new trajectory off a random inner node with room for another child.

        Rejection sampling: most nodes of a tree are inner nodes with one child, so
        this takes a few draws (a scan settles the rare case of none). Inner nodes are
        below the turn limit by construction.
        """

        def open_node(n: int) -> bool:
            return 0 < len(tree.children[n]) < max_branching

        for _ in range(64):
            node = int(rng.integers(len(tree.length)))
            if open_node(node):
                break
        else:
            candidates = [n for n in range(len(tree.length)) if open_node(n)]
            if not candidates:
                raise ValueError(
                    f"no room for another trajectory: every branch point already has max_branching={max_branching} "
                    "children and every trajectory ends there; raise max_branching, depth or lower stop_prob"
                )
            node = candidates[int(rng.integers(len(candidates)))]
        length = _lognormal_length(rng, turn_spec, median, sigma)
        roll_out(tree, tree.add(node, length, loss=1 - tree.loss[node]))

    trees = []
    for _ in range(num_trees):
        tree = _Tree()
        root = tree.add(-1, int(_draw(rng, sys_spec)) + int(_draw(rng, task_spec)), loss=0)
        roll_out(tree, root)  # depth[0] >= 1, so the root has a child and fork() finds a node
        for _ in range(int(_draw(rng, traj_spec)) - 1):
            fork(tree)
        while target_unique_tokens is not None and tree.unique_tokens < target_unique_tokens:
            fork(tree)
        trees.append(tree)
    return _materialize(trees, rng, vocab_size)


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
    rng = _rng(seed)
    num_trees = _int_at_least("num_trees", num_trees, 1)
    prompt_spec = _length_range("prompt_len", prompt_len)
    branch_spec = _length_range("branching", branching)
    beam_width = _int_at_least("beam_width", beam_width, 1)
    depth = _int_at_least("depth", depth, 1)
    step_spec = _length_range("step_len", step_len)
    vocab_size = _check_vocab(vocab_size, max(num_trees, branch_spec[1]))

    trees = []
    for _ in range(num_trees):
        tree = _Tree()
        live = [tree.add(-1, _draw(rng, prompt_spec), loss=0)]
        for level in range(depth):
            candidates = []
            for u in live:
                k = int(_draw(rng, branch_spec))
                candidates.extend(tree.add(u, length, loss=1) for length in _draw(rng, step_spec, size=k))
            if level + 1 < depth and len(candidates) > beam_width:
                keep = rng.choice(len(candidates), size=beam_width, replace=False)
                candidates = [candidates[i] for i in sorted(keep)]
            live = candidates
        trees.append(tree)
    return _materialize(trees, rng, vocab_size)


# ---------------------------------------------------------------------- registry
WORKLOADS: dict[str, Callable[..., Forest]] = {"grpo": grpo, "agentic": agentic, "search": search}

# CPU-sized versions (``make_workload(name, tiny=True)``): a few hundred to a few
# thousand linearized tokens, the same shape in miniature, so a tiny model runs a
# step in well under a second. They need a vocabulary of at least 4 tokens.
TINY: dict[str, dict[str, Any]] = {
    "grpo": dict(num_prompts=2, prompt_len=(16, 48), group_size=(2, 4), answer_len=(8, 32)),
    "agentic": dict(
        num_trees=2,
        system_prompt_len=48,
        task_len=(4, 16),
        trajectories=(3, 6),
        depth=(3, 6),
        turn_len=(2, 24),
        turn_len_median=8.0,
    ),
    "search": dict(num_trees=2, prompt_len=(16, 32), branching=3, beam_width=2, depth=3, step_len=(4, 12)),
}


def workload_parameters(name: str) -> dict[str, Any]:
    """The overridable parameters of workload ``name`` and their defaults."""
    fn = _lookup(name)
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.name not in ("seed", "vocab_size")
    }


def _lookup(name: str) -> Callable[..., Forest]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(sorted(WORKLOADS))}")
    return WORKLOADS[name]


def make_workload(
    name: str, *, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE, tiny: bool = False, **overrides: Any
) -> Forest:
    """Build workload ``name`` (a key of :data:`WORKLOADS`).

    Args:
        seed: numpy seed; the same seed and arguments give the same forest.
        vocab_size: token ids are uniform in ``[0, vocab_size)``.
        tiny: start from the CPU-sized overrides in :data:`TINY`.
        **overrides: any parameter of the generator (see :func:`workload_parameters`);
            these win over ``tiny``.

    Raises:
        ValueError: unknown workload name, unknown parameter (the message lists the
            valid ones) or an invalid value.
    """
    fn = _lookup(name)
    valid = workload_parameters(name)
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for workload {name!r}; valid: {', '.join(valid)}")
    params = {**(TINY[name] if tiny else {}), **overrides}
    return fn(seed=seed, vocab_size=vocab_size, **params)


def describe(
    forest: Forest, flops_per_token: float | None = None, attn_flops_per_context_token: float | None = None
) -> dict[str, Any]:
    """Figures for reports: ``Forest.stats()`` plus sharing and loss-token counts.

    Adds ``flop_compression_ratio`` when both FLOP coefficients are given (see
    :meth:`Forest.flop_compression_ratio`).
    """
    out = forest.stats().as_dict()
    # Trees are contiguous in the depth-first layout, so per-tree unique tokens are
    # differences of the roots' first-token offsets.
    root_starts = forest.node_start[forest.tree_roots]
    tree_unique = np.diff(np.append(root_starts, forest.num_unique_tokens))
    kids = np.diff(forest.child_offsets)
    lengths = forest.sequence_lengths()
    out.update(
        max_tree_unique_tokens=int(tree_unique.max()),
        mean_tree_unique_tokens=float(tree_unique.mean()),
        mean_sequence_length=float(lengths.mean()),
        mean_branching=float(kids[kids > 0].mean()) if np.any(kids > 0) else 0.0,
    )
    if "loss_mask" in forest.fields:
        mask = forest.fields["loss_mask"].copy()
        mask[forest.seq_offsets[:-1]] = 0.0  # position 0 is never predicted
        out["loss_tokens"] = int(np.count_nonzero(mask))
    if flops_per_token is not None and attn_flops_per_context_token is not None:
        out["flop_compression_ratio"] = forest.flop_compression_ratio(flops_per_token, attn_flops_per_context_token)
    return out
