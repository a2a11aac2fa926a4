"""Keep ``param.grad`` intact when a training step fails.

A step accumulates into ``param.grad`` over many backward calls, so a failure found
at the end (a non-finite loss, an out-of-memory error) would leave half a step's
gradient behind. ``GradStash`` moves the existing gradients aside first; the step
accumulates into fresh ``.grad`` tensors; ``commit()`` adds the old gradients back
(one add per parameter, and only when there were old gradients), ``restore()``
puts them back untouched.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["GradStash"]


class GradStash:
    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def commit(self) -> None:
        """Keep the step's gradients, added to what was there before."""
        for p, old in zip(self.params, self.saved):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)

    def restore(self) -> None:
        """Drop the step's gradients; ``param.grad`` is as before the step."""
        for p, old in zip(self.params, self.saved):
            p.grad = old

    def __enter__(self) -> "GradStash":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.restore()
