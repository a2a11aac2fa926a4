"""The decoder-layer kernels a ``dtree bench`` run gives its model, once, for every method.

A comparison of training methods is fair only when every method runs the same layer
kernels: faster norms or a leaner MLP help the mask-based and linearized baselines as
much as dtree. ``--layers`` picks them:

* ``auto`` (default): dtree's lean RMSNorm and SwiGLU MLP (:mod:`dtree.models.lean_layers`)
  and dtree's rotary kernel (:mod:`dtree.ops.rotary`) where the family has them; else
  Liger's layers on CUDA when it has the family; else HF's eager layers;
* ``lean``: the same, without the Liger fallback; ``liger``: Liger's norms, rotary and MLP
  activation (``--fused`` is this); ``eager``: the model's own.

The rotary kernel replaces a global of the family's modeling module (HF's attention calls
``apply_rotary_pos_emb`` from there), so :func:`bench_layers` holds it for the length of
the run only; :func:`apply_layers` changes the model instance alone. The report says which
were used (``report["layers"]``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["LAYER_CHOICES", "apply_layers", "bench_layers", "dtree_layer_options"]

LAYER_CHOICES = ("auto", "lean", "liger", "eager")


def dtree_layer_options(choice: str) -> dict:
    """dtree's constructor options for the run's ``choice``: with ``eager`` or ``liger``
    dtree runs those layers too (``lean_layers=False``; by default it runs its lean layers
    during its steps, which the baselines would not)."""
    return {"lean_layers": False} if choice in ("eager", "liger") else {}


def _liger(model: torch.nn.Module, **switches) -> str | None:
    """Liger's kernels applied (a description), or None where Liger is not installed or
    has no kernels for the family."""
    from ..models.fused import apply_fused_kernels, fused_kernels_available

    if not fused_kernels_available():
        return None
    try:
        applied = apply_fused_kernels(model, **switches)
    except ValueError:
        return None
    return f"Liger-Kernel {dict(applied.modules)} {list(applied.module_globals)}"


def apply_layers(model: torch.nn.Module, choice: str, device: torch.device) -> str:
    """Give ``model`` the layer kernels ``choice`` names (see the module docstring), in
    place; returns what it runs, for the report. Raises a ValueError when an explicit
    choice cannot be had (naming why)."""
    from ..models.lean_layers import apply_lean_layers, lean_layers_supported

    if choice not in LAYER_CHOICES:
        raise ValueError(f"--layers must be one of {LAYER_CHOICES}, got {choice!r}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "eager":
        return "eager (the model's own)"
    if choice == "liger":
        if not on_cuda:
            raise ValueError("--layers liger runs Liger-Kernel's Triton kernels: a CUDA device is needed")
        described = _liger(model)
        if described is None:
            raise ValueError("--layers liger: Liger-Kernel is not installed or has no kernels for this model "
                             "(pip install liger-kernel, or 'dtree[fused]')")
        return described
    if lean_layers_supported(model):
        return apply_lean_layers(model).describe()
    if choice == "lean":
        raise ValueError("--layers lean: dtree's lean layers support Llama, Qwen2, Qwen3 and Mistral models")
    return (_liger(model) if on_cuda else None) or "eager (the model's own: no lean or Liger kernels for it)"


@contextlib.contextmanager
def bench_layers(model: torch.nn.Module, choice: str, device: torch.device) -> Iterator[str]:
    """:func:`apply_layers`, and with ``auto`` or ``lean`` dtree's rotary kernel for the
    model's family for the length of the block (every method of the run calls it); yields
    what the model runs, for the report."""
    from ..models.lean_layers import lean_layers_applied, lean_rotary

    described = apply_layers(model, choice, device)
    if choice not in ("auto", "lean") or not lean_layers_applied(model):
        yield described
        return
    with lean_rotary(model) as module:
        yield described if module is None else f"{described}; rotary: dtree's kernel ({module}.apply_rotary_pos_emb)"
