"""What keeping checkpointed layers' inputs in pinned host memory costs a step
(``offload_checkpoints``, :mod:`dtree.models.host_checkpoints`).

Two runtimes over the same fresh forests in one process, alike but for ``offload_checkpoints``
(or the boolean option ``--compare`` names, e.g. ``keep_attention_outputs``; ``--opt`` sets the
rest; default ``memory=low``), the order rotating each step. Per way: step
seconds, peak allocated memory, pinned page bytes held after the step and pinned during it (a
step that pins pays ``cudaHostAlloc``), and the host time inside the group's ``put`` and
``get`` (``put``: queue the copies to the host; ``get``: queue the copy back, its prefetch, the
wait), and the allocator's new mappings and retries (a retry frees its cache and waits for the
device). Then one step of each over the last forest under torch.profiler: wall, kernel time
(copies included) and the host events that differ most.

    python benchmarks/offload_cost.py --workload agentic64k                      # H100 / H200
    python benchmarks/offload_cost.py --workload agentic64k --compare keep_attention_outputs
    python benchmarks/offload_cost.py --smoke                                     # CPU plumbing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree
from benchmarks.first_encounter import ALLOCATOR_KEYS, compared, profiled
from benchmarks.host_profile import WORKLOADS, script_parts
from dtree.bench.layers import bench_layers
from dtree.bench.measure import allocator_counts, counter_deltas, emit_report, sync_device
from dtree.bench.report import environment
from dtree.models import host_checkpoints

GIB = 2.0**30
WAYS = {"offloaded": True, "on the device": False}  # offload_checkpoints


def ways_of(option: str) -> dict[str, bool]:
    """The two ways of a boolean RuntimeConfig option: its value per way's name."""
    if option == "offload_checkpoints":
        return dict(WAYS)
    if not isinstance(getattr(dtree.RuntimeConfig(), option, None), bool):
        raise SystemExit(f"--compare takes a boolean RuntimeConfig option, got {option!r}")
    return {f"{option}=True": True, f"{option}=False": False}


class HostTimers:
    """Host seconds and calls inside ``HostCheckpoints.put`` and ``.get`` while installed."""

    def __init__(self) -> None:
        self.seconds = {"put": 0.0, "get": 0.0}
        self.calls = {"put": 0, "get": 0}
        self._saved = {}

    def install(self) -> None:
        cls = host_checkpoints.HostCheckpoints
        for name in ("put", "get"):
            original = getattr(cls, name)
            self._saved[name] = original

            def timed(group, arg, _name=name, _original=original):
                t0 = time.perf_counter()
                try:
                    return _original(group, arg)
                finally:
                    self.seconds[_name] += time.perf_counter() - t0
                    self.calls[_name] += 1

            setattr(cls, name, timed)

    def take(self) -> tuple[dict, dict]:
        out = (dict(self.seconds), dict(self.calls))
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)
        return out


def timed_step(rt, forest, loss, model, device, timers: HostTimers) -> dict:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync_device(device)
    held = host_checkpoints.host_page_bytes()
    before = allocator_counts(device, ALLOCATOR_KEYS)
    timers.take()
    t0 = time.perf_counter()
    out = rt.forward_backward(forest, loss)
    sync_device(device)
    seconds = time.perf_counter() - t0
    host, calls = timers.take()
    new = counter_deltas(before, allocator_counts(device, ALLOCATOR_KEYS))
    return {"mappings": new.get("mappings", 0), "retries": new.get("retries", 0), "seconds": seconds,
            "peak": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
            "pinned": (host_checkpoints.host_page_bytes() - held) / GIB,
            "held": host_checkpoints.host_page_bytes() / GIB,
            "put_ms": host["put"] * 1e3, "get_ms": host["get"] * 1e3, "puts": calls["put"],
            "plan": out.metrics.get("memory_plan", {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="agentic64k")
    p.add_argument("--steps", type=int, default=3, help="timed steps per way, each on a fresh forest")
    p.add_argument("--opt", action="append", default=None, metavar="KEY=VALUE",
                   help="a RuntimeConfig option for both ways (default: memory=low)")
    p.add_argument("--compare", default="offload_checkpoints", metavar="OPTION",
                   help="the boolean RuntimeConfig option the two ways differ in")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, small forests")
    args = p.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    ways = ways_of(args.compare)
    model, device, forest_of, options, loss = script_parts(args.smoke, args.workload, args.opt or ["memory=low"])
    forests = [forest_of(2000 + i) for i in range(args.steps + 1)]
    timers = HostTimers()
    timers.install()
    rows: dict[str, list[dict]] = {}
    with bench_layers(model, "auto", device) as layers:
        runtimes = {w: dtree.TreeRuntime(model, **{**options, args.compare: on}) for w, on in ways.items()}
        for rt in runtimes.values():  # warm-up: compiles, the memory probe, the first pages
            for _ in range(2):
                timed_step(rt, forests[0], loss, model, device, timers)
        order = list(runtimes.items())
        for s in range(1, args.steps + 1):
            for w, rt in order[(s - 1) % 2:] + order[:(s - 1) % 2]:
                rows.setdefault(w, []).append(timed_step(rt, forests[s], loss, model, device, timers))
                r = rows[w][-1]
                print(f"step {s} {w}: {r['seconds']:.3f} s, peak {r['peak']}, pinned {r['pinned']:.2f} GiB, "
                      f"put {r['put_ms']:.1f} ms, get {r['get_ms']:.1f} ms", flush=True)

        def run(rt):
            return lambda: (model.zero_grad(set_to_none=True), rt.forward_backward(forests[-1], loss))

        profiles = [profiled(run(rt), device) for rt in runtimes.values()]
    env = environment(device)
    lines = [f"# Checkpointed layers on the host, by {args.compare}: {args.workload}, {env.get('device', device.type)}", "",
             "- " + ", ".join(f"{k} {v}" for k, v in env.items()),
             (f"- decoder layers: {layers}; options: {options}; {args.steps} fresh forests, the ways alternating "
              f"(the first rotating); {forests[1].num_unique_tokens:,} unique tokens in the first"), "",
             ("| way | step (s) | peak alloc (GiB) | pinned during steps (GiB) | pages held (GiB) | put (ms/step) | "
              "get (ms/step) | layer inputs offloaded per step | allocator mappings / retries | plan |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for w, r in rows.items():
        plan = r[-1]["plan"]
        desc = (f"{plan.get('group_tokens')}-token calls, {plan.get('checkpoint_layers')} ckpt, path "
                f"{plan.get('path_checkpoint_layers')}, keep {plan.get('keep_attention_outputs')}, offload "
                f"{plan.get('offload_checkpoints')}, predicted {plan.get('predicted_total_gib') or 0:.2f} GiB")
        peak = max((x["peak"] or 0) for x in r)
        lines.append(f"| {w} | {statistics.fmean(x['seconds'] for x in r):.3f} | {peak:.2f} | "
                     f"{sum(x['pinned'] for x in r):.2f} | {r[-1]['held']:.2f} | "
                     f"{statistics.fmean(x['put_ms'] for x in r):.1f} | {statistics.fmean(x['get_ms'] for x in r):.1f} | "
                     f"{r[-1]['puts']} | {sum(x['mappings'] for x in r)} / {sum(x['retries'] for x in r)} | {desc} |")
    lines += ["", "## One step of each over the last forest, under torch.profiler", ""]
    lines += compared(tuple(ways), profiles[0], profiles[1], args.top)
    emit_report("\n".join(lines) + "\n", f"offload_cost_{args.workload}_{args.compare}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
