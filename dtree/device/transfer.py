"""Host-to-device copies that do not stall the GPU.

A copy from pageable host memory makes CUDA wait for the stream to drain first, so a
per-model-call copy of a small index table would stop the host from queueing work
ahead of the GPU (every call would start only after the previous one finished). A
copy through pinned memory with ``non_blocking=True`` is queued like a kernel.

The pinned memory is dtree's own (:class:`PinnedStaging`): buffers kept for the process
and reused once the copy that last read one has run (an event per buffer). Through
``Tensor.pin_memory()`` each upload took ~4 ms of host time on an H100 host while the
GPU ran behind (a new page-locked allocation each time: 45 ms per step of
``memory="low"`` on the 64k agentic tree, sampled).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["PinnedStaging", "upload", "upload_arrays"]


@dataclass
class _Staged:
    """One pinned buffer of the pool: the event of the last copy that read it (None: never
    used) and that use's number (the least recent goes first when the pool is full)."""

    data: torch.Tensor
    event: torch.cuda.Event | None = None
    last_use: int = 0

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class PinnedStaging:
    """Page-locked host buffers for uploads, reused once the copy that last read each one
    has run (a CUDA event per buffer, queried, never waited on unless the pool is full).

    ``limit_bytes``: the most the pool holds; past it an upload waits for the oldest
    buffer's copy instead of allocating (the host is then that far ahead of the GPU)."""

    MIN_BYTES = 1 << 16

    def __init__(self, limit_bytes: int = 1 << 30) -> None:
        self.limit_bytes = limit_bytes
        self._buffers: list[_Staged] = []
        self._lock = threading.Lock()
        self._uses = 0

    def held_bytes(self) -> int:
        return sum(b.data.numel() for b in self._buffers)

    def copy_to(self, host: np.ndarray, device: torch.device) -> torch.Tensor:
        """``host`` (C-contiguous) as a new tensor on CUDA ``device``, copied through a
        pinned buffer without blocking the host."""
        nbytes = host.nbytes
        out = torch.empty(host.shape, dtype=_torch_dtype(host.dtype), device=device)
        if nbytes == 0:
            return out
        with self._lock:
            entry = self._free(nbytes)
            staged = entry.data[:nbytes]
            staged.numpy()[:] = host.reshape(-1).view(np.uint8)
            out.view(-1).view(torch.uint8).copy_(staged, non_blocking=True)
            entry.event = entry.event or torch.cuda.Event()
            entry.event.record(torch.cuda.current_stream(device))
            self._uses += 1
            entry.last_use = self._uses
        return out

    def _free(self, nbytes: int) -> _Staged:
        """A buffer of at least ``nbytes`` whose last copy has run: the smallest such one, a
        new one, or (the pool at its limit) the least recently used one once its copy ran."""
        ready = [b for b in self._buffers if b.data.numel() >= nbytes and b.ready()]
        if ready:
            return min(ready, key=lambda b: b.data.numel())
        size = max(self.MIN_BYTES, 1 << (nbytes - 1).bit_length())
        while self._buffers and self.held_bytes() + size > self.limit_bytes:
            oldest = min(self._buffers, key=lambda b: b.last_use)
            oldest.wait()
            if oldest.data.numel() >= nbytes:
                return oldest
            self._buffers.remove(oldest)
        entry = _Staged(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        self._buffers.append(entry)
        return entry


_STAGING = PinnedStaging()


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def upload(array: np.ndarray, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (optionally cast to ``dtype`` there)."""
    device = torch.device(device)
    if device.type == "cuda":
        out = _STAGING.copy_to(np.ascontiguousarray(array), device)
    else:
        # A read-only array (a Forest's) is copied: on CPU the tensor would alias it.
        out = torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable else array.copy())
    return out if dtype is None else out.to(dtype)


def upload_arrays(
    ints: Sequence[np.ndarray], floats: Sequence[np.ndarray], device: torch.device | str, float_dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """1-D host arrays on ``device`` in one copy per kind: ``ints`` as int64 tensors, ``floats``
    cast to ``float_dtype`` there; each returned tensor is a view of its kind's one upload."""

    def one_copy(arrays: Sequence[np.ndarray], dtype: np.dtype, cast: torch.dtype | None) -> list[torch.Tensor]:
        if not arrays:
            return []
        flat = np.concatenate([np.asarray(a, dtype=dtype).reshape(-1) for a in arrays])
        return list(torch.split(upload(flat, device, cast), [int(np.size(a)) for a in arrays]))

    return one_copy(ints, np.int64, None), one_copy(floats, np.float64, float_dtype)
