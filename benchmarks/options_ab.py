"""dtree runtime option sets against each other, interleaved on fresh forests, in one process.

``dtree bench`` times its configurations one after the other, and the first dtree configuration
to meet each fresh forest pays that forest's once-per-shape costs (flash-attn-4's kernels for
the forest's call shapes: 0.3-0.5 s a step on the 64k agentic tree on an H200). Between two
dtree settings that bias is larger than a change worth a few percent (session AC: `low` with
and without its attention outputs kept, one after the other, came out 4% apart the wrong way).

Here every round takes a fresh forest, runs one untimed step of every arm on it, then one timed
step of every arm, in an order that rotates. (Until session AF one untimed step of one arm warmed
a forest: an arm with other call sizes than that arm's paid its own shapes' costs in its timed step
whenever it came first among the arms sharing them; session AF's `low` arms show it, 2.3-3.0 s
against 1.9-2.0.) Reported per arm: the median wall
time, the median of the paired ratios (the arm's wall time over the first arm's on the same
forest: above 1, the first arm is faster), the most allocated in any timed step, and the plan.

    python benchmarks/options_ab.py --workload agentic64k --arm memory=low --arm memory=low,keep_attention_outputs=false
    python benchmarks/options_ab.py --smoke --arm memory=low --arm memory=low,group_tokens=64   # CPU, tiny model
    python benchmarks/options_ab.py --arm blas=cublas --arm blas=cublaslt --kernels              # a process setting
    python benchmarks/options_ab.py --arm memory=12.5 --arm memory=12.5,packing=frontier_order --kernels

An arm's ``blas=cublas|cublaslt`` is not a runtime option but the process's BLAS library for its
steps (``torch.backends.cuda.preferred_blas_library``, set before each of them; CUDA only); an arm
that names none runs the process's own. Likewise ``packing=frontier_order|first_fit_decreasing|fewest``:
how the schedule packs sibling units into calls (``dtree.plan.unit_bins.PACK``; ``fewest`` is dtree's).
And ``head=keep|recompute``: whether the LM head keeps a one-chunk call's logits for its backward
where the walk says the backward follows (``keep``, dtree's) or recomputes them there as before
session AP (``recompute``: every ``keep_logits`` the loss asks for turned off).
``--kernels``: after the rounds, one profiled step per arm on a fresh forest: its launches, the
CUDA memsets among them, its kernels' busy time and the host time before its first kernel.

Writes ``$OUT/options_ab_<workload>[_<tag>].md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree
from benchmarks.host_profile import add_setup_arguments, kernel_busy, script_parts
from dtree.bench.configs import parse_assignments
from dtree.bench.measure import emit_report, host_timed_step
from dtree.bench.report import environment
from dtree.losses import token_loss
from dtree.plan import unit_bins

GIB = 2.0**30
PLAN_KEYS = ("group_tokens", "checkpoint_layers", "path_checkpoint_layers", "keep_attention_outputs",
             "offload_checkpoints", "logprob_chunk", "kept_head_rows", "predicted_total_gib")


PROCESS_SETTINGS = ("blas", "packing", "head")  # arm keys that set the process up for the arm's steps (not runtime options)
HEADS = ("keep", "recompute")
_DEFAULTS: dict = {}  # the process's own settings, for arms that name none


def parse_arm(text: str) -> dict:
    """``"memory=low,keep_attention_outputs=false"`` -> the runtime options (and :data:`PROCESS_SETTINGS`)."""
    return parse_assignments([item for item in text.split(",") if item.strip()], "--arm")


def runtime_options(arm: dict) -> dict:
    return {k: v for k, v in arm.items() if k not in PROCESS_SETTINGS}


def enter_arm(arm: dict, device: torch.device) -> None:
    """Set the process up for one of ``arm``'s steps: its BLAS library (CUDA only) and how sibling
    units share calls (``packing=``, a name of ``unit_bins.PACKERS``). An arm that names none runs
    the process's own (not the last arm's: session AE's arms without ``blas=`` ran on whichever
    library the arm before had set)."""
    _DEFAULTS.setdefault("packing", unit_bins.PACK)
    packing = arm.get("packing")
    if packing is not None and packing not in unit_bins.PACKERS:
        raise SystemExit(f"--arm packing={packing}: one of {sorted(unit_bins.PACKERS)}")
    unit_bins.PACK = _DEFAULTS["packing"] if packing is None else unit_bins.PACKERS[packing]
    _DEFAULTS.setdefault("head", token_loss.token_logprobs)
    head = arm.get("head", "keep")
    if head not in HEADS:
        raise SystemExit(f"--arm head={head}: one of {HEADS}")
    token_loss.token_logprobs = _DEFAULTS["head"] if head == "keep" else _recomputing(_DEFAULTS["head"])
    if device.type == "cuda":
        _DEFAULTS.setdefault("blas", torch.backends.cuda.preferred_blas_library())
        torch.backends.cuda.preferred_blas_library(arm.get("blas", _DEFAULTS["blas"]))


def _recomputing(token_logprobs):
    """``token_logprobs`` that never keeps the head's logits (``head=recompute``)."""
    def recomputing(*args, **kwargs):
        return token_logprobs(*args, **{**kwargs, "keep_logits": False})

    return recomputing


