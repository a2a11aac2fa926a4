"""The linearized baseline's attention by backend name: :data:`BACKENDS` (``reference``,
``sdpa`` and ``flash`` of :mod:`.varlen_attention`, ``flash-attn`` of
:mod:`.varlen_attention_flash`) and the dispatcher :func:`varlen_attention`; every
backend takes ``(q, k, v, layout: VarlenLayout, scale)``: q [T, Hq, D], k and v
[T, Hkv, D] -> [T, Hq, D].
"""

from __future__ import annotations

import torch

from ...ops.backends import Backends
from . import varlen_attention_flash as flash_attn_module
from .varlen_attention import (
    VarlenLayout,
    flash_attn_unavailable,
    flash_unavailable,
    varlen_attention_flash,
    varlen_attention_reference,
    varlen_attention_sdpa,
)

__all__ = ["BACKENDS", "varlen_attention"]


def varlen_attention_flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float
) -> torch.Tensor:
    """The ``flash-attn`` backend (:mod:`dtree.baselines.kernels.varlen_attention_flash`; looked
    up at the call, so a patched module attribute is the one that runs)."""
    return flash_attn_module.varlen_attention_flash_attn(q, k, v, layout, scale)


BACKENDS = Backends(
    "varlen attention",
    {
        "reference": varlen_attention_reference,
        "sdpa": varlen_attention_sdpa,
        "flash": varlen_attention_flash,
        "flash-attn": varlen_attention_flash_attn,
    },
    # the checks reject CPU themselves; one order everywhere, as the baseline always chose
    {"other": ("flash-attn", "flash", "sdpa")},
    unavailable={"flash": flash_unavailable, "flash-attn": flash_attn_unavailable},
)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float, backend: str = "sdpa"
) -> torch.Tensor:
    """Dispatch to a backend of :data:`BACKENDS` by name."""
    return BACKENDS.function(backend)(q, k, v, layout, scale)
