"""Which kernels a step runs for the model's placement: the stack-attention backend and, for models
with recurrent layers, the linear-recurrence backend (from :mod:`dtree.ops.registry`). The planner
(:mod:`dtree.plan.step_plan`) asks at every step, since the model's device and dtype may change."""

from __future__ import annotations

import torch

from ..models import ModelSpec
from ..ops import determinism
from ..ops.registry import resolve_backend

__all__ = ["Placement", "pick_backend", "pick_recurrence"]

Placement = tuple[torch.device, torch.dtype]


def pick_backend(attention: str, placement: Placement, spec: ModelSpec, deterministic: bool = False) -> str:
    """The stack-attention backend for ``attention`` (a config value), from the registry
    (:func:`dtree.ops.registry.resolve_backend`). ``auto``: flash-attn-4 where it runs
    (Hopper or newer, installed, 16-bit, head dims 64/128), else the fused Triton kernel where
    it runs (CUDA, Triton installed, 16-bit or float32 weights, head_dim <= 256; in
    deterministic mode only if its backward has a deterministic form), else SDPA. An
    explicit backend that cannot run here raises a ValueError saying why; one that cannot
    run deterministically in deterministic mode raises a RuntimeError, as torch does."""
    device, dtype = placement
    head_dim = max((spec.kv_shape(i)[1] for i in spec.attention_layers), default=spec.head_dim)
    return resolve_backend(
        "stack_attention", attention, device, dtype, head_dim=head_dim, deterministic=deterministic
    )


def pick_recurrence(recurrence: str, placement: Placement, spec: ModelSpec, deterministic: bool = False) -> str | None:
    """The ``linear_recurrence`` backend for a model with recurrent layers (None without):
    ``auto`` takes flash-linear-attention's kernels on CUDA where installed (not in
    deterministic mode), else the chunked torch form; on CPU the float32 reference. An explicit backend that cannot run
    here raises a ValueError. In deterministic mode on CUDA, the state ops' gathers and
    depthwise convolutions are torch ops that sum in a fixed order only under
    ``torch.use_deterministic_algorithms(True)``: without it, a RuntimeError (as torch raises)."""
    if not spec.recurrent_states:
        return None
    device, dtype = placement
    if deterministic and device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        determinism.alert_nondeterministic(
            "recurrent layers on CUDA without torch.use_deterministic_algorithms(True)",
            "their state ops' gathers and depthwise convolutions sum in a fixed order on CUDA only in torch's own "
            "mode: call torch.use_deterministic_algorithms(True)",
        )
    return resolve_backend("linear_recurrence", recurrence, device, dtype, deterministic=deterministic)
