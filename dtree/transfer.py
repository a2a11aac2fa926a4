"""Host-to-device copies that do not stall the GPU.

A copy from pageable host memory makes CUDA wait for the stream to drain first, so a
per-model-call copy of a small index table would stop the host from queueing work
ahead of the GPU (every call would start only after the previous one finished). A
copy through pinned memory with ``non_blocking=True`` is queued like a kernel; the
caching host allocator keeps the pinned buffer alive until the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["upload"]


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
