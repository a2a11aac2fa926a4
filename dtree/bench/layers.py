"""The decoder-layer kernels a ``dtree bench`` run gives its model, once, for every method.

A comparison of training methods is fair only when every method runs the same layer
kernels: faster norms or a leaner MLP help the mask-based and linearized baselines as
much as dtree. ``--layers`` picks them:

* ``auto`` (default): dtree's lean RMSNorm and SwiGLU MLP (:mod:`dtree.models.lean_layers`)
  where the family has them, with Liger-Kernel's fused rotary on CUDA when Liger is
  installed; else Liger's layers on CUDA when it has the family; else HF's eager layers;
* ``lean``: dtree's lean layers only; ``liger``: Liger's norms, rotary and MLP activation
  (``--fused`` is this); ``eager``: the model's own.

The report says which were used (``report["layers"]``).
"""

from __future__ import annotations

import torch

__all__ = ["LAYER_CHOICES", "apply_layers"]

LAYER_CHOICES = ("auto", "lean", "liger", "eager")


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
        described = apply_lean_layers(model).describe()
        if choice == "auto" and on_cuda:
            rope = _liger(model, rms_norm=False, rope=True, mlp=False)
            if rope is not None:
                described += f"; rotary: {rope}"
        return described
    if choice == "lean":
        raise ValueError("--layers lean: dtree's lean layers support Llama, Qwen2, Qwen3 and Mistral models")
    return (_liger(model) if on_cuda else None) or "eager (the model's own: no lean or Liger kernels for it)"
