"""What a step leaves on the device, released and reported.

Between steps, a training loop holds its weights, gradients and optimizer state; what
else dtree kept (the KV stack, sized for the step; blocks the caching allocator keeps
for reuse) is memory a colocated inference engine cannot have. On CUDA
the runtime drops the stack after every call (also a failed one), so nothing of dtree's
stays allocated; with :attr:`dtree.config.RuntimeConfig.free_after_step` it also returns
the allocator's unused blocks to the device. Either way the step's output says what is
held (``StepOutput.metrics["memory"]``).
Measured on an H100 before this (20 steps on fresh 16k-41k-token agentic trees): 77 of
80 GiB reserved and ~10 GiB allocated between steps beyond weights and optimizer state.
"""

from __future__ import annotations

import torch

from ..device.allocator import allocator_bytes
from ..models.host_checkpoints import host_page_bytes

__all__ = ["after_step", "drops_stack", "with_report"]

_GIB = 2.0**30


def drops_stack(device: torch.device | None) -> bool:
    """Whether the runtime drops its stacks after a call: on a CUDA ``device``, always
    (they are sized per step; their blocks stay in the allocator's cache for the next
    step unless ``free_after_step`` returns them). Elsewhere they are kept."""
    return device is not None and device.type == "cuda"


def after_step(device: torch.device | None, free: bool) -> dict:
    """Release (``free``: ``torch.cuda.empty_cache()``, after the runtime dropped its
    stacks, :func:`drops_stack`) and report, on a CUDA ``device``: allocated and reserved
    GiB after the step, what was released, and the allocator's peak since its counters
    were last reset (``dtree bench`` resets them before every step, so there it is the
    step's peak), and the pinned host pages the process holds for offloaded checkpoints
    (``host_pinned_gib``: they stay for later steps, see ``release_host_pages``). Elsewhere
    nothing: ``{}``."""
    if device is None or device.type != "cuda":
        return {}
    before = now = allocator_bytes(device)
    if free:
        torch.cuda.empty_cache()
        now = allocator_bytes(device)
    return {
        "allocated_after_gib": now.allocated / _GIB,
        "reserved_after_gib": now.reserved / _GIB,
        "released_gib": (before.reserved - now.reserved) / _GIB,
        "peak_since_reset_gib": now.peak_allocated / _GIB,
        "freed_after_step": free,
        "host_pinned_gib": host_page_bytes() / _GIB,
    }


def with_report(out, after: dict, plan):
    """``out`` with, when it is a ``StepOutput`` and ``after`` (:func:`after_step`) is not
    empty, the report and the plan's predicted peak in ``metrics["memory"]``. ``plan``: the
    step's :class:`~dtree.plan.memory_model.MemoryPlan` or None."""
    metrics = getattr(out, "metrics", None)
    if after and isinstance(metrics, dict):
        predicted = plan.describe().get("predicted_total_gib") if plan is not None else None
        metrics["memory"] = {"predicted_total_gib": predicted, **after}
    return out
