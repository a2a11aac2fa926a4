"""Attention's q, k and v projections as one op (:mod:`dtree.ops.shared_input_linear`)
under HF's own attention forward.

Llama, Qwen2, Qwen3 and Mistral attention call ``q_proj``, ``k_proj`` and ``v_proj`` one
after another on the same ``hidden_states``. Replacing that forward per family would
copy four families' attention code (sliding windows, Qwen3's q/k norms, the cache), so
the projections' own ``forward`` is swapped instead: ``q_proj``'s call computes all
three through one autograd node and leaves ``k`` and ``v`` for ``k_proj``'s and
``v_proj``'s calls, which hand them over when called with that same input tensor (and
run ``F.linear`` themselves otherwise). The backward then sums the three input
gradients inside the matmuls and the three bias gradients in one launch: ~7 fewer
kernels per layer and model call (``benchmarks/PERF_NOTES.md``, session Q).

Only plain ``nn.Linear`` projections are swapped (no adapter, hook or quantized
subclass: :func:`dtree.models.plain_linear.is_plain_linear`); :mod:`.lean_layers` swaps
them with the norms and MLPs and puts them back with them.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from ..ops.shared_input_linear import shared_input_linear
from .instance_attrs import remove_instance_attrs, set_instance_attrs
from .plain_linear import is_plain_linear

__all__ = ["is_shared_attention", "restore_projections", "swap_projections"]

_ATTENTIONS = tuple(f"{p}Attention" for p in ("Llama", "Qwen2", "Qwen3", "Mistral"))
_NAMES = ("q_proj", "k_proj", "v_proj")


class _Handover:
    """What ``q_proj``'s call left for the two later projections: the input it read and
    their outputs by module."""

    __slots__ = ("modules", "outputs", "x")

    def __init__(self, modules: tuple[torch.nn.Linear, ...]):
        self.modules = modules
        self.x: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.x, self.outputs = None, {}


def is_shared_attention(m: torch.nn.Module) -> bool:
    """Whether ``m`` is a Llama/Qwen2/Qwen3/Mistral attention whose q, k and v projections
    are plain linears of one input width, not swapped yet."""
    if type(m).__name__ not in _ATTENTIONS:
        return False
    projections = [getattr(m, n, None) for n in _NAMES]
    return all(isinstance(p, torch.nn.Linear) and is_plain_linear(p) for p in projections) and len(
        {p.in_features for p in projections}
    ) == 1


def _first_forward(self, x: torch.Tensor) -> torch.Tensor:
    handover = self._dtree_handover
    outputs = shared_input_linear(x, [(m.weight, m.bias) for m in handover.modules])
    handover.x = x
    handover.outputs = {id(m): y for m, y in zip(handover.modules[1:], outputs[1:])}
    return outputs[0]


def _later_forward(self, x: torch.Tensor) -> torch.Tensor:
    handover = self._dtree_handover
    if handover.x is x and id(self) in handover.outputs:
        y = handover.outputs.pop(id(self))
        if not handover.outputs:
            handover.clear()  # nothing of this call stays referenced past its last projection
        return y
    return F.linear(x, self.weight, self.bias)


@functools.cache
def _forwards() -> tuple:
    """Opaque to ``torch.compile``, as the lean layers' forwards (:mod:`.lean_layers`)."""
    return torch.compiler.disable(_first_forward), torch.compiler.disable(_later_forward)


def swap_projections(attentions: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Swap the q, k, v projections' ``forward`` of each attention in ``attentions`` (see
    the module docstring); returns the projection modules swapped, for
    :func:`restore_projections`."""
    first, later = _forwards()
    swapped = []
    for attention in attentions:
        modules = tuple(getattr(attention, n) for n in _NAMES)
        handover = _Handover(modules)
        for i, m in enumerate(modules):
            set_instance_attrs(m, _dtree_handover=handover, forward=types.MethodType(first if i == 0 else later, m),
                               _dtree_lean=True)
        swapped.extend(modules)
    return swapped


def restore_projections(modules: list[torch.nn.Module]) -> None:
    """Undo :func:`swap_projections` on the modules it returned."""
    for m in modules:
        m._dtree_handover.clear()
        remove_instance_attrs(m, "_dtree_handover", "forward", "_dtree_lean")
