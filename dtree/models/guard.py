"""Per-call accounting of a transformers model's attention while dtree runs it.

dtree replaces only the attention of a model; everything else is the model's own code.
That is exact when every decoder layer's attention goes through dtree (the registered
attention function, or a family adapter of :mod:`dtree.models.families`) exactly
once per model call, with the K/V shapes the KV stack was built for. A layer whose
attention bypasses dtree would run the model's own attention on the packed row with
no mask at all, and be silently wrong. So every model call is checked:
:class:`AttentionCalls` wraps the runtime's ``attend``, counts the calls of each
layer, checks the K/V shapes, and :meth:`AttentionCalls.check_every_layer` raises a
``ValueError`` naming the model and the attention class that bypassed it.

The active call travels in a :class:`contextvars.ContextVar`, not in the model's
keyword arguments: decoder layers that drop ``**kwargs`` (StableLM) would lose it.
:func:`activate` sets it for the duration of one model call; ``contextvars.copy_context``
carries it into a checkpointed layer's re-run inside backward: dtree's
(:mod:`dtree.models.checkpointing`) and HF gradient checkpointing's (the adapter wraps the
layers' checkpoint function during the call, :mod:`dtree.models.hf`). A re-run calls the
same :class:`AttentionCalls` after :meth:`~AttentionCalls.check_every_layer` ran, so it
is not counted against the call.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

from .protocol import AttendFn, ModelSpec

__all__ = ["AttentionCalls", "activate", "active_call", "describe_layer"]

_ACTIVE: contextvars.ContextVar["AttentionCalls | None"] = contextvars.ContextVar("dtree_attention_call", default=None)


def active_call() -> "AttentionCalls | None":
    """The model call dtree is running in this context, or None outside dtree."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activate(calls: "AttentionCalls") -> Iterator[None]:
    token = _ACTIVE.set(calls)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _attention_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """Submodules of a decoder layer that look like its attention (class name)."""
    return [m for m in layer.modules() if m is not layer and "attention" in type(m).__name__.lower()]


# class-name fragments of linear-attention layers (a recurrent state instead of softmax over keys)
_LINEAR_ATTENTION = ("linear", "delta", "lightning", "retention", "mamba")


def describe_layer(layer: torch.nn.Module) -> str:
    """Why a decoder layer may not have called dtree's attention, for error messages."""
    attention = _attention_modules(layer)
    if attention and any(k in type(attention[0]).__name__.lower() for k in _LINEAR_ATTENTION):
        return (
            f"{type(attention[0]).__name__} is a linear-attention (recurrent) layer that dtree has no adapter for: it "
            "carries state along the sequence, and dtree carries the states only of the recurrent layers it knows "
            "(dtree/models/mixers)"
        )
    if attention:
        return (
            f"attention of {type(attention[0]).__name__} does not use transformers' attention interface "
            "(and dtree has no adapter for it in dtree/models/families.py)"
        )
    children = sorted({type(m).__name__ for m in layer.children()})
    return (
        f"{type(layer).__name__} has no attention module: its token mixer (one of {children}) is a recurrent, "
        "state-space or convolution layer that dtree has no adapter for; dtree carries the states only of the "
        "recurrent layers it knows (dtree/models/mixers)"
    )


