"""Adapters for the recurrent token mixers of transformers' hybrid models.

A recurrent layer (gated DeltaNet, Mamba, Mamba2, a short convolution, linear attention)
carries a state along the sequence, and transformers has no interface for it the way it
has one for attention. For each such class this package holds one adapter: it computes
what the class computes, from the module's own parameters and submodules (projections,
norms, gates), but runs the two parts that mix tokens, the causal convolution and the
recurrence, through dtree's segment-aware ops (:func:`dtree.ops.short_conv.causal_conv1d_segments`,
:func:`dtree.ops.linear_recurrence.linear_recurrence`), so each packed segment starts
from its parent's state and leaves its own on the state stack.

    mixer                  classes (transformers module)                     states
    gated DeltaNet         Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,      conv, recurrent
                           Qwen3_5MoeGatedDeltaNet, OlmoHybridGatedDeltaNet
    Kimi delta attention   KimiLinearDeltaAttention                           conv, recurrent
    Mamba2                 NemotronHMamba2Mixer, BambaMixer, FalconH1Mixer,   conv, recurrent
                           GraniteMoeHybridMambaLayer
    Mamba                  JambaMambaMixer                                    conv, recurrent
    short convolution      Lfm2ShortConv, Lfm2MoeShortConv                    conv
    lightning attention    MiniMaxLightningAttention                          recurrent

How an adapter is installed (as :mod:`dtree.models.families` does for attention):
:func:`install` replaces the class's ``forward`` once with a dispatcher that runs the
original unless a dtree model call is active in the current context; inside one, it
asks the call for the layer's :class:`~dtree.ops.segment_states.LayerStates`
(``AttentionCalls.states``, which the guard counts) and runs the adapter. Layer
checkpointing re-runs it in backward under the captured context, like attention.

Nothing is silently wrong: a module of an adapted class that lacks an attribute the
adapter reads (a transformers release that changed the class) is refused by name when
the model is wrapped; the one-time probe (:mod:`dtree.models.probe`) compares the
adapted model with its own forward, alone, packed and split at a branch; and a family
whose mixer has no adapter keeps failing the guard's per-layer check, naming it.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..families import adapted_classes
from ..guard import active_call
from .adapter import MixerAdapter
from .delta import DELTA_ADAPTERS
from .lightning import LIGHTNING_ADAPTERS
from .mamba import MAMBA_ADAPTERS
from .short_conv import SHORT_CONV_ADAPTERS

__all__ = ["MixerAdapter", "ADAPTERS", "ADAPTED_MIXERS", "adapter_of", "install", "state_shapes"]

ADAPTERS: tuple[MixerAdapter, ...] = DELTA_ADAPTERS + MAMBA_ADAPTERS + SHORT_CONV_ADAPTERS + LIGHTNING_ADAPTERS
_BY_CLASS = {(a.module, a.cls): a for a in ADAPTERS}
ADAPTED_MIXERS = tuple(a.cls for a in ADAPTERS)


def adapter_of(module: torch.nn.Module) -> MixerAdapter | None:
    """The adapter of ``module``'s class (None: not an adapted mixer)."""
    cls = type(module)
    return _BY_CLASS.get((cls.__module__, cls.__name__))


def state_shapes(module: torch.nn.Module, model_name: str) -> dict[str, tuple[int, ...]]:
    """The recurrent states of an adapted mixer: name -> shape (after checking that the
    module has every attribute its adapter reads)."""
    adapter = adapter_of(module)
    adapter.check(module, model_name)
    return adapter.states(module)


def _refuse_arguments(adapter: MixerAdapter, bound: inspect.BoundArguments) -> None:
    for name in ("attention_mask", "cache", "cache_params", "past_key_values"):
        if bound.arguments.get(name) is not None:
            raise ValueError(
                f"{adapter.cls} received {name} while dtree ran it: dtree passes no padding mask or cache to a "
                "recurrent layer (it carries the states itself)"
            )


# torch.compile'd decoder layers run the mixer eagerly (a graph break, as at the
# attention): its ops build host tables per call and read and write the state stack.
@torch._dynamo.disable
def _run(adapter: MixerAdapter, module: torch.nn.Module, states, hidden: torch.Tensor) -> torch.Tensor:
    return adapter.forward(module, states, hidden)


def _install_on_class(cls: type, adapter: MixerAdapter) -> None:
    current = cls.__dict__.get("forward")
    if getattr(current, "__dtree_mixer__", None) is adapter:
        return
    original = cls.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def dispatch(self, *args, **kwargs):
        calls = active_call()
        if calls is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        _refuse_arguments(adapter, bound)
        hidden = bound.arguments["hidden_states"]
        if hidden.dim() != 3 or hidden.shape[0] != 1:
            raise ValueError(f"dtree runs one packed row per call, got hidden states of shape {tuple(hidden.shape)}")
        out = _run(adapter, self, calls.states(self), hidden.squeeze(0)).unsqueeze(0)
        return (out, None) if adapter.returns_tuple else out

    dispatch.__dtree_mixer__ = adapter
    cls.forward = dispatch


def install(model: torch.nn.Module) -> list[str]:
    """Install the adapter of every adapted mixer class in ``model`` (once per class).
    Returns the adapted class names found."""
    found = adapted_classes(model, adapter_of)
    for cls, adapter in found.values():
        _install_on_class(cls, adapter)
    return sorted(found)
