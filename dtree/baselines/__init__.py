"""The baselines dtree is measured against (docs/design.md section 8), with dtree's interface.

- ``linearized`` (:class:`LinearizedTrainer`): every sequence on its own, packed varlen,
  as verl/OpenRLHF/TRL train today.
- ``tree-mask`` (:class:`TreeMaskTrainer`): each tree packed into one row under a tree
  attention mask (AReaL's "sparse" mode, Tree Training's Tree Packing).

Both have ``forward_backward(forest, loss) -> StepOutput`` like :class:`dtree.TreeRuntime`
and give the same loss and gradients; all three use the same chunked LM-head log-probs,
so a benchmark measures the effect of the tree alone.
"""

from __future__ import annotations

import torch

from ..config import RuntimeConfig
from ..engine.runtime import TreeRuntime
from .linearized import LinearizedTrainer
from .tree_mask import TreeMaskTrainer

__all__ = ["METHODS", "LinearizedTrainer", "TreeMaskTrainer", "make_method"]

METHODS = ("dtree", "linearized", "tree-mask")


def make_method(name: str, model: torch.nn.Module, **kw):
    """The trainer a benchmark runs under ``name``: ``"dtree"`` (:class:`TreeRuntime`;
    ``kw`` are the fields of its :class:`~dtree.config.RuntimeConfig`), ``"linearized"``
    or ``"tree-mask"`` (``kw`` goes to the constructor)."""
    if name == "dtree":
        return TreeRuntime(model, config=RuntimeConfig(**kw))
    if name == "linearized":
        return LinearizedTrainer(model, **kw)
    if name == "tree-mask":
        return TreeMaskTrainer(model, **kw)
    raise ValueError(f"unknown method {name!r}; choose one of {METHODS}")
