"""What issue 17's host-time changes save, each against the default, in one process:

* ``fast_launch`` (``dtree/ops/fast_launch.py``): dtree's Triton kernels launched through
  the compiled kernel kept per argument class instead of ``kernel[grid]``;
* dtree's rotary kernel during the step (``dtree/ops/rotary``, swapped in by the lean
  scope) instead of HF's ``apply_rotary_pos_emb``;
* the flash-attn backend's launch replay (``dtree/ops/stack_attention/flash4_launch_replay.py``:
  a model call's later layers launch flash-attn-4's recorded kernels) instead of its
  interface at every call (``no_flash4_replay``; the same as the default where flash-attn-4
  is absent);

* the launch keys read by code generated per call site (``fast_launch._reader``) instead of
  the reference binding (``reference_keys``: ``_KernelTable.read_reference`` at every launch);

and one candidate, not a default: Python's garbage collector paused for the step
(``gc_paused``: does a collection inside a host-bound step explain its outliers?).

Parts:

* per launch: host microseconds of one small Triton launch (dtree's RMSNorm forward on
  one row) both ways, 3,000 launches each, the GPU synced before and after;
* per step: the default and each change turned off, timed INTERLEAVED: every round runs
  one step of each variant on the round's fresh forest, in an order that rotates; grpo
  case 1, the 64k agentic tree with the default plan, at the mask's memory
  (``memory=14.5`` with HF's layers, ``memory=12.5`` with the lean ones) and ``memory="low"``, and the 64k tree in 4,096-token calls with
  nothing checkpointed (the host-bound plan of session F). Reported: median
  wall, main-thread and process CPU, and the median of the paired ratios (variant wall /
  default wall, so > 1 means the change helps).

    python benchmarks/host_cost_ab.py --out DIR          # H100, qwen2.5-1.5b, bf16 (~4 min)
    python benchmarks/host_cost_ab.py --smoke --out DIR  # CPU, tiny model (plumbing: no launch part)

Writes DIR/host_cost_ab.md and .json after every case.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
from dtree.models import adapt, lean_layers  # noqa: E402
from dtree.ops import fast_launch as fl  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

CASES = {  # name: (workload, its parameters, runtime options)
    "case1": ("grpo", {"num_prompts": 1, "prompt_len": 2048, "group_size": 8, "answer_len": 512}, {}),
    "agentic64k": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536}, {}),
    "agentic64k_14.5GiB": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536}, {"memory": 14.5}),
    "agentic64k_12.5GiB": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536}, {"memory": 12.5}),
    "agentic64k_low": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536}, {"memory": "low"}),
    "agentic64k_4096_calls": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536},
                              {"group_tokens": 4096, "checkpoint_layers": 0}),
}
SMOKE = {
    "case1": ("grpo", {"num_prompts": 1, "prompt_len": 64, "group_size": 4, "answer_len": 16}, {}),
    "agentic_small_calls": ("agentic", {"num_trees": 1, "system_prompt_len": 64, "trajectories": 2,
                                        "turn_len": (4, 40), "target_unique_tokens": 400}, {"group_tokens": 128}),
}
ROUNDS = {"case1": 20}  # 4 elsewhere
VARIANTS = ("default", "no_flash4_replay", "no_fast_launch", "hf_rotary", "reference_keys", "gc_paused")


def _flash4_replay():
    """The flash-attn backend's launch replay, or None where flash-attn-4 is not installed."""
    try:
        from dtree.ops.stack_attention.flash4_masked_call import _launcher

        return _launcher()
    except ImportError:
        return None


@contextlib.contextmanager
def variant(name: str):
    """The default, one change turned off, or the candidate, for the block."""
    saved = fl._ENABLED, lean_layers._rotary_module, fl._KernelTable.read
    replay = _flash4_replay() if name == "no_flash4_replay" else None
    replaying = replay is not None and replay.enabled
    if name == "gc_paused":
        gc.disable()
    if replay is not None:
        replay.enabled = False
        replay.held.clear()
    if name == "no_fast_launch":
        fl._ENABLED = False
    elif name == "hf_rotary":
        lean_layers._rotary_module = lambda attention: None
    elif name == "reference_keys":
        fl._KernelTable.read = fl._KernelTable.read_reference
    try:
        yield
    finally:
        fl._ENABLED, lean_layers._rotary_module, fl._KernelTable.read = saved
        if replay is not None:
            replay.enabled = replaying
        gc.enable()


