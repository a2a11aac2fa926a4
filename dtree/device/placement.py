"""Where the model lives now: read at every call, so late moves and casts just work."""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["model_placement"]


def model_placement(params: Iterable[torch.Tensor]) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of the model now: those of its first floating-point parameter.

    Read at every call, not once at construction, so ``model.to(torch.bfloat16)``,
    ``.cuda()`` or materializing a meta model after wrapping it just work (the runtime
    reallocates its KV stack when they change). A parameter still on the meta device
    gets an error naming the fix."""
    first = None
    for p in params:
        if p.device.type == "meta":
            raise ValueError(
                "the model has parameters on the meta device (not materialized): materialize it first, e.g. "
                "model.to_empty(device=...) and initialize or load its weights, then call dtree again"
            )
        if first is None and p.is_floating_point():
            first = p
    if first is None:
        raise ValueError("the model has no floating-point parameters")
    return first.device, first.dtype
