"""MixerAdapter: what dtree knows about one recurrent mixer class, and helpers the
adapters share (the module's convolution, its activation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...ops.segment_states import LayerStates

__all__ = ["MixerAdapter", "conv_weights", "activation", "plain", "transformers_version"]

#: The transformers releases the adapters were tested against (tests/test_families.py in CI).
TESTED_TRANSFORMERS = ("5.10.4", "5.24.0")


@dataclass(frozen=True)
class MixerAdapter:
    """One adapted mixer class.

    Attributes:
        module, cls: where the class lives in transformers and its name.
        forward: ``(module, states, hidden [T, H]) -> [T, H]``, the module's forward over
            one packed call, its recurrences through ``states``.
        states: ``module -> {name: shape}``, the states the forward keeps per segment.
        reads: attribute paths the forward reads (checked when a model is wrapped;
            ``a|b`` accepts either, for a class whose attributes changed between releases).
        returns_tuple: the original forward returns ``(output, weights)`` (MiniMax).
    """

    module: str
    cls: str
    forward: Callable[[torch.nn.Module, LayerStates, torch.Tensor], torch.Tensor]
    states: Callable[[torch.nn.Module], dict[str, tuple[int, ...]]]
    reads: tuple[str, ...]
    returns_tuple: bool = False

    def check(self, module: torch.nn.Module, model_name: str) -> None:
        """Raise a ValueError naming the class and the attribute when ``module`` lacks one
        the adapter reads (a transformers release that changed the class)."""
        for path in self.reads:
            if not any(_has(module, alternative) for alternative in path.split("|")):
                raise ValueError(
                    f"{model_name}: {self.cls} has no attribute {path!r} in transformers {transformers_version()}, "
                    f"which dtree's adapter for this recurrent layer reads (tested with transformers "
                    f"{' and '.join(TESTED_TRANSFORMERS)}); dtree cannot run it exactly: install a transformers "
                    "release dtree supports (see pyproject.toml) or report it"
                )


def _has(module, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
    return True


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def conv_weights(module: torch.nn.Module, *names: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([C, K] depthwise kernel, [C] bias or None) of the module's causal convolution:
    ``conv1d`` (or the given attribute), or separate convolutions concatenated in the
    given order (OLMo-hybrid before transformers 5.11 convolves q, k and v apart)."""
    convs = [getattr(module, n) for n in names if hasattr(module, n)]
    if not convs:
        raise AttributeError(f"{type(module).__name__} has none of the convolutions {names}")
    for conv in convs:
        plain(module, conv, torch.nn.Conv1d, "convolution")
    weight = torch.cat([c.weight.squeeze(1) for c in convs])
    biases = [c.bias for c in convs]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else c.weight.new_zeros(c.weight.shape[0]) for b, c in zip(biases, convs)]
    )
    return weight, bias


def plain(owner: torch.nn.Module, sub: torch.nn.Module, cls: type, what: str) -> torch.nn.Module:
    """``sub`` itself, after checking that it is a plain ``cls`` without hooks: the adapter
    reads its weight directly (as transformers does), so an adapter (LoRA) or a hook on it
    would be skipped silently; refused by name instead."""
    if not isinstance(sub, cls) or sub._forward_hooks or sub._forward_pre_hooks:
        raise ValueError(
            f"{type(owner).__name__}'s {what} is a {type(sub).__module__}.{type(sub).__name__} (or carries hooks), "
            f"not a plain torch.nn.{cls.__name__}: dtree's recurrent adapter reads its weight directly, as "
            "transformers does, so an adapter (LoRA) or a hook on it would be skipped; leave it out of the adapter's "
            "target modules"
        )
    return sub


def activation(module: torch.nn.Module, default: str = "silu") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation after the module's convolution: its ``act`` module, else
    ``ACT2FN[module.activation]``, else ``default``."""
    act = getattr(module, "act", None)
    if isinstance(act, torch.nn.Module):
        return act
    from transformers.activations import ACT2FN

    return ACT2FN[getattr(module, "activation", None) or default]
