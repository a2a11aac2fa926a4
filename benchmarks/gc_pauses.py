"""Python's garbage collector in steady dtree steps: how often each generation runs, how long
it holds the host, and the step times with the collector as Python runs it
(``pause_gc=False``) against dtree's default (paused during the step,
:mod:`dtree.engine.collector`), interleaved step by step on fresh forests; then
``pause_gc=False`` after ``gc.freeze()`` (the objects alive after the warm-up, the model,
transformers, torch and flash-attn-4's compiled kernels among them, no longer traversed).

A full collection traverses every container object of the process, so it lands on
whichever step triggers it: 320-370 ms every third step of ``memory="low"`` on the 64k tree.

    python benchmarks/gc_pauses.py --workload case1 --steps 30      # H100
    python benchmarks/gc_pauses.py --smoke                          # CPU, tiny model (plumbing)

Prints Markdown, also written to ``$OUT/gc_pauses_<workload>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup  # noqa: E402
from dtree.bench.measure import emit_report, host_timed_step  # noqa: E402


class Pauses:
    """gc callbacks: the duration of every collection, by generation."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.runs.append((info["generation"], time.perf_counter() - self._start))


def timed(rt, forests, loss, model, device, pause: list[bool]) -> dict[bool, tuple[list[float], Pauses]]:
    """Steps on ``forests``, the i-th with ``pause_gc=pause[i % len(pause)]``: per setting,
    (wall seconds, its collections)."""
    out = {p: ([], Pauses()) for p in set(pause)}
    for i, forest in enumerate(forests):
        setting = pause[i % len(pause)]
        walls, pauses = out[setting]
        rt.config = rt.config.replace(pause_gc=setting)
        gc.callbacks.append(pauses)
        try:
            walls.append(host_timed_step(rt, forest, loss, model, device)["wall"])
        finally:
            gc.callbacks.remove(pauses)
    return out


def _row(label: str, walls: list[float], pauses: Pauses, steps: int) -> list[str]:
    out = []
    for gen in (0, 1, 2):
        runs = [d for g, d in pauses.runs if g == gen]
        out.append(f"{len(runs) / steps:.1f} x {1e3 * statistics.mean(runs) if runs else 0:.2f} ms")
    return [f"| {label} | {1e3 * statistics.median(walls):.1f} | {1e3 * statistics.mean(walls):.1f} | "
            f"{1e3 * max(walls):.1f} | " + " | ".join(out) + " |"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--steps", type=int, default=30, help="steady steps per variant (fresh forests)")
    args = p.parse_args()
    model, device, rt, loss, forests, kind, options = script_setup(args, 3 + 3 * args.steps)
    n = args.steps
    objects = len(gc.get_objects())
    both = timed(rt, forests[3:3 + 2 * n], loss, model, device, [False, True])
    rows = _row("as Python schedules it (pause_gc=False)", *both[False], n)
    rows += _row("paused during the step (default)", *both[True], n)
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    rows += _row("pause_gc=False after gc.collect(); gc.freeze()",
                 *timed(rt, forests[3 + 2 * n:], loss, model, device, [False])[False], n)
    gc.unfreeze()
    lines = [f"# Python's garbage collector in steady dtree steps: {args.workload} ({kind}), {device.type}", "",
             f"torch {torch.__version__}; options {options or 'default'}; {objects:,} objects tracked after the "
             f"warm-up, {frozen:,} frozen; thresholds {gc.get_threshold()}; {n} fresh forests per row (the first two "
             "interleaved)", "",
             "| collector | median step ms | mean ms | slowest ms | gen 0 per step x mean | gen 1 | gen 2 |",
             "|---|---|---|---|---|---|---|", *rows]
    emit_report("\n".join(lines), f"gc_pauses_{args.workload}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
