"""Attention outputs kept through a checkpointed layer's re-run.

A checkpointed decoder layer (:mod:`dtree.models.checkpointing`) keeps only its input,
and its backward re-runs the whole layer: the stack attention's forward too, which on
the 64k agentic tree is 0.21 s of a 2.7 s step at the mask's memory
(``benchmarks/results/h100/session_h/profile_before``). The attention's output and
log-sum-exp are all its backward needs beyond q, k and v, which the re-run's cheap
projections recompute. So the layer's forward records them here (``T x Hq x Dv`` in the
model dtype plus ``Hq x T`` float32: 3 KB a token on qwen2.5-1.5b, against the 3 KB
of the layer input that checkpointing keeps), and the re-run takes them back instead of
launching the attention forward again.

Exact by construction: the re-run's attention sees the same q, k, v and stack slots as
the forward did (checkpointing replays the layer on its saved input, and the ancestors
are still on the stack), so the recorded output is the one it would compute.

With the layer inputs on the host (``offload_checkpoints``: :mod:`dtree.models.host_checkpoints`)
the outputs wait there with them, in the layer's unit of the call's group, and come back with
the input's prefetch: a call then holds two layers' outputs on the device instead of all of
them, and a memory-capped plan keeps them for ~0.07 GiB instead of ~1 GiB (12k-token calls).

Which backends record: :data:`KEEPING_BACKENDS`, whose autograd functions compute their
output through :func:`kept_or_computed`. The memory policy keeps outputs only for plans
that name it, and only on those backends.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

__all__ = ["KEEPING_BACKENDS", "OutputMemo", "active_memo", "kept_bytes_per_token", "kept_or_computed"]

KEEPING_BACKENDS = frozenset({"triton", "flash-attn"})

_ACTIVE: contextvars.ContextVar["OutputMemo | None"] = contextvars.ContextVar("dtree_output_memo", default=None)


class OutputMemo:
    """The attention outputs of one checkpointed layer call, in call order.

    The layer's forward runs in :meth:`recording`: every attention call appends its
    ``(out, lse)``. Each re-run runs in :meth:`replaying`: the attention calls take them
    back in the same order (a graph backpropagated twice re-runs twice; the entries
    stay until the memo is dropped with the layer's graph).

    ``host``: a :class:`dtree.models.host_checkpoints.HostCheckpoints` group (the layer's
    input waits there too): the outputs wait in host memory from the forward to the re-run
    instead of on the device, and are taken back once (on CPU, clones)."""

    def __init__(self, host=None) -> None:
        self._entries: list[tuple] = []
        self._cursor: int | None = None  # None: recording
        self._host = host

    @property
    def replaying(self) -> bool:
        return self._cursor is not None

    def recording(self) -> contextlib.AbstractContextManager["OutputMemo"]:
        return self._active(None)

    def replaying_scope(self) -> contextlib.AbstractContextManager["OutputMemo"]:
        return self._active(0)

    @contextlib.contextmanager
    def _active(self, cursor: int | None) -> Iterator["OutputMemo"]:
        token = _ACTIVE.set(self)
        self._cursor = cursor
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def record(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.replaying:
            raise RuntimeError("OutputMemo.record during a re-run: the layer's re-run is to take outputs back")
        if self._host is not None:
            self._entries.append((self._host.put(out), self._host.put(lse)))
        else:
            self._entries.append((out.detach(), lse.detach()))

    def take(self, out_shape: tuple, lse_shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The next recorded ``(out, lse)``; a RuntimeError if the re-run asks for more
        calls, or other shapes, than the forward made (the layer did not replay itself)."""
        i = self._cursor
        if i is None or i >= len(self._entries):
            raise RuntimeError(
                f"a checkpointed layer's re-run made attention call {0 if i is None else i + 1}, but its forward "
                f"recorded {len(self._entries)}: the layer does not run the same attention calls again"
            )
        out, lse = self._entries[i]
        if tuple(out.shape) != tuple(out_shape) or tuple(lse.shape) != tuple(lse_shape) or out.dtype != dtype:
            raise RuntimeError(
                f"a checkpointed layer's re-run asked for an attention output {tuple(out_shape)} {dtype}, "
                f"its forward recorded {tuple(out.shape)} {out.dtype}"
            )
        self._cursor = i + 1
        if self._host is not None:
            return self._host.get(out), self._host.get(lse)
        return out.detach(), lse  # a fresh alias: the re-run's graph sets its own grad_fn on it


def active_memo() -> OutputMemo | None:
    """The memo of the checkpointed layer call running now (None: not inside one, or
    the plan keeps no attention outputs)."""
    return _ACTIVE.get()


def kept_or_computed(
    compute: Callable[[], tuple[torch.Tensor, torch.Tensor]], out_shape: tuple, lse_shape: tuple, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of an attention call: taken back in a checkpointed layer's re-run
    that kept them, else ``compute()``'d (and recorded when the layer keeps them)."""
    memo = active_memo()
    if memo is not None and memo.replaying:
        return memo.take(out_shape, lse_shape, dtype)
    out, lse = compute()
    if memo is not None:
        memo.record(out, lse)
    return out, lse


def kept_bytes_per_token(num_heads: int, value_head_dim: int, itemsize: int) -> float:
    """What one attention layer's recorded output and log-sum-exp take per token."""
    return num_heads * (value_head_dim * itemsize + 4)
