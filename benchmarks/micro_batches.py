"""Optimizer steps of several micro-batches: how dtree's gradient accumulation runs and what it holds.

A trainer accumulates the gradients of ``--micro-batches`` fresh forests per optimizer step (GRPO
groups, agent trees) before it steps the optimizer. This script times such optimizer steps, in one
process, alternating the ways of running them in an order that rotates each round (each optimizer
step starts with the gradients cleared and ends with one device sync; the first way to meet a
round's fresh forests pays the once-per-shape costs of their new shapes, which had made the first
way of every round look ~5% slower before session U):

* ``loop``: one ``forward_backward`` per micro-batch (what a trainer writes today), with the
  batch-wide normalization;
* ``micro``: ``forward_backward_micro_batches`` (``dtree.engine.micro_batches``: the next
  micro-batch planned while the GPU runs the current one; the model's layers swapped once);
* ``... unguarded``: the same with ``grad_guard=False`` (the step accumulates into ``param.grad``
  in place instead of keeping the old gradients aside: one copy of the gradients less from the
  second micro-batch on);
* ``... device copy``: the same with ``grad_guard="device"`` (the old gradients kept aside on the
  device, as every guarded step did before the plan could keep them in pinned host memory; the
  ``guard`` column says where each way's plans kept them);
* ``mask loop``: ``tree-mask:whole+ckpt`` per micro-batch, accumulating in place (AReaL's form),
  with the same decoder layers (``dtree.bench.layers``).

Per way: seconds per micro-batch (mean over the timed optimizer steps), MFU over the unique
tokens, the peak allocated memory of an optimizer step, and dtree's largest predicted peak of
its micro-batches (``metrics["memory_plan"]["predicted_total_gib"]``): with gradients already
there, a plan that did not count the step's own gradients under-predicts by their size.
``--opt memory=14.5`` (repeatable ``--opt KEY=VALUE``) runs every dtree way under that setting.
Ways the installed dtree lacks (an older checkout) are reported as absent.

    python benchmarks/micro_batches.py --workload case1 --micro-batches 4      # H100 / H200
    python benchmarks/micro_batches.py --workload agentic64k --micro-batches 2 --opt memory=14.5
    python benchmarks/micro_batches.py --smoke                                   # CPU plumbing
    python benchmarks/micro_batches.py --dtree-src .oldm --ways loop ...         # the code before a change
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dtree-src" in sys.argv[:-1]:  # before anything imports dtree: an older checkout's, for before/after runs
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--dtree-src") + 1]))

import dtree  # first: --dtree-src's, before benchmarks.host_profile puts this checkout in front)
from benchmarks.host_profile import WORKLOADS, script_parts
from dtree.baselines import make_method
from dtree.bench.layers import bench_layers
from dtree.bench.measure import emit_report, peak_tflops, sync_device
from dtree.bench.report import environment
from dtree.losses import Normalization
from dtree.models import adapt

GIB = 2.0**30


def ways(model, options: dict) -> dict:
    """name -> fn(forests, loss, normalization) running one optimizer step's micro-batches, or
    the reason the way is absent."""
    rt = dtree.TreeRuntime(model, **options)
    out = {"loop": lambda fs, loss, norm: [rt.forward_backward(f, loss, normalization=norm) for f in fs]}
    if not hasattr(rt, "forward_backward_micro_batches"):
        why = "this dtree has no forward_backward_micro_batches (nor grad_guard)"
        return {**out, "micro": why, "micro unguarded": why, "mask loop": why}
    unguarded = dtree.TreeRuntime(model, **{**options, "grad_guard": False})
    mask = make_method("tree-mask", model, max_tokens_per_batch=None, checkpoint=True, grad_guard=False)
    out["micro"] = lambda fs, loss, norm: rt.forward_backward_micro_batches(fs, loss, normalization=norm)
    out["micro unguarded"] = lambda fs, loss, norm: unguarded.forward_backward_micro_batches(fs, loss, normalization=norm)
    try:
        on_device = dtree.TreeRuntime(model, **{**options, "grad_guard": "device"})
        out["micro device copy"] = lambda fs, loss, norm: on_device.forward_backward_micro_batches(
            fs, loss, normalization=norm)
    except ValueError:
        out["micro device copy"] = "this dtree has no grad_guard='device'"
    out["mask loop"] = lambda fs, loss, norm: [mask.forward_backward(f, loss, normalization=norm) for f in fs]
    return out


def optimizer_step(fn, forests, loss, model, device) -> tuple[float, float | None, float | None, int, str]:
    """(seconds, peak allocated GiB, largest predicted peak GiB, model calls, where the plans kept the
    old gradients) of one optimizer step."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync_device(device)
    t0 = time.perf_counter()
    outs = fn(forests, loss, Normalization.from_forests(forests, loss))
    sync_device(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    predicted = [o.metrics.get("memory_plan", {}).get("predicted_total_gib") for o in outs]
    predicted = [p for p in predicted if p is not None]
    guards = sorted({str(o.metrics.get("memory_plan", {}).get("grad_guard", "-")) for o in outs})
    return seconds, peak, max(predicted) if predicted else None, sum(o.num_model_calls for o in outs), "/".join(guards)


def _largest(values) -> str:
    found = [v for v in values if v is not None]
    return f"{max(found):.2f}" if found else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="case1")
    p.add_argument("--micro-batches", type=int, default=4, help="fresh forests per optimizer step")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per way (after one untimed)")
    p.add_argument("--ways", default="", help="comma-separated subset (default: every way)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="a RuntimeConfig option (dtree)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, small forests")
    p.add_argument("--dtree-src", default=None, metavar="DIR",
                   help="import dtree from DIR/dtree (e.g. `git archive <rev> dtree | tar -x -C DIR`: the code before a change)")
    args = p.parse_args()
    if args.micro_batches < 1 or args.steps < 1:
        raise SystemExit("--micro-batches and --steps must be >= 1")
    model, device, forest_of, options, loss = script_parts(args.smoke, args.workload, args.opt)
    spec = adapt(model).dtree_spec()
    k = args.micro_batches
    batches = [[forest_of(s * k + i) for i in range(k)]
               for s in range(args.steps + 1)]
    rows, absent = {}, {}
    with bench_layers(model, "auto", device) as layers:
        found = ways(model, options)
        wanted = [w for w in (args.ways.split(",") if args.ways else found)]
        runs = {w: found[w] for w in wanted if callable(found[w])}
        absent = {w: found[w] for w in wanted if not callable(found[w])}
        for w, fn in runs.items():  # the untimed first optimizer step: compiles, the memory probe
            optimizer_step(fn, batches[0], loss, model, device)
            print(f"{w}: warmed up", flush=True)
        order = list(runs.items())
        for s in range(1, args.steps + 1):  # the ways alternate, so every way sees the same host drift,
            # and the first to meet a step's fresh forests (its new shapes' one-time costs) rotates
            for w, fn in order[(s - 1) % len(order):] + order[:(s - 1) % len(order)]:
                rows.setdefault(w, []).append(optimizer_step(fn, batches[s], loss, model, device))
                print(f"{w} step {s}: {rows[w][-1][0]:.3f} s", flush=True)
    flops = sum(spec.training_flops(torch.from_numpy(f.positions.copy())) for b in batches[1:] for f in b)
    tokens = sum(f.num_unique_tokens for b in batches[1:] for f in b)
    peak = peak_tflops(device, next(model.parameters()).dtype)
    base = statistics.fmean(r[0] for r in rows["loop"]) if "loop" in rows else None
    env = environment(device)
    where = os.path.dirname(os.path.dirname(dtree.__file__))
    per_micro_batch = tokens / (args.steps * k)
    lines = [
        f"# Optimizer steps of {k} micro-batches: {args.workload}, {env.get('device', device.type)}", "",
        "- " + ", ".join(f"{key} {value}" for key, value in env.items()),
        f"- dtree from {where}; decoder layers, every way: {layers}; dtree options: {options or 'defaults'}",
        (f"- {args.steps} timed optimizer steps per way (after one untimed), ways alternating, the first of each round rotating; "
         f"{per_micro_batch:,.0f} unique tokens per micro-batch on average; gradients cleared before each "
         "optimizer step, one device sync after it"), "",
        ("| way | s per micro-batch | against loop | MFU | model calls per step | peak alloc (GiB) | "
         "largest predicted (GiB) | guard |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for w, r in rows.items():
        total = sum(x[0] for x in r)
        mfu = f"{flops / total / (peak * 1e12):.1%}" if peak else "-"
        vs = f"{base / (total / len(r)):.3f}x" if base else "-"
        lines.append(f"| `{w}` | {total / len(r) / k:.4f} | {vs} | {mfu} | {r[-1][3]} | {_largest(x[1] for x in r)} | "
                     f"{_largest(x[2] for x in r)} | {r[-1][4]} |")
    lines += [f"| `{w}` | absent: {why} | | | | | | |" for w, why in absent.items()]
    emit_report("\n".join(lines) + "\n", f"micro_batches_{args.workload}_{k}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
