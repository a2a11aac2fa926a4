"""The memory policy's candidate plans for a step: which are predicted faster than the one it
ran, and by how much they miss its budget.

A capped step runs the fastest plan predicted to fit (:func:`dtree.plan.memory_policy.plan_step`).
Where the plan it picks peaks well under the cap (the 256k tree under ``memory=19.9`` peaked
at 14.7 GiB: session AB), the question is which faster plans the grid holds and what they are
predicted to need. This script runs one real step (the model's call figures are measured as
in any step), records every scoring the policy makes in it (the offload's and the device's
plans are scored separately under a cap), and lists per scoring: the budget, the plan run, and
the candidates predicted faster that no leaner one beats (the frontier above the plan run), with
their knobs, predicted peak (above the memory held at the start) and predicted cost relative to
the plan run.

    python benchmarks/plan_candidates.py --workload agentic256k --opt memory=19.9   # GPU
    python benchmarks/plan_candidates.py --smoke --opt memory=4                      # CPU, tiny (no scoring: no rows)

Prints Markdown, also written to ``$OUT/plan_candidates_<workload>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree
from benchmarks.host_profile import add_setup_arguments, script_parts
from dtree.bench.measure import emit_report, host_timed_step
from dtree.plan import memory_policy

GIB = 2.0**30


@contextlib.contextmanager
def recorded_scorings():
    """While the block runs, every ``choose_index`` call of the memory policy is recorded into the
    list it yields: its peaks, costs, grid, budget, pick and reason."""
    seen: list[dict] = []
    original = memory_policy.choose_index

    def recording(peaks, costs, grid, budget, keep=None):
        chosen, reason = original(peaks, costs, grid, budget, keep)
        seen.append({"peaks": np.asarray(peaks), "costs": np.asarray(costs), "grid": grid, "budget": budget,
                     "chosen": chosen, "reason": reason})
        return chosen, reason

    memory_policy.choose_index = recording
    try:
        yield seen
    finally:
        memory_policy.choose_index = original


def _scorings(rt, model, forest, loss, device) -> list[dict]:
    """Every scoring of one step (:func:`recorded_scorings`)."""
    with recorded_scorings() as seen:
        host_timed_step(rt, forest, loss, model, device)
    return seen


def _frontier(peaks: np.ndarray, costs: np.ndarray, chosen: int) -> list[int]:
    """The candidates faster than ``chosen`` that no leaner candidate beats, leanest first: how
    much more memory each step of speed is predicted to need."""
    faster = np.flatnonzero(costs < costs[chosen])
    out, best = [], costs[chosen]
    for i in faster[np.lexsort((costs[faster], peaks[faster]))]:
        if costs[i] < best:
            out.append(int(i))
            best = costs[i]
    return out


def _table(s: dict, top: int) -> list[str]:
    peaks, costs, grid, chosen = s["peaks"], s["costs"], s["grid"], s["chosen"]
    frontier = _frontier(peaks, costs, chosen)
    lines = [(f"budget {s['budget'] / GIB:.2f} GiB above the start; ran candidate {chosen} ({s['reason']}): "
              f"{grid.knob(chosen)}, peak {peaks[chosen] / GIB:.2f} GiB; {int((costs < costs[chosen]).sum())} of "
              f"{len(costs)} candidates are predicted faster, {len(frontier)} of them on the frontier (no leaner "
              "candidate is as fast), leanest first:"), "",
             ("| plan | group tokens | checkpointed | path | head chunk | keep attention | peak GiB | over budget GiB "
              "| cost / ran |"), "|---|---|---|---|---|---|---|---|---|"]
    for i in [chosen] + frontier[:top]:
        k = grid.knob(i)
        over = peaks[i] - s["budget"]
        lines.append(f"| {'**ran**' if i == chosen else i} | {k.group_tokens} | {k.checkpoint} | {k.path} | {k.chunk} "
                     f"| {k.keep} | {peaks[i] / GIB:.2f} | {f'{over / GIB:+.2f}' if over > 0 else 'fits'} "
                     f"| {costs[i] / costs[chosen]:.4f} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p, default_workload="agentic256k")
    p.add_argument("--top", type=int, default=25, help="frontier candidates listed per scoring")
    args = p.parse_args()
    model, device, forest_of, options, loss = script_parts(args.smoke, args.workload, args.opt)
    rt = dtree.TreeRuntime(model, **options)
    forest = forest_of(0)
    scorings = _scorings(rt, model, forest, loss, device)
    ran = rt.memory_plan.describe() if rt.memory_plan else "-"
    lines = [f"# The memory policy's candidates: {args.workload}, {device.type}", "",
             (f"runtime options {options or 'default'}; {forest.num_unique_tokens} unique tokens; "
              f"{len(scorings)} scoring(s) in the step; the plan run: {ran}"), ""]
    for n, s in enumerate(scorings):
        lines += [f"## Scoring {n + 1}", "", *_table(s, args.top), ""]
    emit_report("\n".join(lines), f"plan_candidates_{args.workload}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
