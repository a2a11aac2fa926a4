"""Host-to-device copies that do not stall the GPU.

A copy from pageable host memory makes CUDA wait for the stream to drain first, so a
per-model-call copy of a small index table would stop the host from queueing work
ahead of the GPU (every call would start only after the previous one finished). A
copy through pinned memory with ``non_blocking=True`` is queued like a kernel; the
caching host allocator keeps the pinned buffer alive until the copy has run.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["upload", "upload_arrays"]


def upload(array: np.ndarray, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (optionally cast to ``dtype`` there)."""
    device = torch.device(device)
    # A read-only array (a Forest's) is copied: on CPU the tensor would alias it.
    host = torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable else array.copy())
    if device.type == "cuda":
        host = host.pin_memory()
        out = host.to(device, non_blocking=True)
    else:
        out = host
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