def launch_host_us(launches: int = 3000) -> dict:
    """Host microseconds per launch of one small Triton kernel: ``kernel[grid]``, ``fast_launch``,
    and ``fast_launch`` keyed by the reference binding."""
    from dtree.ops.rms_norm import triton_kernels as rt

    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    w, y, r = torch.ones(1536, device="cuda", dtype=torch.bfloat16), torch.empty_like(x), torch.empty(1, device="cuda")
    args = (x, w, y, r, x.stride(0), y.stride(0), 1536, 1e-6)
    meta = {"BLOCK_N": 2048, "num_warps": rt._warps(2048)}
    out = {}

    def fast():
        fl.fast_launch(rt._rms_norm_fwd_kernel, (1,), *args, **meta)

    for name, launch in (("kernel[grid]", lambda: rt._rms_norm_fwd_kernel[(1,)](*args, **meta)),
                         ("fast_launch", fast), ("fast_launch, reference keys", fast)):
        ways = contextlib.nullcontext() if name != "fast_launch, reference keys" else variant("reference_keys")
        with ways:
            out[name] = _per_launch_us(launch, launches)
    return out


def _per_launch_us(launch, launches: int) -> float:
    """Median host microseconds of ``launch()`` over five batches (after 50 warm-up calls)."""
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
    return statistics.median(samples)


def interleaved(model, device, spec, case, rounds: int, variants: tuple[str, ...] = VARIANTS) -> dict:
    """``rounds`` rounds (after two warm-up rounds) of one step per variant on one fresh forest each."""
    kind, params, options = case
    rt = dtree.TreeRuntime(model, **options)
    loss = ppo_clip(clip_eps=0.2, reduction="token_mean")
    forests = [make_workload(kind, seed=i, vocab_size=spec.vocab_size, **params) for i in range(rounds + 2)]
    samples: dict[str, list[dict]] = {v: [] for v in variants}
    for i, forest in enumerate(forests):
        for j in range(len(variants)):
            name = variants[(i + j) % len(variants)]
            with variant(name):
                step = host_timed_step(rt, forest, loss, model, device)
            if i >= 2:  # warm-up rounds: compiles, the memory probe
                samples[name].append(step)
    out = {"calls": samples["default"][-1]["calls"], "rounds": rounds, "options": options,
           "plan": rt.memory_plan.describe() if rt.memory_plan else None, "variants": {}}
    for name, steps in samples.items():
        ratios = [s["wall"] / d["wall"] for s, d in zip(steps, samples["default"])]
        out["variants"][name] = {
            **{k: statistics.median(s[k] for s in steps) for k in ("wall", "main_cpu", "process_cpu")},
            "paired_ratio_median": statistics.median(ratios), "paired_ratios": ratios,
        }
    return out


def report(result: dict) -> str:
    lines = ["# Host-time changes of issue 17, each turned off against the default", "", result["environment"], ""]
    if result.get("launch_us"):
        lines += ["## One small Triton launch, host time", "", "| path | us per launch |", "|---|---|",
                  *(f"| {k} | {v:.1f} |" for k, v in result["launch_us"].items()), ""]
    lines += ["## Steps, interleaved (a fresh forest per round, every variant on it)", "",
              "ratio = the variant's wall time over the default's in the same round (median): above 1, the change "
              "turned off here saves time (for gc_paused, below 1 means pausing would).", "",
              "| case | calls | rounds | variant | wall median (s) | ratio to default | main CPU (s) | process CPU (s) |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in result["steps"].items():
        for v, m in r["variants"].items():
            lines.append(f"| {name} | {r['calls']} | {r['rounds']} | {v} | {m['wall']:.4f} | "
                         f"{m['paired_ratio_median']:.3f} | {m['main_cpu']:.3f} | {m['process_cpu']:.3f} |")
    lines += ["", "Plans: " + "; ".join(f"{n}: {r['plan']}" for n, r in result["steps"].items()), ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cases", default=None, help="comma-separated subset of the cases")
    p.add_argument("--rounds", type=int, default=None, help="rounds per case (default: per case)")
    p.add_argument("--variants", default=",".join(VARIANTS[1:]), help="comma-separated, each against the default")
    args = p.parse_args()
    model, device = script_model(args.smoke)
    spec = adapt(model).dtree_spec()
    cases = SMOKE if args.smoke or device.type != "cuda" else CASES
    chosen = args.cases.split(",") if args.cases else list(cases)
    result = {"environment": "; ".join(f"{k}: {v}" for k, v in environment(device).items()),
              "launch_us": launch_host_us() if device.type == "cuda" else None, "steps": {}}
    os.makedirs(args.out, exist_ok=True)
    for name in chosen:
        t0 = time.perf_counter()
        rounds = 2 if args.smoke else args.rounds or ROUNDS.get(name, 4)
        variants = ("default", *(v for v in args.variants.split(",") if v in VARIANTS[1:]))
        result["steps"][name] = interleaved(model, device, spec, cases[name], rounds, variants)
        ratios = {v: round(m["paired_ratio_median"], 3) for v, m in result["steps"][name]["variants"].items()}
        print(f"{name}: {ratios} in {time.perf_counter() - t0:.0f} s", flush=True)
        with open(os.path.join(args.out, "host_cost_ab.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(args.out, "host_cost_ab.md"), "w") as f:
            f.write(report(result))
    sync_device(device)
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
