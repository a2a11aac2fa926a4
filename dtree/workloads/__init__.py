"""Seeded generators of realistic forests: the shapes benchmarks and tests train on.

Only the *shape* of a rollout batch matters to dtree's cost (prompt and answer
lengths, where trajectories branch, how deep, how many leaves), so token ids are
uniform random in ``[0, vocab_size)``. Each generator follows a published rollout
shape, takes every number as an overridable keyword, and is reproducible from
``seed`` (numpy ``Generator``; the same seed and arguments give identical
sequences and fields).

Three shapes, and a batch of all three:

* :func:`grpo` -- one prompt, G sampled answers (DeepSeekMath / DAPO groups);
* :func:`agentic` -- multi-turn tool-use trajectories under a ~5k-token system
  prompt, branching at tool calls and retries (tau^2-bench-like, ~9x compression);
* :func:`search` -- wide, deep trees of short reasoning steps (beam search / MCTS);
* :func:`mixed` -- one global batch of GRPO groups with short answers, deep agentic
  trees with 32k contexts and search trees of many small nodes (sequences of 1k to
  32k tokens): the batch on which balancing by token count goes wrong.

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

Modules: :mod:`~dtree.workloads.shapes` (``grpo``, ``search``),
:mod:`~dtree.workloads.tool_use` (``agentic``), :mod:`~dtree.workloads.mixed`
(``mixed``, ``mixed_batch``), :mod:`~dtree.workloads.skeleton` (a
tree before its tokens, and drawing them), :mod:`~dtree.workloads.arguments` (checked
arguments), :mod:`~dtree.workloads.registry` (by name).
"""

from __future__ import annotations

from .arguments import DEFAULT_VOCAB_SIZE
from .mixed import MixedBatch, mixed, mixed_batch
from .registry import TINY, WORKLOADS, describe, make_workload, workload_parameters
from .shapes import grpo, search
from .tool_use import agentic

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "TINY",
    "WORKLOADS",
    "MixedBatch",
    "agentic",
    "describe",
    "grpo",
    "make_workload",
    "mixed",
    "mixed_batch",
    "search",
    "workload_parameters",
]
