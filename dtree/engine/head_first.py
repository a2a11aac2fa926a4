"""A model call's backward in two autograd calls: the LM head's part first, then the
decoder's from the gradient of the rows the head read.

Why: with tied embeddings (qwen2.5-1.5b, most small models) the head's weight is the
input embedding's. In one ``backward()`` autograd sums the two gradients of that
parameter before it accumulates them, so the head's ``[V, H]`` weight gradient (0.43 GiB
at qwen2.5-1.5b in bf16) stays alive from the head's backward, the first node, to the
embedding's, the last: through every decoder layer's backward, the step's peak. Split,
the head's gradient is added to ``.grad`` as soon as it exists and freed. For an untied
head nothing changes but the order in which the same additions run.

The cut is at the gathered rows (``hidden[rows]``, which the head keeps for its own
backward anyway), and the decoder's backward starts from a scalar root made at the cut
(:class:`_HandOver`) that holds no tensor: the call's ``[T, H]`` final hidden states are
freed after the gather, as in one backward, and the rows' gradient is handed to the
second call without a reference kept here (a caller's reference would hold it through
the whole decoder backward), and the rows themselves are released once the head's
backward has run.

The walk (:mod:`dtree.engine.walk`) and the baselines (:mod:`dtree.baselines.step`) run
every call this way, so their peaks compare like for like::

    hidden = model(...)                       # [T, H], with grad
    split = HeadSplit(hidden, rows)           # split.head_in: [P, H] = hidden[rows], a leaf
    del hidden
    loss = head_loss(split.head_in)
    split.backward(loss)                      # the head's graph, then the decoder's
"""

from __future__ import annotations

import torch

__all__ = ["HeadSplit"]


class _HandOver(torch.autograd.Function):
    """A scalar root whose backward returns the gradient put in ``box`` for its input
    and lets go of it: autograd then holds the only reference, and frees it once the
    input's node has read it. Keeps no tensor itself."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return rows.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.box.pop(), None


class HeadSplit:
    """The rows of a call's final hidden states that the LM head reads, cut from the
    decoder's graph.

    Args:
        hidden: [T, H] the call's final hidden states.
        rows: [P] the rows the head reads (int64, on ``hidden``'s device).

    Attributes:
        head_in: [P, H] ``hidden[rows]``: a leaf when ``hidden`` takes gradients (its
            gradient then seeds the decoder's backward), else the rows themselves.
    """

    def __init__(self, hidden: torch.Tensor, rows: torch.Tensor) -> None:
        picked = hidden[rows]
        self._box: list[torch.Tensor] = []
        self._root: torch.Tensor | None = None
        self.head_in = picked
        if picked.requires_grad:
            self.head_in = picked.detach().requires_grad_(True)
            self._root = _HandOver.apply(picked, self._box)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (read from :attr:`head_in`): the head's graph, then the
        decoder's with the gradient that reached :attr:`head_in` (zeros where the loss
        did not read it: the decoder's graph may still carry other seeds, the KV
        stack's). Once: the split lets go of both graphs."""
        if loss.requires_grad:
            loss.backward()
        root, self._root = self._root, None
        if root is None:
            return
        head_in, self.head_in = self.head_in, None
        self._box.append(head_in.grad if head_in.grad is not None else torch.zeros_like(head_in))
        head_in.grad = None  # the box holds the only reference: autograd frees it after its first use
        # the loss's graph (alive while the caller holds the loss) still points to this leaf:
        # its [P, H] rows go now, as the head's saved copy would in one backward
        head_in.data = head_in.new_empty(0)
        root.backward()
