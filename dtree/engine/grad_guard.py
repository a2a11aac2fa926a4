"""Keep ``param.grad`` intact when a training step fails.

A step accumulates into ``param.grad`` over many backward calls, so a failure found
at the end (a non-finite loss, an out-of-memory error) would leave half a step's
gradient behind. ``GradStash`` moves the existing gradients aside first; the step
accumulates into fresh ``.grad`` tensors; ``commit()`` adds the old gradients back
(one add per parameter, and only when there were old gradients), ``restore()``
puts them back untouched.

The price: in a gradient-accumulation loop (``param.grad`` already set when a step
starts) the old gradients and the step's are both alive during the step, one more copy
of the gradients at its peak (the memory policy counts it:
:func:`dtree.plan.memory_policy.step_grad_bytes`). ``RuntimeConfig(grad_guard=False)``
runs steps with :class:`GradInPlace` instead: the step accumulates into ``param.grad``
directly, as a plain PyTorch loop does, and a failed step leaves part of its gradient
there (its error says so).
"""

from __future__ import annotations

from typing import Iterable, Self

import torch

__all__ = ["KEPT_NOTE", "PARTIAL_NOTE", "GradInPlace", "GradStash", "grad_guard"]

KEPT_NOTE = "param.grad was left as it was before this call"
PARTIAL_NOTE = (
    "param.grad may hold part of this call's gradient (grad_guard=False): clear it (optimizer.zero_grad()) "
    "before the next step"
)


class GradStash:
    note = KEPT_NOTE

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def releasing_bytes(self) -> float:
        """Bytes :meth:`commit` frees now: the step's gradients that it adds into old ones."""
        seen, total = set(), 0
        for p, old in zip(self.params, self.saved):
            if old is not None and p.grad is not None and id(p.grad) not in seen:
                seen.add(id(p.grad))
                total += p.grad.numel() * p.grad.element_size()
        return float(total)

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


class GradInPlace:
    """The unguarded form of :class:`GradStash` (``grad_guard=False``): the step accumulates
    into ``param.grad`` as it is; nothing is kept aside, so nothing can be put back."""

    note = PARTIAL_NOTE

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        del params

    def releasing_bytes(self) -> float:
        return 0.0

    def commit(self) -> None:
        pass

    def restore(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass


def grad_guard(params: Iterable[torch.Tensor], guarded: bool = True) -> GradStash | GradInPlace:
    """A step's guard of ``param.grad``: :class:`GradStash` when ``guarded``, else
    :class:`GradInPlace`; its ``note`` ends the step's error messages."""
    return GradStash(params) if guarded else GradInPlace(params)
