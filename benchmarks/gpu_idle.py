"""When, in a dtree step, the GPU has no kernel to run, and what the host was doing then.

Session F's 4,096-token-call profile had the GPU idle 41% of the step. This script
labels the walk's phases (``record_function`` around each group's forward and loss, each
group's backward, the stack zeroing, the plan before the walk), profiles one step with
torch.profiler, and attributes every stretch with no kernel running to the phase the
host was in at that moment:

* per phase: host time, the time the GPU had no kernel running inside it, and how often;
* every device synchronization of one step (``torch.cuda.set_sync_debug_mode``), by the
  code that caused it: each one drains the launch queue, and the GPU then waits for all
  the host work that follows it.

    python benchmarks/gpu_idle.py --opt group_tokens=4096 --opt checkpoint_layers=0   # H100, the 64k tree
    python benchmarks/gpu_idle.py --workload case1
    python benchmarks/gpu_idle.py --smoke     # CPU, tiny model (plumbing: no kernels to time)

Prints Markdown, also written to ``$OUT/gpu_idle_<workload><_tag>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup  # noqa: E402
from dtree.bench.measure import emit_report, host_timed_step, sync_device  # noqa: E402
from dtree.engine import walk  # noqa: E402

PHASES = {"_run_group": "forward+loss", "zero_grad": "zero stack grads", "hidden": "forward"}


def _labelled_targets():
    """(owner, attribute, label) of every function labelled: the walk's phases and, around
    it, the step's host work before the first kernel and after the last."""
    from dtree.engine import runtime, step
    from dtree.plan import step_plan

    walk_phases = [(walk.TreeWalk, name, label) for name, label in PHASES.items()]
    return walk_phases + [
        (walk, "_finish_group", "backward"),
        (runtime, "validate_forest", "validate"),
        (runtime, "checked_step_loss", "validate"),
        (step_plan.StepPlanner, "make_plan", "plan"),
        (step.TokenStep, "finish", "finish"),
        (runtime, "after_step", "after step"),
    ]


@contextlib.contextmanager
def labelled_walk():
    """The walk's phases and the step's host work around it under ``record_function``
    labels (patched for this script only)."""
    from torch.profiler import record_function

    def labelled(fn, label):
        def run(*args, **kwargs):
            with record_function(f"dtree:{label}"):
                return fn(*args, **kwargs)
        return run

    targets = _labelled_targets()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for (owner, name, fn), (_, _, label) in zip(saved, targets):
        setattr(owner, name, labelled(fn, label))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def idle_by_phase(events) -> tuple[dict, dict]:
    """(per phase: [host us, idle us, idle stretches], totals) from torch.profiler events."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == cuda and e.time_range.end > e.time_range.start and not e.name.startswith("dtree:"))
    labels = [e for e in events if e.device_type == cpu and e.name.startswith("dtree:")]
    step = next(e for e in labels if e.name == "dtree:step")
    gaps, end = [], step.time_range.start
    for a, b in spans:
        if a > end:
            gaps.append((end, a))
        end = max(end, b)
    if step.time_range.end > end:
        gaps.append((end, step.time_range.end))
    phases: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for e in labels:
        phases[e.name][0] += e.time_range.end - e.time_range.start
    bounds = sorted({t for e in labels for t in (e.time_range.start, e.time_range.end)})
    for a, b in gaps:  # cut at every label boundary inside, each piece to the innermost label around it
        cuts = [a, *(t for t in bounds if a < t < b), b]
        for lo, hi in zip(cuts, cuts[1:]):
            mid = (lo + hi) / 2
            inner = [e for e in labels if e.time_range.start <= mid <= e.time_range.end]
            name = max(inner, key=lambda e: e.time_range.start).name if inner else "dtree:step"
            phases[name][1] += hi - lo
            phases[name][2] += 1
    totals = {"step_us": step.time_range.end - step.time_range.start, "idle_us": sum(b - a for a, b in gaps),
              "kernels": len(spans)}
    return dict(phases), totals


def sync_points(run_step) -> collections.Counter:
    """Every device synchronization of one step, by the innermost dtree frames that caused it."""
    found: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/dtree/" in f.filename or "transformers" in f.filename]
        where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
        found[f"{str(message).split(',')[0][:60]} at {where or filename + ':' + str(lineno)}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p, "agentic64k")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile, record_function

    model, device, rt, loss, forests, _, options = script_setup(args, 6)
    wall = host_timed_step(rt, forests[3], loss, model, device)["wall"]
    lines = [f"# Where the GPU waits in a dtree step: {args.workload}, {device.type}", "",
             f"torch {torch.__version__}; runtime options {options or 'default'}; {forests[4].num_unique_tokens} unique "
             f"tokens; an unprofiled step takes {wall:.4f} s", ""]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.zero_grad(set_to_none=True)
    sync_device(device)
    with labelled_walk(), profile(activities=activities) as prof:
        with record_function("dtree:step"):
            rt.forward_backward(forests[4], loss)
        sync_device(device)
    phases, totals = idle_by_phase(prof.events())
    lines += [f"Profiled step: {totals['step_us'] / 1e3:.1f} ms, {totals['kernels']} kernels, no kernel running for "
              f"**{totals['idle_us'] / 1e3:.1f} ms ({100 * totals['idle_us'] / totals['step_us']:.0f}%)**.", "",
              "| phase (innermost label at the idle stretch) | host ms (all its ranges) | GPU idle ms inside | "
              "idle stretches |", "|---|---|---|---|"]
    for name, (host, idle, count) in sorted(phases.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name.removeprefix('dtree:')} | {host / 1e3:.1f} | {idle / 1e3:.1f} | {count} |")
    if device.type == "cuda":
        model.zero_grad(set_to_none=True)
        syncs = sync_points(lambda: rt.forward_backward(forests[5], loss))
        sync_device(device)
        lines += ["", f"## Device synchronizations in one step: {sum(syncs.values())}", "",
                  "| count | what, where (innermost dtree/transformers frames first) |", "|---|---|",
                  *(f"| {n} | {where} |" for where, n in syncs.most_common(40)), ""]
    emit_report("\n".join(lines), f"gpu_idle_{args.workload}{'_' + args.tag if args.tag else ''}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
