"""The micro-batches of one optimizer step, each prepared while the GPU runs the one before.

A training step queues its kernels and then waits once, for its loss (:meth:`TokenStep.finish
<dtree.engine.step.TokenStep.finish>`). The host's work before a step's first kernel (the
checks, the loss's weights, the memory plan, the schedule, the uploads: 5-15 ms for a GRPO
group of 6k tokens on an H200 host) otherwise leaves the GPU idle. Here micro-batch ``k + 1``
is prepared in that wait of micro-batch ``k``, while the GPU still runs ``k``'s backward::

    prepared = prepare(0, 0)
    for k in 0 .. n-1:
        run(k, prepared, before_sync=lambda releasing: prepare(k + 1, releasing))   -> output k

Each micro-batch is still a whole step: its gradients are committed (or, when it fails, put
back: :mod:`dtree.engine.grad_guard`) before the next one's first kernel, so the gradients equal
those of ``n`` calls of ``forward_backward``, bit for bit. ``releasing``: the bytes micro-batch
``k`` frees when it commits, which the next one's memory plan may count as free
(:func:`dtree.plan.step_plan.plan_memory`).

Failures: an error preparing micro-batch ``k + 1`` waits until micro-batch ``k`` has finished,
then is raised; any error is raised with a note naming its micro-batch and saying that the
gradients of the micro-batches before it are in ``param.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["run_micro_batches"]

Prepared = TypeVar("Prepared")
Output = TypeVar("Output")


class _Ahead(Generic[Prepared]):
    """The next micro-batch's preparation, run once from inside the current one's step; an
    ``Exception`` it raises is kept for :meth:`result` (raised inside the step, it would fail the
    micro-batch that is running, which has nothing wrong with it)."""

    def __init__(self, prepare: Callable[[int, float], Prepared], index: int) -> None:
        self.prepare, self.index = prepare, index
        self.prepared: Prepared | None = None
        self.error: Exception | None = None
        self.ran = False

    def __call__(self, releasing: float) -> None:
        self.ran = True
        try:
            self.prepared = self.prepare(self.index, releasing)
        except Exception as e:  # noqa: BLE001 (raised by result(), after the running micro-batch)
            self.error = e

    def result(self) -> Prepared:
        if not self.ran:  # the step ran no hook (a path without one): prepare now
            self(0.0)
        if self.error is not None:
            raise self.error
        return self.prepared


def run_micro_batches(
    n: int,
    prepare: Callable[[int, float], Prepared],
    run: Callable[[int, Prepared, Callable[[float], None] | None], Output],
) -> list[Output]:
    """The outputs of ``n`` micro-batches: ``prepare(k, releasing)`` makes micro-batch ``k``
    ready to launch, ``run(k, prepared, before_sync)`` runs it and calls ``before_sync(releasing)``
    (or not) between its last launch and its sync."""
    outputs: list[Output] = []
    current = 0  # the micro-batch being prepared or run
    try:
        prepared = prepare(0, 0.0)
        for k in range(n):
            current = k
            ahead = _Ahead(prepare, k + 1) if k + 1 < n else None
            outputs.append(run(k, prepared, ahead))
            if ahead is not None:
                current = k + 1
                prepared = ahead.result()
    except BaseException as e:
        done = f"; the gradients of micro-batches 0..{current - 1} are in param.grad" if current else ""
        e.add_note(f"in micro-batch {current} of {n} (counting from 0){done}")
        raise
    return outputs
