"""What a step's plan costs on the host, before the first kernel (the GPU waits for all of it).

``benchmarks/gpu_idle.py`` charges the GPU's idle time to the step's phases; on an H100 the
plan (``StepPlanner.make_plan``: memory policy, schedule, loss terms, stacks, uploads) left
the GPU idle for 30 ms of GRPO case 1's 0.2 s step and 107 ms of the 64k tree's 2 s.
This script times ``make_plan`` on fresh forests (the wall time of each call, no
profiler) and the parts it calls (:data:`PARTS`, each timed alone; nested parts count in
their callers too), then runs it under cProfile and lists the functions inside it by
cumulative time.

    python benchmarks/plan_profile.py --workload case1       # H100
    python benchmarks/plan_profile.py --workload agentic64k
    python benchmarks/plan_profile.py --smoke                # CPU, tiny model (plumbing)

Prints Markdown, also written to ``$OUT/plan_profile_<workload>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup  # noqa: E402
from dtree.bench.measure import emit_report, host_timed_step  # noqa: E402
from dtree.plan import memory_policy, step_plan  # noqa: E402

# (owner, name) of the functions timed inside make_plan, as make_plan's module calls them
PARTS = [(step_plan.StepPlanner, "sync"), (step_plan, "measured_call_bytes"), (step_plan, "plan_memory"),
         (memory_policy, "available_bytes"), (memory_policy, "step_grad_bytes"), (memory_policy, "plan_step"),
         (step_plan, "build_schedule"), (step_plan, "check_stack_capacity"), (step_plan, "budget_packings"), (step_plan, "select_loss_terms"),
         (step_plan, "refine"), (step_plan, "stack_sizes"), (step_plan, "planning_shape"), (step_plan, "upload_arrays"),
         (step_plan, "StepStacks"), (step_plan, "checkpoint_root"), (step_plan, "model_view")]


def _timed_parts(times: dict) -> list:
    """Wrap every :data:`PARTS` function with a wall-clock timer adding into ``times``;
    returns what to restore."""
    saved = []
    for owner, name in PARTS:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times[_name] = times.get(_name, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
    return saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--steps", type=int, default=4, help="timed steps, then as many profiled")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    model, device, rt, loss, forests, _, options = script_setup(args, 3 + 2 * args.steps)
    original = step_plan.StepPlanner.make_plan
    walls: list[float] = []
    profiler = cProfile.Profile()
    profiling = [False]

    def timed(self, *a, **k):
        if profiling[0]:
            profiler.enable()
        t0 = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            walls.append(time.perf_counter() - t0)
            profiler.disable()

    step_plan.StepPlanner.make_plan = timed
    part_times: dict[str, float] = {}
    try:
        for forest in forests[3 : 3 + args.steps]:
            host_timed_step(rt, forest, loss, model, device)
        plain = list(walls)
        saved = _timed_parts(part_times)
        try:
            for forest in forests[3 : 3 + args.steps]:
                host_timed_step(rt, forest, loss, model, device)
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)
        profiling[0] = True
        for forest in forests[3 + args.steps :]:
            host_timed_step(rt, forest, loss, model, device)
    finally:
        step_plan.StepPlanner.make_plan = original
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
    rows = []
    for line in text.getvalue().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[0].replace("/", "").isdigit() and parts[1] != "function":
            calls, cum, where = parts[0], float(parts[3]), parts[5]
            rows.append(f"| `{where[-90:]}` | {calls} | {1e3 * cum / args.steps:.2f} |")
    lines = [f"# The plan's host time: {args.workload}, {device.type}", "",
             f"runtime options {options or 'default'}; {forests[3].num_unique_tokens} unique tokens in the first forest",
             "", f"make_plan wall per step, unprofiled: median {1e3 * statistics.median(plain):.1f} ms "
             f"({', '.join(f'{1e3 * w:.1f}' for w in plain)})", "",
             "Its parts, wall ms per step (no profiler; nested parts also count in their callers):", "",
             "| part | ms per step |", "|---|---|",
             *(f"| `{n}` | {1e3 * t / args.steps:.2f} |" for n, t in sorted(part_times.items(), key=lambda kv: -kv[1])), "",
             "Under cProfile (inflated), by cumulative time per step:", "",
             "| function | calls | cumulative ms per step |", "|---|---|---|", *rows, ""]
    emit_report("\n".join(lines), f"plan_profile_{args.workload}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
