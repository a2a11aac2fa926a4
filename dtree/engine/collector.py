"""Python's cyclic garbage collector paused for the length of a training step.

A step makes many short-lived Python objects (autograd nodes and their contexts, checkpoint
frames and saved-tensor holders, the layers' argument tuples): ~70k container allocations
per step on the 64k agentic tree with every layer checkpointed. Collections that run
*during* the step find those objects still alive and promote them to the older
generations; when the oldest generation's newcomers reach a quarter of what it holds,
Python runs a full collection over every object of the process (the model, transformers,
torch, flash-attn-4's compiled kernels: ~600k objects). On an H100 host that was a 320-370
ms pause every third step of ``memory="low"`` on the 64k tree, landing on whichever step
triggered it (``benchmarks/gc_pauses.py``).

Paused, the step's objects die of their reference counts before any collection sees
them, so nothing is promoted and no full collection is triggered; the collector is
switched back on when the step ends (also when it fails), and its next run collects
whatever cycles the step left. dtree's own objects form no cycles (the launch replay's
templates are tested for it); a user's loss function that makes cyclic garbage holding
device memory keeps it until the step ends (``TreeRuntime(pause_gc=False)`` leaves the
collector alone).
"""

from __future__ import annotations

import gc

__all__ = ["CollectorPause"]


class CollectorPause:
    """Automatic garbage collection off between :meth:`__enter__` and :meth:`__exit__` when
    ``enabled`` (and on before), back on after, also when the block raises (the exception
    goes on). Collections requested explicitly (``gc.collect()``) still run."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.paused = False

    def __enter__(self) -> "CollectorPause":
        if self.enabled and gc.isenabled():
            gc.disable()
            self.paused = True
        return self

    def __exit__(self, *exc) -> None:
        if self.paused:
            gc.enable()
            self.paused = False
