"""Where a model's decoder layers live: the one finder that layer checkpointing
(:func:`dtree.models.checkpointing.decoder_layers`), the guard and the transformers adapter
(:mod:`dtree.models.hf`) share."""

from __future__ import annotations

import torch

__all__ = ["LAYER_LIST_PATHS", "find_decoder_layers"]

# Where decoder layers live: transformers causal LMs keep them at ``<base model>.layers``
# (GPT-2 ``.h``, OPT ``.decoder.layers``); custom TreeModules (e.g. tests/nanogpt.py) at
# one of these on the module itself.
LAYER_LIST_PATHS = ("layers", "h", "blocks", "decoder.layers", "transformer.h")


def find_decoder_layers(model: torch.nn.Module, num_layers: int | None = None) -> torch.nn.ModuleList | None:
    """The ``ModuleList`` of ``model``'s decoder layers, or None if none is found.

    Looked for at :data:`LAYER_LIST_PATHS` on the base model (``model.base_model_prefix``,
    else ``model.model`` or ``model.transformer``: Llama4ForCausalLM names a prefix it
    does not use), then on ``model`` itself. With ``num_layers``, only a list of that
    length counts, and when no path holds one, the first ``ModuleList`` of
    ``num_layers`` modules anywhere in ``model`` (a multimodal model's language model).
    """
    prefix = getattr(model, "base_model_prefix", None)
    owners = [getattr(model, name, None) for name in (prefix, "model", "transformer") if name]
    owners = [o for o in owners if isinstance(o, torch.nn.Module)] + [model]
    for owner in owners:
        for path in LAYER_LIST_PATHS:
            layers = owner
            for name in path.split("."):
                layers = getattr(layers, name, None)
            if isinstance(layers, torch.nn.ModuleList) and len(layers) and len(layers) == (num_layers or len(layers)):
                return layers
    if num_layers is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
                return module
    return None
