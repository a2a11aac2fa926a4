"""Model adapters: transformers causal LMs, and the protocol for custom modules."""

from __future__ import annotations

import torch

from .protocol import AttendFn, ModelSpec, TreeModule

__all__ = ["AttendFn", "ModelSpec", "TreeModule", "adapt", "compile_layers"]


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


def compile_layers(model: torch.nn.Module, **compile_kwargs) -> None:
    """``torch.compile`` the decoder layers of a transformers causal LM in place (see
    :meth:`dtree.models.hf.HFTreeModel.compile_layers`). dtree and its baselines all
    run the compiled layers afterwards. Custom modules compile their own blocks."""
    adapted = adapt(model)
    if not hasattr(adapted, "compile_layers"):
        raise TypeError(f"{type(model).__name__} is a custom TreeModule: compile its blocks yourself")
    adapted.compile_layers(**compile_kwargs)
