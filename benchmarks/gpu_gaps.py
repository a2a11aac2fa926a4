"""The GPU's idle stretches in steady dtree steps, profiled with CUDA activity only.

``benchmarks/gpu_idle.py`` labels the host's phases, so it profiles the CPU too, and that
slows the host enough to open gaps that an unprofiled step does not have. This script
records kernels only (CUPTI adds ~1-2 us per launch, nothing per Python call), with a
marker kernel launched right after the sync that starts each step, and reports per step:

* the wall time (host timer), the kernels' busy time (their union) and the idle rest;
* the gap from the marker to the step's first kernel (the host work before the first
  launch: checks, the plan, uploads);
* the gaps between kernels by size, and the largest gaps with the kernels on each side
  (where the host fell behind the GPU).

    python benchmarks/gpu_gaps.py --workload case1          # H100
    python benchmarks/gpu_gaps.py --workload agentic64k --opt memory=low

Prints Markdown, also written to ``$OUT/gpu_gaps_<workload><_tag>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup  # noqa: E402
from dtree.bench.measure import allocator_counts, counter_deltas, emit_report, sync_device  # noqa: E402

BINS_US = (5, 20, 100, 1000, float("inf"))
DEVICE_MAPS = {"num_device_alloc": "allocs", "num_device_free": "frees"}  # the caching allocator's device memory


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: no step launches it


def _marker() -> None:
    torch.cuda._sleep(1000)  # a ~1 us kernel marking the step's start on the GPU's clock


def profiled_steps(rt, model, forests, loss, device) -> tuple[list[float], list[list[tuple]], list[tuple]]:
    """(wall seconds per step, per step its kernels as (start us, end us, name), marker first, per step the
    caching allocator's (device allocations, device frees): each maps or unmaps memory on the host's time)."""
    from torch.profiler import ProfilerActivity, profile

    walls, allocs = [], []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for forest in forests:
            model.zero_grad(set_to_none=True)
            sync_device(device)
            before = allocator_counts(device, DEVICE_MAPS)
            t0 = time.perf_counter()
            _marker()
            rt.forward_backward(forest, loss)
            sync_device(device)
            walls.append(time.perf_counter() - t0)
            new = counter_deltas(before, allocator_counts(device, DEVICE_MAPS))
            allocs.append((new.get("allocs", 0), new.get("frees", 0)))
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    steps: list[list[tuple]] = []
    for k in kernels:
        if MARKER in k[2]:
            steps.append([k])
        elif steps:
            steps[-1].append(k)
    return walls, steps, allocs


def step_gaps(kernels: list[tuple]) -> dict:
    marker, rest = kernels[0], kernels[1:]
    busy, end, gaps = 0.0, marker[1], []
    for i, (a, b, name) in enumerate(rest):
        if a > end and i > 0:
            gaps.append((a - end, rest[i - 1][2], name))
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return {"first_us": rest[0][0] - marker[1] if rest else 0.0, "busy_us": busy, "span_us": end - marker[0],
            "gaps": gaps, "kernels": len(rest)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--top", type=int, default=12, help="largest gaps listed")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    model, device, rt, loss, forests, kind, options = script_setup(args, args.steps + 3)
    if device.type != "cuda":
        emit_report("# GPU gaps: no CUDA device, nothing to profile", f"gpu_gaps_{args.workload}.md")
        return 0
    walls, steps, allocs = profiled_steps(rt, model, forests[3:], loss, device)
    rows = [step_gaps(k) for k in steps]
    lines = [f"# GPU gaps in steady dtree steps: {args.workload}, CUDA activity only", "",
             f"torch {torch.__version__}; options {options or 'default'}; {len(rows)} fresh forests", "",
             ("| step | wall ms | kernels | busy ms | idle ms | before the first kernel ms | gaps > 100 us (ms) "
              "| device allocs / frees |"),
             "|---|---|---|---|---|---|---|---|"]
    for i, (wall, r, (n_alloc, n_free)) in enumerate(zip(walls, rows, allocs)):
        big = sum(g for g, _, _ in r["gaps"] if g > 100) / 1e3
        lines.append(f"| {i} | {wall * 1e3:.1f} | {r['kernels']} | {r['busy_us'] / 1e3:.1f} | "
                     f"{wall * 1e3 - r['busy_us'] / 1e3:.1f} | {r['first_us'] / 1e3:.2f} | {big:.2f} "
                     f"| {n_alloc} / {n_free} |")
    lines += ["", "Gaps between kernels by size (median step):", "", "| gap | count | ms |", "|---|---|---|"]
    mid = rows[sorted(range(len(rows)), key=lambda i: walls[i])[len(rows) // 2]]
    lo = 0.0
    for hi in BINS_US:
        sel = [g for g, _, _ in mid["gaps"] if lo < g <= hi]
        lines.append(f"| {lo:g}-{hi:g} us | {len(sel)} | {sum(sel) / 1e3:.2f} |")
        lo = hi
    lines += ["", "Largest gaps of that step (kernel before -> kernel after):", "", "| us | before | after |",
              "|---|---|---|"]
    for g, before, after in sorted(mid["gaps"], reverse=True)[: args.top]:
        lines.append(f"| {g:.0f} | `{before[:70]}` | `{after[:70]}` |")
    pairs = collections.Counter()
    for g, before, after in mid["gaps"]:
        if g > 20:
            pairs[(before[:60], after[:60])] += g
    lines += ["", "Gaps over 20 us summed by kernel pair:", "", "| ms | before | after |", "|---|---|---|"]
    for (before, after), total in pairs.most_common(args.top):
        lines.append(f"| {total / 1e3:.2f} | `{before}` | `{after}` |")
    lines += ["", f"Median wall {statistics.median(walls) * 1e3:.1f} ms."]
    emit_report("\n".join(lines), f"gpu_gaps_{args.workload}{'_' + args.tag if args.tag else ''}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
