"""Where a step's host time goes, on the GPU machine (issue 17: short calls are host-bound).

GRPO case 1 runs as one model call of 6,144 tokens: ~0.23 s of wall time over ~0.15 s of
GPU kernel time on the H100, and the 64k agentic tree slows by a third when its calls
shrink to 4,096 tokens. This script reads, for dtree's default runtime on fresh forests:

* per step: wall time, the main thread's CPU time (``time.thread_time``: the forward,
  planning, the loss) and the process's (``time.process_time``: also the autograd
  engine's device thread, which runs the backward);
* cProfile of the main thread over the profiled steps: the functions with the most own
  time and the most cumulative time, per step;
* one step under torch.profiler: kernel time, launches, and how much of the step the
  GPU had no kernel running (the part host work is not hidden behind).

    python benchmarks/host_profile.py                          # H100: case 1, ~1 min
    python benchmarks/host_profile.py --workload agentic64k --opt group_tokens=4096
    python benchmarks/host_profile.py --smoke                  # CPU, tiny model (plumbing)

Prints Markdown, also written to ``$OUT/host_profile_<workload>.md`` when OUT is set.
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from dtree.bench.configs import parse_assignments  # noqa: E402
from dtree.bench.measure import emit_report, host_timed_step, script_model, sync_device  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

WORKLOADS = {
    "case1": ("grpo", {"num_prompts": 1, "prompt_len": 2048, "group_size": 8, "answer_len": 512}),
    "agentic64k": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536}),
    "agentic256k": ("agentic", {"num_trees": 1, "target_unique_tokens": 262144}),
}
SMOKE = {
    "case1": ("grpo", {"num_prompts": 1, "prompt_len": 64, "group_size": 4, "answer_len": 16}),
    "agentic64k": ("agentic", {"num_trees": 1, "system_prompt_len": 64, "trajectories": 2, "turn_len": (4, 40),
                               "target_unique_tokens": 400}),
    "agentic256k": ("agentic", {"num_trees": 1, "system_prompt_len": 64, "trajectories": 3, "turn_len": (4, 40),
                                "target_unique_tokens": 800}),
}


STEP_LABEL = "dtree step"


def script_setup(args, num_forests: int):
    """What a host-time script runs (``args``: its ``--smoke``, ``--workload``, ``--opt``):
    (model, device, runtime, loss, ``num_forests`` fresh forests, workload kind, runtime
    options), after three warm-up steps on the first forests (Triton compiles, the memory
    probe)."""
    model, device, forest_of, options, loss = script_parts(args.smoke, args.workload, args.opt)
    rt = dtree.TreeRuntime(model, **options)
    forests = [forest_of(i) for i in range(num_forests)]
    for forest in forests[:3]:
        host_timed_step(rt, forest, loss, model, device)
    kind = (SMOKE if args.smoke or device.type != "cuda" else WORKLOADS)[args.workload][0]
    return model, device, rt, loss, forests, kind, options


def script_parts(smoke: bool, workload: str, opt: list[str]):
    """(model, device, ``forest_of(seed)``, the runtime options ``opt`` give, the PPO loss) of a
    benchmark script: qwen2.5-1.5b on CUDA (tiny on CPU or with ``smoke``), ``workload``'s
    fresh forests (:data:`WORKLOADS`; :data:`SMOKE` off CUDA)."""
    model, device = script_model(smoke)
    spec = adapt(model).dtree_spec()
    kind, params = (SMOKE if smoke or device.type != "cuda" else WORKLOADS)[workload]

    def forest_of(seed: int):
        return make_workload(kind, seed=seed, vocab_size=spec.vocab_size, **params)

    return model, device, forest_of, parse_assignments(opt, "--opt"), ppo_clip(clip_eps=0.2, reduction="token_mean")


def add_setup_arguments(p: argparse.ArgumentParser, default_workload: str = "case1") -> None:
    """The options :func:`script_setup` reads: ``--workload``, ``--opt`` (repeatable) and ``--smoke``."""
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=default_workload)
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="a RuntimeConfig option")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a small forest")


def profiled_step(rt, model, forest, loss, device, **profile_options):
    """(the profiler, the step's output) of one step under torch.profiler: CPU ops, and the
    kernels where there is a GPU; the gradients reset and the device idle before it starts.
    ``profile_options``: torch.profiler.profile's own (``with_stack=True``, ...)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.zero_grad(set_to_none=True)
    sync_device(device)
    with profile(activities=activities, **profile_options) as prof:
        out = rt.forward_backward(forest, loss)
        sync_device(device)
    return prof, out


def kernel_busy(rt, model, forest, loss, device) -> dict:
    """One profiled step: kernel time, launches (``memsets`` of them: the CUDA memsets, which cuBLAS issues
    before some of its GEMMs), and the step's time with no kernel running."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if device.type != "cuda":
        return {}
    model.zero_grad(set_to_none=True)
    sync_device(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        w0 = time.perf_counter()
        with record_function(STEP_LABEL):  # a host event where the step starts
            rt.forward_backward(forest, loss)
        sync_device(device)
        wall = time.perf_counter() - w0
    events = prof.events()
    kernels = [e for e in events  # not the step's own GPU-side annotation
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
               and e.name != STEP_LABEL]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    host = [e.time_range.start for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of the kernels' intervals (microseconds)
        if b > end:
            busy += b - max(a, end)
            end = b
    first, last = (spans[0][0], max(b for _, b in spans)) if spans else (0.0, 0.0)
    return {"wall_s": wall, "launches": len(spans), "memsets": sum(e.name.startswith("Memset") for e in kernels),
            "kernel_union_s": busy / 1e6,
            "kernel_sum_s": sum(b - a for a, b in spans) / 1e6, "first_to_last_kernel_s": (last - first) / 1e6,
            "host_before_first_kernel_s": (first - min(host)) / 1e6 if host and spans else None}


def profile_rows(stats: pstats.Stats, key: str, steps: int, top: int) -> list[str]:
    """The ``top`` functions by ``key`` (``tottime`` or ``cumtime``), per step."""
    index = {"tottime": 2, "cumtime": 3}[key]
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][index], reverse=True)[:top]
    lines = ["| function | where | calls per step | own ms per step | cumulative ms per step |", "|---|---|---|---|---|"]
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in entries:
        where = path.split("site-packages/")[-1].split("/work/")[-1].split("dtree/", 1)[-1] if "/" in path else path
        lines.append(f"| `{name}` | {where}:{line} | {ncalls / steps:.0f} | {1e3 * tottime / steps:.2f} | "
                     f"{1e3 * cumtime / steps:.2f} |")
    return lines


def callers(profiler: cProfile.Profile, name: str) -> list[str]:
    """Who calls the functions matching ``name`` (pstats' regex), with their counts."""
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).print_callers(name)
    text = stream.getvalue()
    body = text[text.find("was called by..."):] if "was called by..." in text else text
    return [f"### callers of `{name}`", "", "```", body.strip()[:6000], "```", ""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--steps", type=int, default=8, help="timed steps (fresh forests), then as many profiled")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--callers", action="append", default=None, metavar="NAME",
                   help="list who calls these functions (pstats regex; default: module and parameter walks, "
                        "the allocator's statistics)")
    p.add_argument("--tag", default="", help="appended to the report's file name")
    p.add_argument("--backward-here", action="store_true",
                   help="run the profiled steps' backward on the calling thread (autograd multithreading off), "
                        "so that the profile shows the backward's host time too")
    args = p.parse_args()
    model, device, rt, loss, forests, kind, options = script_setup(args, 2 * args.steps + 3)
    timed = [host_timed_step(rt, f, loss, model, device) for f in forests[3:3 + args.steps]]
    profiler = cProfile.Profile()
    for forest in forests[3 + args.steps:]:
        model.zero_grad(set_to_none=True)
        sync_device(device)
        with torch.autograd.set_multithreading_enabled(not args.backward_here):
            profiler.enable()
            rt.forward_backward(forest, loss)
            sync_device(device)
            profiler.disable()
    busy = kernel_busy(rt, model, forests[-1], loss, device)
    stats = pstats.Stats(profiler)

    def med(key: str) -> float:
        return statistics.median(s[key] for s in timed)

    lines = [
        f"# Host time of a dtree step: {args.workload} ({kind}), {device.type}",
        "",
        f"torch {torch.__version__}; {sum(f.num_unique_tokens for f in forests) // len(forests)} unique tokens per "
        f"forest on average; runtime options {options or 'default'}; "
        f"profiled backward on {'the calling thread' if args.backward_here else 'autograd device threads'}; "
        f"DTREE_FAST_LAUNCH={os.environ.get('DTREE_FAST_LAUNCH', '1')}; plan: {rt.memory_plan.describe() if rt.memory_plan else '-'}",
        "",
        "| steps | model calls | wall median (s) | main-thread CPU (s) | process CPU (s) |",
        "|---|---|---|---|---|",
        f"| {len(timed)} | {timed[-1]['calls']} | {med('wall'):.4f} | {med('main_cpu'):.4f} | {med('process_cpu'):.4f} |",
        "",
    ]
    if busy:
        idle = busy["wall_s"] - busy["kernel_union_s"]
        lines += [
            "One profiled step: "
            f"{busy['wall_s']:.4f} s wall, {busy['launches']} kernels, {busy['kernel_union_s']:.4f} s with a kernel "
            f"running ({busy['kernel_sum_s']:.4f} s summed), the first kernel {busy['host_before_first_kernel_s']:.4f} s "
            f"after the step started, first to last kernel {busy['first_to_last_kernel_s']:.4f} s; "
            f"**no kernel running for {idle:.4f} s ({100 * idle / busy['wall_s']:.0f}% of the step)**.",
            "",
        ]
    lines += [f"## Main thread, by own time ({args.steps} profiled steps)", "",
              *profile_rows(stats, "tottime", args.steps, args.top), "",
              "## Main thread, by cumulative time", "", *profile_rows(stats, "cumtime", args.steps, args.top), "",
              f"## Callers ({args.steps} profiled steps)", ""]
    for name in args.callers or [r"\(named_modules\)", r"\(parameters\)", r"\(memory_stats\)"]:
        lines += callers(profiler, name)
    emit_report("\n".join(lines), f"host_profile_{args.workload}{'_' + args.tag if args.tag else ''}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
