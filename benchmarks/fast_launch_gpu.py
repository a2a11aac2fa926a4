"""What :func:`dtree.ops.fast_launch.fast_launch` saves, in one process:

* per launch: the host time of one small Triton launch (dtree's RMSNorm forward on one
  row) through ``kernel[grid]`` and through ``fast_launch``, 3,000 launches each, the GPU
  synced before and after (the kernel runs ~3 us, so the loop is host-bound);
* per step: dtree's default step with ``fast_launch`` on and off, timed INTERLEAVED
  (one step of each per round on the round's fresh forest, the order alternating), on
  grpo case 1, the 64k agentic tree with the default plan, and the 64k tree in
  4,096-token calls with nothing checkpointed (the host-bound plan of session F): wall,
  main-thread CPU and process CPU medians, and the paired ratio of wall times.

    python benchmarks/fast_launch_gpu.py --out DIR          # H100, qwen2.5-1.5b, bf16 (~3 min)
    python benchmarks/fast_launch_gpu.py --smoke --out DIR  # CPU, tiny model (plumbing: the launch part is skipped)

Writes DIR/fast_launch_gpu.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from dtree.bench.measure import host_timed_step, script_model, sync_device  # noqa: E402
from dtree.bench.report import environment  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.ops import fast_launch as fl  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

CASES = {  # name: (workload, its parameters, runtime options)
    "case1": ("grpo", {"num_prompts": 1, "prompt_len": 2048, "group_size": 8, "answer_len": 512}, {}),
    "agentic64k": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536}, {}),
    "agentic64k_4096_calls": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536},
                              {"group_tokens": 4096, "checkpoint_layers": 0}),
}
SMOKE = {
    "case1": ("grpo", {"num_prompts": 1, "prompt_len": 64, "group_size": 4, "answer_len": 16}, {}),
    "agentic_small_calls": ("agentic", {"num_trees": 1, "system_prompt_len": 64, "trajectories": 2,
                                        "turn_len": (4, 40), "target_unique_tokens": 400}, {"group_tokens": 128}),
}
ROUNDS = {"case1": 12, "agentic64k": 4, "agentic64k_4096_calls": 4}


def launch_host_us(launches: int = 3000) -> dict:
    """Host microseconds per launch of one small Triton kernel, both ways."""
    from dtree.ops.rms_norm import triton_kernels as rt

    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    w, y, r = torch.ones(1536, device="cuda", dtype=torch.bfloat16), torch.empty_like(x), torch.empty(1, device="cuda")
    args = (x, w, y, r, x.stride(0), y.stride(0), 1536, 1e-6)
    meta = {"BLOCK_N": 2048, "num_warps": rt._warps(2048)}
    out = {}
    for name, launch in (("triton", lambda: rt._rms_norm_fwd_kernel[(1,)](*args, **meta)),
                         ("fast_launch", lambda: fl.fast_launch(rt._rms_norm_fwd_kernel, (1,), *args, **meta))):
        for _ in range(50):
            launch()
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(launches // 5):
                launch()
            torch.cuda.synchronize()
            samples.append(1e6 * (time.perf_counter() - t0) / (launches // 5))
        out[name] = statistics.median(samples)
    return out


def interleaved(model, device, spec, case, rounds: int) -> dict:
    """``rounds`` rounds of one step with fast_launch on and one with it off, on one fresh forest each."""
    kind, params, options = case
    rt = dtree.TreeRuntime(model, **options)
    loss = ppo_clip(clip_eps=0.2, reduction="token_mean")
    forests = [make_workload(kind, seed=i, vocab_size=spec.vocab_size, **params) for i in range(rounds + 2)]
    samples: dict[bool, list[dict]] = {True: [], False: []}
    for i, forest in enumerate(forests):
        order = (True, False) if i % 2 == 0 else (False, True)
        for enabled in order:
            fl._ENABLED = enabled
            step = host_timed_step(rt, forest, loss, model, device)
            if i >= 2:  # two warm-up rounds: compiles, the memory probe
                samples[enabled].append(step)
    fl._ENABLED = True
    ratios = [off["wall"] / on["wall"] for on, off in zip(samples[True], samples[False])]

    def med(enabled: bool, key: str) -> float:
        return statistics.median(s[key] for s in samples[enabled])

    return {"calls": samples[True][-1]["calls"], "rounds": rounds, "options": options,
            "plan": rt.memory_plan.describe() if rt.memory_plan else None,
            **{f"{k}_{'on' if e else 'off'}": med(e, k) for e in (True, False) for k in ("wall", "main_cpu", "process_cpu")},
            "paired_speedup_median": statistics.median(ratios), "paired_speedups": ratios}


def report(result: dict) -> str:
    lines = ["# fast_launch: Triton launches without Triton's per-call binding", "",
             f"{result['environment']}", ""]
    if result.get("launch_us"):
        lu = result["launch_us"]
        lines += ["## One small launch, host time", "", "| path | us per launch |", "|---|---|",
                  *(f"| {k} | {v:.1f} |" for k, v in lu.items()), ""]
    lines += ["## Steps, interleaved (fresh forest per round; on = fast_launch, off = kernel[grid])", "",
              "| case | calls | rounds | wall on (s) | wall off (s) | paired speedup | main CPU on / off (s) | "
              "process CPU on / off (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["steps"].items():
        lines.append(f"| {name} | {r['calls']} | {r['rounds']} | {r['wall_on']:.4f} | {r['wall_off']:.4f} | "
                     f"{r['paired_speedup_median']:.3f}x | {r['main_cpu_on']:.3f} / {r['main_cpu_off']:.3f} | "
                     f"{r['process_cpu_on']:.3f} / {r['process_cpu_off']:.3f} |")
    lines += ["", "Plans: " + "; ".join(f"{n}: {r['plan']}" for n, r in result["steps"].items()), ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cases", default=None, help="comma-separated subset of the cases")
    args = p.parse_args()
    model, device = script_model(args.smoke)
    spec = adapt(model).dtree_spec()
    cases = SMOKE if args.smoke or device.type != "cuda" else CASES
    chosen = args.cases.split(",") if args.cases else list(cases)
    env = environment(device)
    result = {"environment": "; ".join(f"{k}: {v}" for k, v in env.items()),
              "launch_us": launch_host_us() if device.type == "cuda" else None, "steps": {}}
    os.makedirs(args.out, exist_ok=True)
    for name in chosen:
        t0 = time.perf_counter()
        result["steps"][name] = interleaved(model, device, spec, cases[name], 2 if args.smoke else ROUNDS.get(name, 4))
        print(f"{name}: {result['steps'][name]['paired_speedup_median']:.3f}x in {time.perf_counter() - t0:.0f} s",
              flush=True)
        with open(os.path.join(args.out, "fast_launch_gpu.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(args.out, "fast_launch_gpu.md"), "w") as f:
            f.write(report(result))
    sync_device(device)
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
