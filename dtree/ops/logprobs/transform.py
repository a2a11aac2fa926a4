"""The logit transform every log-prob path applies, in one place: ``z = softcap(scale * y) /
temperature`` (``softcap(x) = c * tanh(x / c)``, none when ``softcap`` is None), its
derivative, and the dtype it is computed in. The chunked torch path (:mod:`.interface`), the
fused op's torch twins (:mod:`.fused_head`) and the Triton kernels (:mod:`.triton_kernels`,
which read its three numbers) share it; it imports neither Triton nor the others."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["LogitTransform", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype log-probs and losses are computed in: float32, or float64 for float64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap(scale * y) / temperature`` and its derivative."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @classmethod
    def of(cls, head, temperature: float) -> "LogitTransform":
        """The transform of an :class:`~dtree.ops.logprobs.OutputHead` (its ``logit_scale``
        and ``final_softcap``) at ``temperature``."""
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a positive number, got {temperature}")
        return cls(float(head.logit_scale), head.final_softcap, float(temperature))

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        """[n, V] raw logits (compute dtype) -> transformed logits."""
        if self.scale != 1.0:
            y = y * self.scale
        if self.softcap is not None:
            y = torch.tanh(y / self.softcap) * self.softcap
        if self.temperature != 1.0:
            y = y / self.temperature
        return y

    def chain_(self, dz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``dz`` -> ``dy`` in place, from the transformed logits ``z``:
        ``dz/dy = scale / T * (1 - tanh^2)`` with ``tanh = z * T / softcap``."""
        if self.softcap is not None:
            dz.mul_(z.mul(self.temperature / self.softcap).square_().neg_().add_(1.0))
        factor = self.scale / self.temperature
        return dz.mul_(factor) if factor != 1.0 else dz
