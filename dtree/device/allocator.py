"""The CUDA caching allocator's byte counters, read once per question.

``torch.cuda.memory_allocated``, ``memory_reserved`` and ``max_memory_allocated`` each build
the allocator's whole statistics and flatten them into one dict in Python (~0.1-0.2 ms on the
GPU hosts); a step asked five of them after its sync and two before its first kernel, all
time the GPU waits on its host. :func:`allocator_bytes` reads the nested statistics once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AllocatorBytes", "allocator_bytes"]


@dataclass(frozen=True)
class AllocatorBytes:
    """Bytes the caching allocator has handed out now, holds from the device now, and had
    handed out at most since its peak counters were last reset."""

    allocated: int
    reserved: int
    peak_allocated: int


def allocator_bytes(device: torch.device) -> AllocatorBytes:
    """:class:`AllocatorBytes` of a CUDA ``device``: what ``torch.cuda.memory_allocated``,
    ``memory_reserved`` and ``max_memory_allocated`` return, from one read (zeros before CUDA
    is initialized, as they return)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:
        return AllocatorBytes(0, 0, 0)
    allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
    return AllocatorBytes(int(allocated["current"]), int(reserved["current"]), int(allocated["peak"]))
