"""What a step's plan reads of the model, from one walk of its modules and parameters.

The plan asks several questions of the model every step (where it lives, whether HF
gradient checkpointing is on, which gradients are missing, whether a module is in training
mode, the per-token figures' cache key): each used to walk the modules or parameters again,
~10 ms of host time per step on an H100 host for qwen2.5-1.5b, all of it before the step's
first kernel (``benchmarks/plan_profile.py``). :func:`model_view` walks once per call; the
runtime hands the view to its checks, the lean-layer swap and the step's gradient stash too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import unwrap
from ..models.checkpointing import decoder_layers
from ..models.instance_attrs import module_attr

__all__ = ["ModelView", "model_view"]


@dataclass(frozen=True)
class ModelView:
    """The model's modules and parameters as they are now (one walk each), and what the
    plan derives from them.

    Attributes:
        modules, parameters: ``module.modules()``, ``module.parameters()``.
        hf_checkpointing: HF gradient checkpointing is on for some module in training mode
            (it then checkpoints the layers itself and dtree adds no checkpoint).
        can_checkpoint: dtree finds the decoder layer list to checkpoint.
        training: some module is in training mode (model calls may draw random numbers).
    """

    modules: tuple[torch.nn.Module, ...]
    parameters: tuple[torch.nn.Parameter, ...]
    hf_checkpointing: bool
    can_checkpoint: bool
    training: bool


def _can_checkpoint_layers(module: torch.nn.Module) -> bool:
    """Whether dtree finds ``module``'s decoder layer list (to checkpoint its layers)."""
    try:
        decoder_layers(unwrap(module))
    except ValueError:
        return False
    return True


def _parameters(modules: tuple[torch.nn.Module, ...]) -> tuple[torch.nn.Parameter, ...]:
    """``module.parameters()`` from its walked ``modules`` (``module.modules()``, in that order):
    each module's own parameters in turn, a shared one (tied embeddings) once, where it first
    appears; no second walk of the module tree."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return tuple(out)


def model_view(module: torch.nn.Module) -> ModelView:
    """``module`` as a step's plan reads it (see :class:`ModelView`)."""
    modules = tuple(module.modules())
    return ModelView(
        modules=modules,
        parameters=_parameters(modules),
        hf_checkpointing=any(module_attr(m, "gradient_checkpointing", False) is True and m.training for m in modules),
        can_checkpoint=_can_checkpoint_layers(module),
        training=any(m.training for m in modules),
    )
