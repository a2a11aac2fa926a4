"""What the first run over a fresh forest pays that a second run over the same forest does not.

Session U found the first dtree run to meet a fresh 64k-token forest 0.3-0.5 s per optimizer step
slower than the runs after it in the same process (PERF_NOTES, session U), with flash-attn-4 and
without it. A training loop meets a fresh forest at every step, so that cost is in every step a user
runs. This script tells its candidate causes apart, in one process, on ``--forests`` fresh forests
(after one warm-up forest), each run as:

* ``first``: the first run over the forest;
* ``second``: again over the same forest object (every per-shape cache warm);
* ``copy``: over a deep copy of it (the same shapes, a new object: a cache keyed on the object
  would miss here and not in ``second``);
* ``emptied``: after ``torch.cuda.empty_cache()`` (the allocator maps its memory again: if this
  run is as slow as ``first``, the cost is the allocator's).

Per run: wall seconds (gradients cleared before, one device sync after), the allocator's new
device mappings (``num_device_alloc``) and bytes newly reserved, and the Triton kernels compiled
or loaded during it (``knobs.runtime`` hooks). For the last forest, the ``first`` and ``second``
runs also run under torch.profiler (CPU and CUDA activity): their kernel time, kernel count, and
the host events whose self time differs most between the two.

    python benchmarks/first_encounter.py --workload agentic64k --opt memory=14.5     # H100 / H200
    python benchmarks/first_encounter.py --smoke                                      # CPU plumbing
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree
from benchmarks.host_profile import WORKLOADS, script_parts
from benchmarks.profile_warmup import _TritonCompiles
from dtree.bench.layers import bench_layers
from dtree.bench.measure import allocator_counts, counter_deltas, emit_report, sync_device
from dtree.bench.report import environment

GIB = 2.0**30
RUNS = ("first", "second", "copy", "emptied")


ALLOCATOR_KEYS = {"num_device_alloc": "mappings", "reserved_bytes.all.allocated": "reserved",
                  "num_alloc_retries": "retries"}  # device mappings, bytes reserved, retries (a retry frees the cache)


def timed_run(rt, forest, loss, model, device, triton: _TritonCompiles) -> dict:
    """One forward_backward over ``forest``: seconds, new mappings, GiB newly reserved, Triton compiles."""
    model.zero_grad(set_to_none=True)
    sync_device(device)
    triton.take()
    before = allocator_counts(device, ALLOCATOR_KEYS)
    t0 = time.perf_counter()
    rt.forward_backward(forest, loss)
    sync_device(device)
    seconds = time.perf_counter() - t0
    new = counter_deltas(before, allocator_counts(device, ALLOCATOR_KEYS))
    return {"seconds": seconds, "mappings": new.get("mappings", 0),
            "reserved_gib": new.get("reserved", 0) / GIB, "triton": len(triton.take())}


def _run(name, rt, forest, loss, model, device, triton) -> dict:
    if name == "second":
        return timed_run(rt, forest, loss, model, device, triton)
    if name == "copy":
        return timed_run(rt, copy.deepcopy(forest), loss, model, device, triton)
    if name == "emptied" and device.type == "cuda":
        torch.cuda.empty_cache()
    return timed_run(rt, forest, loss, model, device, triton)


def profiled(run, device) -> tuple[float, float, int, dict]:
    """(wall s, kernel ms, kernels, host event -> (self CPU ms, calls)) of ``run()`` under
    torch.profiler (CPU and CUDA activity; copies count as kernels)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync_device(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        sync_device(device)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
    return wall, sum(k.device_time for k in kernels) / 1e3, len(kernels), host


def compared(labels: tuple[str, str], a: tuple, b: tuple, top: int) -> list[str]:
    """Markdown lines comparing two :func:`profiled` results: wall, kernel time and count, and
    the ``top`` host events whose self CPU time differs most."""
    (w1, k1, n1, h1), (w2, k2, n2, h2) = a, b
    lines = ["| profiled run | wall (ms) | kernel time (ms) | kernels |", "|---|---|---|---|",
             f"| {labels[0]} | {w1 * 1e3:.0f} | {k1:.0f} | {n1} |", f"| {labels[1]} | {w2 * 1e3:.0f} | {k2:.0f} | {n2} |",
             "", f"| host event | self CPU ms, {labels[0]} | {labels[1]} | difference | calls, {labels[0]} | {labels[1]} |",
             "|---|---|---|---|---|---|"]
    names = sorted(set(h1) | set(h2), key=lambda k: -abs(h1.get(k, (0, 0))[0] - h2.get(k, (0, 0))[0]))
    for k in names[:top]:
        (x, cx), (y, cy) = h1.get(k, (0.0, 0)), h2.get(k, (0.0, 0))
        lines.append(f"| `{k[:80]}` | {x:.1f} | {y:.1f} | {x - y:+.1f} | {cx} | {cy} |")
    return lines


def profiled_pair(rt, forest, loss, model, device, top: int) -> list[str]:
    """Markdown lines: a first and a second run over ``forest`` under torch.profiler (:func:`compared`)."""
    def run():
        model.zero_grad(set_to_none=True)
        rt.forward_backward(forest, loss)

    first = profiled(run, device)
    return compared(("first", "second"), first, profiled(run, device), top)


def prewarm_head(model, device, rows: range, chunk: int) -> float:
    """The fused LM head's forward and backward (:func:`dtree.ops.logprobs.fused_head.token_logprobs_triton`,
    ``chunk``-row chunks) once at each row count of ``rows``, on random hidden states: every cuBLAS product
    shape the head's calls would meet at those row counts, met once before the timed runs. Returns seconds."""
    from dtree.ops.logprobs.fused_head import token_logprobs_triton

    weight = model.get_output_embeddings().weight
    t0 = time.perf_counter()
    for n in rows:
        hidden = torch.randn(n, weight.shape[1], device=device, dtype=weight.dtype, requires_grad=True)
        labels = torch.randint(0, weight.shape[0], (n,), device=device)
        logp, _ = token_logprobs_triton(hidden, weight, labels, chunk_size=chunk)
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    sync_device(device)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="agentic64k")
    p.add_argument("--forests", type=int, default=3, help="fresh forests timed (after one warm-up forest)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="a RuntimeConfig option")
    p.add_argument("--top", type=int, default=25, help="host events listed from the profiled pair")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled pair")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, small forests")
    p.add_argument("--prewarm-head", default=None, metavar="START:STOP:STEP",
                   help="after the warm-up forest, run the LM head's forward and backward once at each of these row counts")
    p.add_argument("--head-chunk", type=int, default=4096, help="the head's row chunk for --prewarm-head")
    args = p.parse_args()
    if args.forests < 1:
        raise SystemExit("--forests must be >= 1")
    model, device, forest_of, options, loss = script_parts(args.smoke, args.workload, args.opt)
    forests = [forest_of(1000 + i) for i in range(args.forests + 2)]
    triton = _TritonCompiles()
    rows: dict[str, list[dict]] = {}
    with bench_layers(model, "auto", device) as layers:
        rt = dtree.TreeRuntime(model, **options)
        for name in ("first", "second"):  # the warm-up forest: compiles, the memory probe
            _run(name, rt, forests[0], loss, model, device, triton)
        prewarm = None
        if args.prewarm_head:
            start, stop, step = (int(x) for x in args.prewarm_head.split(":"))
            prewarm = (args.prewarm_head, prewarm_head(model, device, range(start, stop, step), args.head_chunk))
            print(f"head pre-warmed at rows {args.prewarm_head}: {prewarm[1]:.1f} s", flush=True)
        for i, forest in enumerate(forests[1:-1], 1):
            for name in RUNS:
                rows.setdefault(name, []).append(_run(name, rt, forest, loss, model, device, triton))
                r = rows[name][-1]
                print(f"forest {i} {name}: {r['seconds']:.3f} s, {r['mappings']} mappings, "
                      f"{r['reserved_gib']:.2f} GiB newly reserved, {r['triton']} Triton compiles", flush=True)
        profile_lines = profiled_pair(rt, forests[-1], loss, model, device, args.top) if args.profile else []
    env = environment(device)
    first = statistics.fmean(r["seconds"] for r in rows["first"])
    lines = [f"# The first run over a fresh forest: {args.workload}, {env.get('device', device.type)}", "",
             "- " + ", ".join(f"{k} {v}" for k, v in env.items()),
             (f"- decoder layers: {layers}; dtree options: {options or 'defaults'}; "
              f"{forests[1].num_unique_tokens:,} unique tokens in forest 1; {args.forests} forests, "
              "each run in the order below, gradients cleared before each run"
              + (f"; the LM head run first at rows {prewarm[0]} ({prewarm[1]:.1f} s)" if prewarm else "")), "",
             "| run | seconds (mean) | per forest | against first | new mappings | GiB newly reserved | Triton compiles |",
             "|---|---|---|---|---|---|---|"]
    for name in RUNS:
        r = rows[name]
        mean = statistics.fmean(x["seconds"] for x in r)
        per_forest = ", ".join(f"{x['seconds']:.3f}" for x in r)
        lines.append(f"| `{name}` | {mean:.3f} | {per_forest} | {mean / first:.3f} | "
                     f"{sum(x['mappings'] for x in r)} | {sum(x['reserved_gib'] for x in r):.2f} | "
                     f"{sum(x['triton'] for x in r)} |")
    if profile_lines:
        lines += ["", f"## Under torch.profiler: a first and a second run over forest {args.forests + 1}", ""]
        lines += profile_lines
    emit_report("\n".join(lines) + "\n", f"first_encounter_{args.workload}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
