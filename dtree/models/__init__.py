"""Model adapters: transformers causal LMs, and the protocol for custom modules."""

from __future__ import annotations

import torch

from .protocol import AttendFn, ModelSpec, TreeModule

__all__ = ["AttendFn", "ModelSpec", "TreeModule", "adapt"]


def adapt(model: torch.nn.Module) -> TreeModule:
    """The :class:`TreeModule` view of ``model``: itself if it implements the protocol,
    else the transformers adapter."""
    if isinstance(model, TreeModule):
        return model
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        from .hf import HFTreeModel

        return HFTreeModel(model)
    raise TypeError(
        f"{type(model).__name__} is neither a transformers causal LM nor a dtree.models.TreeModule "
        "(dtree_spec / dtree_hidden_states / dtree_output_layer); see dtree/models/protocol.py"
    )