class AttentionCalls:
    """The attention callback of one model call: forwards to ``attend`` and keeps count.

    Args:
        attend: the runtime's (or a baseline's) ``attend(layer, q, k, v, scale, **options)``;
            for recurrent layers, its ``attend.states(layer)`` (absent: the method cannot
            carry recurrent states).
        spec: the shapes the stacks were built for (which layers attend, which are recurrent).
        model_name: the model class, for error messages.
        layer_of: maps an attention module without an integer ``layer_idx`` to its
            decoder layer index (None when it is not inside a decoder layer).
    """

    def __init__(
        self,
        attend: AttendFn,
        spec: ModelSpec,
        model_name: str,
        layer_of: Callable[[torch.nn.Module], int | None],
    ) -> None:
        self.attend, self.spec, self.model_name, self._layer_of = attend, spec, model_name, layer_of
        self.counts = [0] * spec.num_layers
        self.recurrent_counts = [0] * spec.num_layers

    def layer_index(self, module: torch.nn.Module) -> int:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or isinstance(layer, bool):
            layer = self._layer_of(module)
        if layer is None or not 0 <= layer < self.spec.num_layers:
            raise ValueError(
                f"{self.model_name}: {type(module).__name__} called dtree's attention as layer {layer}, outside the "
                f"model's {self.spec.num_layers} decoder layers (config.num_hidden_layers); dtree cannot place its K/V "
                "on the stack"
            )
        return layer

    def __call__(
        self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **options
    ) -> torch.Tensor:
        """q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] of ``module``'s layer -> [T, Hq, Dv]."""
        layer = self.layer_index(module)
        shape = self.spec.kv_shape(layer)
        if shape is None:
            raise ValueError(
                f"{self.model_name}: {type(module).__name__} of layer {layer} called dtree's attention, but dtree "
                "found no attention module in that layer (it sized no K/V stack for it)"
            )
        expected_k, expected_v = shape[:2], (shape[0], shape[2])
        if tuple(k.shape[1:]) != expected_k or tuple(v.shape[1:]) != expected_v:
            raise ValueError(
                f"{self.model_name}: the attention of layer {layer} ({type(module).__name__}) gives K of "
                f"{tuple(k.shape[1:])} and V of {tuple(v.shape[1:])} (heads, dim) per token, but dtree sized its KV "
                f"stack from the config for K {expected_k} and V {expected_v}; layers with other K/V shapes than the "
                "config's are not supported"
            )
        self.counts[layer] += 1
        return self.attend(layer, q, k, v, scale, **options)

    # torch.compile'd decoder layers break their graph here (as at the registered attention
    # function): the stack attention does host work and mutates the KV stack. Family adapters
    # call this from inside the compiled layer.
    __call__ = torch._dynamo.disable(__call__)

    @torch._dynamo.disable
    def states(self, module: torch.nn.Module):
        """The recurrent states of ``module``'s layer for this call (a recurrent mixer
        adapter asks once per layer; :mod:`dtree.models.mixers`)."""
        layer = self.layer_index(module)
        if layer not in self.spec.recurrent_layers:
            raise ValueError(
                f"{self.model_name}: {type(module).__name__} of layer {layer} asked for recurrent states, but dtree "
                "sized no state stack for that layer"
            )
        states = getattr(self.attend, "states", None)
        if states is None:
            raise ValueError(
                f"{self.model_name}: layer {layer} is a recurrent layer ({type(module).__name__}), and this method's "
                "attention cannot carry recurrent states (a tree mask cannot express a state that flows along each "
                "path); train it with dtree.TreeRuntime or the linearized baseline"
            )
        self.recurrent_counts[layer] += 1
        return states(layer)

    def check_every_layer(self, layers: list[torch.nn.Module]) -> None:
        """Raise a ValueError unless every attending layer called the attention exactly
        once and every recurrent layer ran its adapted mixer exactly once."""
        spec = self.spec
        for i in range(spec.num_layers):
            expected = int(spec.kv_shape(i) is not None)
            if self.counts[i] > 1 or self.recurrent_counts[i] > 1:
                what = "attention" if self.counts[i] > 1 else "recurrent states"
                times = max(self.counts[i], self.recurrent_counts[i])
                raise ValueError(
                    f"{self.model_name}: layer index {i} called dtree's {what} {times} times in one model call "
                    "(modules sharing a layer_idx, or a layer that attends twice); dtree keeps one K/V and one set of "
                    "states per layer and cannot run this model"
                )
            if self.recurrent_counts[i] != int(i in spec.recurrent_layers):
                raise ValueError(
                    f"{self.model_name}: decoder layer {i} ran its recurrent mixer without dtree's adapter: dtree "
                    "refuses rather than let it mix the packed sequences"
                )
            if self.counts[i] != expected:
                bad = [j for j in range(spec.num_layers) if self.counts[j] != int(spec.kv_shape(j) is not None)]
                why = describe_layer(layers[i]) if i < len(layers) else "its attention did not go through dtree's"
                raise ValueError(
                    f"{self.model_name}: decoder layer {i} ran without dtree's attention (layers {bad} of "
                    f"{spec.num_layers}): {why}. dtree refuses rather than run that layer's own attention unmasked"
                )
