"""Model adapters: transformers causal LMs, and the protocol for custom modules."""

from __future__ import annotations

import torch

from .protocol import AttendFn, ModelSpec, TreeModule

__all__ = ["AttendFn", "ModelSpec", "TreeModule", "adapt", "compile_layers", "unwrap"]

ACCEPTED = (
    "dtree accepts a transformers causal LM (AutoModelForCausalLM), a PEFT PeftModel wrapping one, either of "
    "them torch.compile'd, or a module implementing dtree.models.TreeModule "
    "(dtree_spec / dtree_hidden_states / dtree_output_layer; see dtree/models/protocol.py)"
)


def _is_peft_wrapper(model: torch.nn.Module) -> bool:
    return type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def _is_peft_tuner(model: torch.nn.Module) -> bool:  # e.g. LoraModel, a PeftModel's .base_model
    return type(model).__module__.startswith("peft.tuners") and isinstance(getattr(model, "model", None), torch.nn.Module)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module dtree runs: ``model`` itself, or the model inside a ``torch.compile``
    wrapper (``_orig_mod``) or a PEFT ``PeftModel`` (``get_base_model()``, whose modules
    are the adapter-injected ones). The parameters are the same tensors, so
    ``param.grad`` lands where the user's optimizer looks."""
    from torch._dynamo.eval_frame import OptimizedModule

    while True:
        if isinstance(model, OptimizedModule):
            model = model._orig_mod
        elif _is_peft_wrapper(model):
            config = model.active_peft_config
            if getattr(config, "is_prompt_learning", False):
                raise ValueError(
                    f"PEFT {config.peft_type} is a prompt-learning adapter: it adds virtual tokens to every "
                    "sequence, which dtree does not model. Use an adapter that wraps modules (LoRA, IA3, ...)"
                )
            model = model.get_base_model()
        elif _is_peft_tuner(model):
            model = model.model
        else:
            return model


def adapt(model: torch.nn.Module) -> TreeModule:
    """The :class:`TreeModule` view of ``model`` (after :func:`unwrap`): itself if it
    implements the protocol, else the transformers adapter."""
    model = unwrap(model)
    if isinstance(model, TreeModule):
        return model
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        from .hf import HFTreeModel

        return HFTreeModel(model)
    raise TypeError(f"{type(model).__name__} is neither a transformers causal LM nor a dtree.models.TreeModule: {ACCEPTED}")


def compile_layers(model: torch.nn.Module, **compile_kwargs) -> None:
    """``torch.compile`` the decoder layers of a transformers causal LM in place (see
    :meth:`dtree.models.hf.HFTreeModel.compile_layers`). dtree and its baselines all
    run the compiled layers afterwards. Custom modules compile their own blocks."""
    adapted = adapt(model)
    if not hasattr(adapted, "compile_layers"):
        raise TypeError(f"{type(model).__name__} is a custom TreeModule: compile its blocks yourself")
    adapted.compile_layers(**compile_kwargs)
