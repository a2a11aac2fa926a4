"""The workloads by name: :data:`WORKLOADS`, their CPU-sized versions (:data:`TINY`),
:func:`make_workload` with checked overrides, and :func:`describe` for report figures."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np

from ..forest.forest import Forest
from .arguments import DEFAULT_VOCAB_SIZE
from .mixed import mixed
from .shapes import grpo, search
from .tool_use import agentic

__all__ = ["TINY", "WORKLOADS", "describe", "make_workload", "workload_parameters"]

WORKLOADS: dict[str, Callable[..., Forest]] = {"grpo": grpo, "agentic": agentic, "search": search, "mixed": mixed}

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
# the mixed batch in miniature: the three tiny shapes (without their tree counts), and no
# length bounds (the full-size ones are 1k and 32k)
_COUNT = {"grpo": "num_prompts", "agentic": "num_trees", "search": "num_trees"}
TINY["mixed"] = dict(
    grpo_groups=2, agentic_trees=1, search_trees=2, min_sequence_len=None, max_sequence_len=None,
    **{f"{k}_args": {p: v for p, v in TINY[k].items() if p != _COUNT[k]} for k in ("grpo", "agentic", "search")},
)


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
