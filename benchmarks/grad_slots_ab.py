"""Session N's memory change undone, in one process on the same forests: the KV stack's
gradient slots for the path only (``--low-chunk``: also ``memory="low"`` with 1,024-row LM-head
chunks, what its cap without slack took, tried and dropped in session N).

    python benchmarks/grad_slots_ab.py --workload agentic64k          # H100/H200, ~2 minutes
    python benchmarks/grad_slots_ab.py --smoke                        # CPU: plumbing only

Variants, per memory setting (``--memory``, default ``auto,low``): ``as is``; ``all gradient
slots`` (every K/V slot with a gradient slot, as before: the plan's ``leaf_slots_take_grads``
answers True); with ``--low-chunk``, for ``low``, ``1,024-row head chunks``. Each variant keeps
its own runtime; after two warm-up steps each, the variants take turns, step by step, over
``--rounds`` fresh forests, each round starting at the next variant (so drift in the machine
and the step after another runtime's fall on all alike). Per variant: the mean step time, the
peak allocated memory, and how often a step grew the gradient slots past the plan's
(``KVStack.grad_slots_through``: a call on a fallback path inside the backend).

``--profile``: then one more step per variant under the torch profiler: its CUDA kernel time
by kernel name, and the names whose time differs most from the first variant's.

Prints Markdown, also written to ``$OUT/grad_slots_ab_<workload>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from benchmarks.host_profile import SMOKE, WORKLOADS  # noqa: E402
from dtree.bench.measure import emit_report, script_model, sync_device  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.ops.stack_ops.kv_stack import KVStack  # noqa: E402
from dtree.plan import stack_sizes  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402


@contextlib.contextmanager
def all_gradient_slots(on: bool):
    """The plan gives every K/V slot a gradient slot (the behaviour before session N)."""
    if not on:
        yield
        return
    original = stack_sizes.leaf_slots_take_grads
    stack_sizes.leaf_slots_take_grads = lambda *a, **k: True
    try:
        yield
    finally:
        stack_sizes.leaf_slots_take_grads = original


def count_growths() -> list[int]:
    """Patch KVStack.grad_slots_through to count the calls that grow the buffers."""
    grown, through = [0], KVStack.grad_slots_through

    def counting(self, end):
        if self.has_grad and min(end, self.capacity) > self.grad_slots:
            grown[0] += 1
        through(self, end)

    KVStack.grad_slots_through = counting
    return grown


def variants(memory: str, low_chunk: bool) -> list[tuple[str, dict, bool]]:
    """(label, runtime options, all gradient slots) of one memory setting."""
    out = [(f"{memory}: as is", {"memory": memory}, False), (f"{memory}: all gradient slots", {"memory": memory}, True)]
    if memory == "low" and low_chunk:
        out.append((f"{memory}: 1,024-row head chunks", {"memory": memory, "logprob_chunk": 1024}, False))
    return out


def step(rt, forest, loss, model, device, full: bool) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    sync_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with all_gradient_slots(full):
        rt.forward_backward(forest, loss)
    sync_device(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return time.perf_counter() - t0, peak


def profiled_step(rt, forest, loss, model, device, full: bool) -> tuple[float, dict[str, float]]:
    """(wall seconds, CUDA microseconds per kernel name) of one step under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    sync_device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        with all_gradient_slots(full):
            rt.forward_backward(forest, loss)
        sync_device(device)
        wall = time.perf_counter() - t0
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] = kernels.get(e.name[:90], 0.0) + e.time_range.elapsed_us()
    return wall, kernels


def profile_lines(runs, forest, loss, model, device) -> list[str]:
    got = [(label, *profiled_step(rt, forest, loss, model, device, full)) for label, rt, full in runs]
    base_label, _, base = got[0]
    lines = ["", "| variant | profiled step (s) | CUDA kernel time (ms) | kernels |", "|---|---|---|---|"]
    lines += [f"| {a} | {w:.3f} | {sum(k.values()) / 1e3:.1f} | {len(k)} names |" for a, w, k in got]
    for label, _, kernels in got[1:]:
        names = set(kernels) | set(base)
        diff = sorted(names, key=lambda n: -abs(kernels.get(n, 0.0) - base.get(n, 0.0)))[:12]
        lines += ["", f"{label} against {base_label}: the kernels whose time differs most (ms)", "",
                  "| kernel | " + base_label + " | " + label + " |", "|---|---|---|"]
        lines += [f"| `{n}` | {base.get(n, 0.0) / 1e3:.2f} | {kernels.get(n, 0.0) / 1e3:.2f} |" for n in diff]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="agentic64k")
    p.add_argument("--memory", default="auto,low", help="comma-separated memory settings")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--low-chunk", action="store_true", help="also low with 1,024-row head chunks")
    p.add_argument("--profile", action="store_true", help="then one profiled step per variant")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a small forest")
    args = p.parse_args(argv)
    model, device = script_model(args.smoke)
    spec = adapt(model).dtree_spec()
    kind, params = (SMOKE if args.smoke or device.type != "cuda" else WORKLOADS)[args.workload]
    forests = [make_workload(kind, seed=i, vocab_size=spec.vocab_size, **params) for i in range(args.rounds + 2)]
    loss = ppo_clip(clip_eps=0.2, reduction="token_mean")
    grown = count_growths()
    rows, profiles = [], []
    for memory in [m for m in args.memory.split(",") if m]:
        runs = [(label, dtree.TreeRuntime(model, **opts), full) for label, opts, full in variants(memory, args.low_chunk)]
        for label, rt, full in runs:  # warm-up: compiles, the memory probe
            for forest in forests[:2]:
                step(rt, forest, loss, model, device, full)
        times = {label: [] for label, _, _ in runs}
        peaks = {label: [] for label, _, _ in runs}
        growths = {label: 0 for label, _, _ in runs}
        for r, forest in enumerate(forests[2:]):
            for label, rt, full in runs[r % len(runs):] + runs[: r % len(runs)]:
                before = grown[0]
                t, peak = step(rt, forest, loss, model, device, full)
                times[label].append(t)
                peaks[label].append(peak)
                growths[label] += grown[0] - before
                print(f"{label}: {t:.3f} s, {peak:.2f} GiB", file=sys.stderr)
        base = statistics.mean(times[runs[0][0]])
        for label, rt, _ in runs:
            plan = rt.memory_plan
            knobs = "-" if plan is None else (f"{plan.group_tokens} tokens, {plan.checkpoint_layers} ckpt, "
                                              f"{plan.logprob_chunk}-row head")
            rows.append((label, statistics.mean(times[label]), statistics.mean(times[label]) / base,
                         max(peaks[label]), growths[label], knobs))
        if args.profile:
            profiles += profile_lines(runs, forests[-1], loss, model, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = [f"# Gradient slots for the path only, undone: {args.workload} on {name}", "",
             f"torch {torch.__version__}; {args.rounds} rounds of fresh forests, variants in turn, each round "
             "starting at the next one",
             "", "| variant | mean step (s) | vs as is | peak alloc (GiB) | growths | plan |", "|---|---|---|---|---|---|"]
    lines += [f"| {a} | {t:.3f} | {r:.3f} | {pk:.2f} | {g} | {k} |" for a, t, r, pk, g, k in rows]
    lines += profiles
    emit_report("\n".join(lines) + "\n", f"grad_slots_ab_{args.workload}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