def timed(runtime, forest, loss, model, device, empty_cache: bool = False) -> dict:
    """One step (:func:`host_timed_step`), the most it allocated and the most the allocator held
    (CUDA; 0 elsewhere). ``empty_cache``: the allocator's cache emptied first, so the held peak is
    the step's own (not the arm before it's), and the step maps its memory afresh."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        if empty_cache:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step = host_timed_step(runtime, forest, loss, model, device)
    step["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB if on_cuda else 0.0
    step["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB if on_cuda else 0.0
    return step


def interleaved(args) -> dict:
    """``args.rounds`` rounds after ``args.warmup`` untimed ones (compiles, the memory probes)."""
    model, device, forest_of, base, loss = script_parts(args.smoke, args.workload, args.opt)
    arms = [{**base, **parse_arm(a)} for a in args.arm]
    runtimes = [dtree.TreeRuntime(model, **runtime_options(options)) for options in arms]
    steps: list[list[dict]] = [[] for _ in arms]
    for i in range(args.warmup + args.rounds):
        forest = forest_of(i)
        order = [(i + j) % len(arms) for j in range(len(arms))]
        for a in order:  # this forest's once-per-shape costs, for every arm's call sizes
            enter_arm(arms[a], device)
            timed(runtimes[a], forest, loss, model, device)
        results = {}
        for a in order:
            enter_arm(arms[a], device)
            results[a] = timed(runtimes[a], forest, loss, model, device, args.empty_cache)
        if i >= args.warmup:
            for a in range(len(arms)):
                steps[a].append(results[a])
        walls = " ".join(f"{results[a]['wall']:.3f}" for a in range(len(arms)))
        print(f"round {i + 1}/{args.warmup + args.rounds} (forest seed {i}): {walls} s", flush=True)
    rows = []
    for a, options in enumerate(arms):
        plan = runtimes[a].memory_plan.describe() if runtimes[a].memory_plan else {}
        rows.append({
            "options": options, "walls": [s["wall"] for s in steps[a]],
            "wall": statistics.median(s["wall"] for s in steps[a]),
            "ratio": statistics.median(s["wall"] / f["wall"] for s, f in zip(steps[a], steps[0])),
            "peak_gib": max(s["peak_gib"] for s in steps[a]), "reserved_gib": max(s["reserved_gib"] for s in steps[a]),
            "plan": {"calls": "/".join(str(s["calls"]) for s in steps[a]),
                     "attention": "/".join(sorted({str(s["attention"]) for s in steps[a]})),
                     "rerun_chunk_rows": "/".join(sorted({str(s.get("rerun_chunk_rows")) for s in steps[a]})),
                     **{k: plan.get(k) for k in PLAN_KEYS}},
        })
    if args.kernels:
        forest = forest_of(args.warmup + args.rounds)
        enter_arm(arms[0], device)
        timed(runtimes[0], forest, loss, model, device)  # the forest's once-per-shape costs
        for a, row in enumerate(rows):
            enter_arm(arms[a], device)
            row["kernels"] = kernel_busy(runtimes[a], model, forest, loss, device)
    return {"rows": rows, "device": device}


def report(args, result: dict) -> str:
    lines = [f"# dtree option sets, interleaved on fresh forests: {args.workload}", "",
             "; ".join(f"{k}: {v}" for k, v in environment(result["device"]).items()), "",
             (f"{args.rounds} rounds after {args.warmup} warm-up ones; each round: a fresh forest, one untimed step "
              "of every arm on it, then one timed step per arm in a rotating order. ratio = the arm's wall time "
              "over the first arm's on the same forest (median; above 1: the first arm is faster)."), "",
             "peak held = the most the caching allocator reserved in a timed step"
             + (" (its cache emptied before each)." if args.empty_cache else
                " (its cache not emptied between steps: it carries the arms before; --empty-cache separates"
                " them)."), "",
             ("| arm | options | wall median (s) | ratio to arm 1 | peak alloc (GiB) | peak held (GiB) | steps (s) "
              "| plan (last step) |"),
             "|---|---|---|---|---|---|---|---|"]
    for a, row in enumerate(result["rows"]):
        walls = ", ".join(f"{w:.3f}" for w in row["walls"])
        plan = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row["plan"].items())
        lines.append(f"| {a + 1} | `{row['options']}` | {row['wall']:.3f} | {row['ratio']:.3f} | "
                     f"{row['peak_gib']:.2f} | {row['reserved_gib']:.2f} | {walls} | {plan} |")
    counted = [(a, row["kernels"]) for a, row in enumerate(result["rows"]) if row.get("kernels")]
    if counted:
        lines += ["", "One profiled step per arm on a fresh forest (CUDA activity; the profiler slows the host):", "",
                  "| arm | launches | memsets | kernels busy (s) | host before the first kernel (s) | wall (s) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {a + 1} | {k['launches']} | {k['memsets']} | {k['kernel_union_s']:.3f} | "
                  f"{k['host_before_first_kernel_s'] or 0:.3f} | {k['wall_s']:.3f} |" for a, k in counted]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_setup_arguments(p, default_workload="agentic64k")
    p.add_argument("--arm", action="append", required=True, help="runtime options KEY=VALUE[,KEY=VALUE...]")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tag", default="", help="appended to the report's file name")
    p.add_argument("--empty-cache", action="store_true",
                   help="empty the allocator's cache before every timed step (each step's peak held is its own)")
    p.add_argument("--kernels", action="store_true", help="then one profiled step per arm: launches, memsets, busy time")
    args = p.parse_args()
    if len(args.arm) < 2:
        p.error("give two or more --arm")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    emit_report(report(args, interleaved(args)), f"options_ab_{args.workload}{'_' + args.tag if args.tag else ''}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
