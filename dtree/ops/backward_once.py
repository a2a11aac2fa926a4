"""Whether the graph built now is back-propagated once, by dtree itself.

An op whose saved input no other backward reads may overwrite it in its own backward when
the graph is back-propagated once: a second ``backward(retain_graph=True)`` would read the
overwritten values. dtree's steps (the runtime's training calls, its memory probe, the
baselines' steps) build their graphs and back-propagate each once, and mark that with
:func:`backward_once_scope`; outside it (a user's own forward through a model that keeps
dtree's lean layers) ops keep their saved inputs intact.

The lean SwiGLU MLP (:mod:`dtree.models.lean_layers`) uses it: its ``gate`` and ``up``
come from one projection op and are read by the down projection's backward only, which then
writes their gradients over them and the SiLU product over the down projection's input
gradient (:func:`dtree.ops.swiglu.swiglu_down`'s ``inputs_owned``): one elementwise pass
and one ``[T, I]`` buffer, where the backward that keeps its inputs recomputes the product
in a pass of its own and holds two ``[T, I]`` temporaries. A checkpointed layer's re-run
(:mod:`dtree.ops.rerun`) is back-propagated once as well, scope or not.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["backward_once_scope", "backward_runs_once"]

_ONCE: contextvars.ContextVar[bool] = contextvars.ContextVar("dtree_backward_once", default=False)


def backward_runs_once() -> bool:
    """True inside :func:`backward_once_scope`."""
    return _ONCE.get()


@contextlib.contextmanager
def backward_once_scope(enabled: bool = True) -> Iterator[None]:
    """Graphs built in the block are back-propagated once (``enabled``; False: the block
    changes nothing)."""
    token = _ONCE.set(enabled or _ONCE.get())
    try:
        yield
    finally:
        _ONCE.reset(token)
