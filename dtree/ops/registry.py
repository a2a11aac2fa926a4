"""dtree's ops that have backends, by name: :func:`resolve_backend` picks a backend of
``"stack_attention"`` or ``"linear_recurrence"`` for a device (see
:class:`dtree.ops.backends.Backends`). The baselines' ops keep their own registries
(:mod:`dtree.baselines.kernels`)."""

from __future__ import annotations

import torch

from .backends import Backends
from .linear_recurrence import BACKENDS as LINEAR_RECURRENCE
from .stack_attention import BACKENDS as STACK_ATTENTION

__all__ = ["OPS", "backend_names", "resolve_backend"]

OPS: dict[str, Backends] = {"stack_attention": STACK_ATTENTION, "linear_recurrence": LINEAR_RECURRENCE}


def _backends(op: str) -> Backends:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {tuple(OPS)}")
    return OPS[op]


def backend_names(op: str) -> tuple[str, ...]:
    """The backend names of ``op``, in registration order."""
    return _backends(op).names()


def resolve_backend(op: str, name: str, device: torch.device | str, dtype: torch.dtype | None = None, **target) -> str:
    """:meth:`Backends.resolve` of ``op`` (``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``deterministic`` as keywords)."""
    return _backends(op).resolve(name, device, dtype, **target)
