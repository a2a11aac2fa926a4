"""How fast this machine's host runs the calls a dtree step is made of, and whether the
step's time follows torch's intra-op CPU threads.

GRPO case 1 (one 6k-token call) is host-bound in its forward wherever a decoder layer's
host work outlasts its ~0.85 ms of kernels (``benchmarks/queue_depth.py``), so its step
time follows the host's speed more than the GPU's: 0.126-0.161 s on H200 machines of one
kind (``PERF_NOTES.md``, sessions Q-AO). This script measures, in one process:

* **op costs**: the median host time of the calls a layer makes many of (a tensor view, an
  allocation, a small matmul launch, an elementwise launch, a Python call), so that two
  machines' step times can be told apart by their hosts;
* **threads**: the workload's steps with torch's default intra-op threads against one thread
  (``torch.set_num_threads(1)``: the plan's CPU tensor ops then never wake a thread pool),
  alternating arm by arm on fresh forests, with the paired ratio.

    python benchmarks/host_speed.py --workload case1     # GPU machine
    python benchmarks/host_speed.py --smoke              # CPU, tiny model: plumbing only

Prints Markdown, also written to ``$OUT/host_speed_<workload>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup
from dtree.bench.measure import emit_report, host_timed_step, sync_device


def _noop(x):
    return x


def op_costs(device: torch.device, reps: int = 2000) -> list[tuple[str, float]]:
    """(what, median microseconds per call) of the host calls a layer is made of; the GPU is
    synchronized between batches so that no launch waits on a full queue."""
    x = torch.zeros(64, 128, device=device)
    w = torch.zeros(64, 128, device=device)
    calls = [
        ("Python function call", lambda: _noop(x)),
        ("tensor view (`x.view(-1)`)", lambda: x.view(-1)),
        ("tensor transpose", lambda: x.transpose(0, 1)),
        ("allocation (`torch.empty(256)`)", lambda: torch.empty(256, device=device)),
        ("elementwise launch (`x + x`)", lambda: x + x),
        ("small matmul launch (`F.linear`)", lambda: F.linear(x, w)),
    ]
    rows = []
    for name, fn in calls:
        times = []
        for _ in range(reps // 100):
            sync_device(device)
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            times.append((time.perf_counter() - t0) * 1e4)  # microseconds per call
        rows.append((name, statistics.median(times)))
    sync_device(device)
    return rows


def alternating_steps(rt, model, forests, loss, device, rounds: int) -> dict[str, list[float]]:
    """Step walls per arm, arms alternating on consecutive fresh forests (default threads
    first, then one thread), ``rounds`` times through ``forests``."""
    default_threads = torch.get_num_threads()
    arms = {f"{default_threads} intra-op threads (default)": default_threads, "1 intra-op thread": 1}
    walls: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for r in range(rounds):
            for i, forest in enumerate(forests):
                for name, threads in (arms.items() if (i + r) % 2 == 0 else reversed(arms.items())):
                    torch.set_num_threads(threads)
                    walls[name].append(host_timed_step(rt, forest, loss, model, device)["wall"])
    finally:
        torch.set_num_threads(default_threads)
    return walls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--forests", type=int, default=8, help="fresh forests, each stepped once per arm and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    model, device, rt, loss, forests, kind, options = script_setup(args, args.forests + 3)
    costs = op_costs(device)
    walls = alternating_steps(rt, model, forests[3:], loss, device, args.rounds)
    names = list(walls)
    paired = [b / a for a, b in zip(walls[names[0]], walls[names[1]])]
    lines = [f"# Host speed: {args.workload} ({kind}), {device.type}", "",
             f"torch {torch.__version__}; {os.cpu_count()} CPUs; runtime options {options or 'default'}", "",
             "## Op costs (median host microseconds per call)", "", "| call | us |", "|---|---|"]
    lines += [f"| {name} | {us:.2f} |" for name, us in costs]
    lines += ["", f"## Steps by intra-op threads ({args.forests} fresh forests x {args.rounds} rounds, alternating)",
              "", "| arm | median step s | min | max |", "|---|---|---|---|"]
    lines += [f"| {name} | {statistics.median(w):.4f} | {min(w):.4f} | {max(w):.4f} |" for name, w in walls.items()]
    lines += ["", f"Paired ratio (one thread / default), median: **{statistics.median(paired):.3f}**"]
    emit_report("\n".join(lines), f"host_speed_{args.workload}{'_' + args.tag if args.tag else ''}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
