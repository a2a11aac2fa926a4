"""Where the host time of a one-call step goes, with the KV-stack extension and without (issue 21).

`benchmarks/csrc_gpu.py` measured GRPO case 1 (one model call, host-bound: ~0.25 s of
wall time over ~0.15 s of GPU time) 1.6-4.5% slower with the extension in four H100 runs,
at equal GPU time. This script separates the host's part. Per step it reads the wall time
and the main thread's CPU time (``time.thread_time``). Steps alternate between the two
configurations after a warm-up. One step of each is then profiled on the host, and the
script lists the ops whose self CPU time differs most.

    python benchmarks/extension_host_cost.py [--steps 12] [--smoke]

Run it after the extension is built (``bash benchmarks/csrc_gpu.sh`` builds it). It prints
Markdown, also written to ``$OUT/extension_host_cost.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from dtree.bench.layers import apply_layers  # noqa: E402
from dtree.bench.measure import emit_report, host_timed_step, script_model, sync_device  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.ops.stack_ops import interface as stack_ops  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

CASE1 = {"num_prompts": 1, "prompt_len": 2048, "group_size": 8, "answer_len": 512}
SMOKE = {"num_prompts": 1, "prompt_len": 64, "group_size": 4, "answer_len": 16}


def _scope(ext: bool):
    return contextlib.nullcontext() if ext else stack_ops.extension_disabled()


def host_ops(rt, model, forest, loss, device) -> dict[str, tuple[int, float]]:
    """Op name -> (calls, self CPU microseconds) over one profiled step."""
    model.zero_grad(set_to_none=True)
    sync_device(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rt.forward_backward(forest, loss)
        sync_device(device)
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        out[e.key][0] += e.count
        out[e.key][1] += e.self_cpu_time_total
    return {k: (v[0], v[1]) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per configuration, alternating")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model (checks the plumbing)")
    args = p.parse_args()
    model, device = script_model(args.smoke)
    layers = apply_layers(model, "auto", device)
    spec = adapt(model).dtree_spec()
    forest = make_workload("grpo", vocab_size=spec.vocab_size, **(SMOKE if args.smoke else CASE1))
    loss = ppo_clip(clip_eps=0.2, reduction="token_mean")
    configs = {"extension": True, "torch ops": False}
    runtimes = {name: dtree.TreeRuntime(model) for name in configs}
    for name, ext in configs.items():
        with _scope(ext):
            for _ in range(3):
                host_timed_step(runtimes[name], forest, loss, model, device)
    times: dict[str, list] = {name: [] for name in configs}
    for i in range(args.steps):
        for name, ext in (list(configs.items()) if i % 2 == 0 else list(configs.items())[::-1]):
            with _scope(ext):
                times[name].append(host_timed_step(runtimes[name], forest, loss, model, device))
    ops = {}
    for name, ext in configs.items():
        with _scope(ext):
            ops[name] = host_ops(runtimes[name], model, forest, loss, device)
    lines = [
        f"# Host time of a one-call step, extension vs torch stack ops ({device}, {layers})", "",
        f"extension: {stack_ops.extension_error() or 'loaded'}; GRPO case 1, {forest.num_unique_tokens} unique tokens; "
        f"{args.steps} alternating steps each after 3 warm-up steps", "",
        "| stack ops | wall median (s) | wall min (s) | main-thread CPU median (s) | CPU min (s) |",
        "|---|---|---|---|---|",
    ]
    for name in configs:
        wall, cpu = [t["wall"] for t in times[name]], [t["main_cpu"] for t in times[name]]
        lines.append(f"| {name} | {statistics.median(wall):.4f} | {min(wall):.4f} | {statistics.median(cpu):.4f} | "
                     f"{min(cpu):.4f} |")
    a, b = ops["extension"], ops["torch ops"]
    keys = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0, 0.0))[1] - b.get(k, (0, 0.0))[1]))
    lines += ["", "Ops whose self CPU time differs most in one profiled step (extension - torch ops):", "",
              "| op | calls (ext / torch) | self CPU ms (ext / torch) | difference ms |", "|---|---|---|---|"]
    for k in keys[:20]:
        (ca, ta), (cb, tb) = a.get(k, (0, 0.0)), b.get(k, (0, 0.0))
        lines.append(f"| `{k[:80]}` | {ca} / {cb} | {ta / 1e3:.2f} / {tb / 1e3:.2f} | {(ta - tb) / 1e3:+.2f} |")
    total = (sum(v[1] for v in a.values()) / 1e3, sum(v[1] for v in b.values()) / 1e3)
    lines += ["", f"Self CPU time over all ops: extension {total[0]:.1f} ms, torch ops {total[1]:.1f} ms", ""]
    emit_report("\n".join(lines), "extension_host_cost.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
