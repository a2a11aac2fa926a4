"""Whether the code running now is a checkpointed layer's re-run in backward.

A checkpointed layer's re-run (:func:`dtree.models.layer_recompute.recompute_in_backward`)
is back-propagated through, but no backward reads the value of what the layer returns:
an op whose output value no backward in the layer reads may skip its work then. The lean
SwiGLU MLP's down projection (:func:`dtree.ops.swiglu.swiglu_down`), whose output only
enters the residual add (whose backward reads no values), saves its inputs and returns a
zero view instead of a matmul and the SiLU product (29% of a qwen2.5-1.5b layer's matmul
FLOPs). Its backward computes the same gradients, and writes them over the re-run's own
``gate`` and ``up`` in row chunks (the re-run's :func:`rerun_chunk_rows`), because the re-run's
graph is back-propagated once and nothing else reads them. That way a checkpointed layer's
backward holds two ``[T, I]`` tensors and one row chunk at its peak, not four ``[T, I]`` tensors.
:class:`dtree.models.checkpointing.CheckpointedLayer` marks its re-runs with
:func:`rerun_scope`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

__all__ = ["in_rerun", "rerun_chunk_rows", "rerun_scope"]

# None: not in a re-run; else the re-run's SwiGLU backward chunk rows (None in the tuple: the op's own)
_RERUN: contextvars.ContextVar[tuple[int | None] | None] = contextvars.ContextVar(
    "dtree_checkpoint_rerun", default=None)


def in_rerun() -> bool:
    """True inside a checkpointed layer's re-run (:func:`rerun_scope`)."""
    return _RERUN.get() is not None


def rerun_chunk_rows() -> int | None:
    """The rows per chunk the re-run running now gives its SwiGLU backward (0: one chunk, the whole
    call; None: :data:`dtree.ops.swiglu.interface.CONSUMING_CHUNK_ROWS`, and outside a re-run)."""
    scope = _RERUN.get()
    return None if scope is None else scope[0]


@contextlib.contextmanager
def rerun_scope(chunk_rows: int | None = None) -> Iterator[None]:
    """A checkpointed layer's re-run; ``chunk_rows``: :func:`rerun_chunk_rows`."""
    token = _RERUN.set((chunk_rows,))
    try:
        yield
    finally:
        _RERUN.reset(token)
