"""What issue 21 asks to measure of the KV-stack CUDA extension (csrc/), in one process,
on one model with the layers of the main bench (``dtree bench --layers auto``:
:func:`dtree.bench.layers.apply_layers`) and its allocator setting (expandable segments):

* launches: CUDA kernels per layer per model call in one step of grpo case 1, on the
  model as users hand it over (HF's eager layers) with ``lean_layers=False`` and with
  dtree's defaults (its lean norms and MLPs during its steps), then with the bench's
  layers, each with and without the extension,
  against the issue's baseline (148.9: torch ops, eager); the stack glue alone (launches
  and GPU time of one layer's push + seed and one call's zeroing) at the workloads'
  call sizes;
* step time, timed INTERLEAVED: three configurations (default + extension, default +
  torch ops, deterministic + extension), each with its own runtime and warm-up steps,
  then one timed step of each per round (the order rotates every round), the memory
  plan of every step recorded; when the configurations' plans differ, all three are
  pinned to the default's (its group_tokens, checkpoint_layers, logprob_chunk, path and
  retain budget given explicitly) and warmed up again, and the report says so; then one
  profiled step of each, the GPU kernel time by kernel (where a difference comes from);
* determinism: three runs of one ~32k-unique-token agentic forest in deterministic mode
  give bitwise-identical gradients on every parameter (two default runs for contrast).

    python benchmarks/csrc_gpu.py --out DIR            # H100, qwen2.5-1.5b, bf16 (~4 min)
    python benchmarks/csrc_gpu.py --smoke --out DIR    # CPU, tiny model, small trees (plumbing)

DIR/csrc_gpu.md and .json (:mod:`benchmarks.csrc_gpu_report`) are rewritten after every part,
so a run cut short keeps what it finished. ``benchmarks/csrc_gpu.sh`` builds the extension first.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from benchmarks.csrc_gpu_report import BASELINE_PER_LAYER_PER_CALL, kernel_summary, write  # noqa: E402
from dtree.bench.layers import LAYER_CHOICES, apply_layers  # noqa: E402
from dtree.bench.measure import median_ms, sync_device, timed_step, use_expandable_segments  # noqa: E402
from dtree.bench.report import environment  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.ops.stack_ops import interface as stack_ops  # noqa: E402
from dtree.ops.stack_ops.kv_stack import KVStack  # noqa: E402
from dtree.presets import build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

CASE1 = {"num_prompts": 1, "prompt_len": 2048, "group_size": 8, "answer_len": 512}
SMALL_TREE = {"num_trees": 1, "system_prompt_len": 64, "trajectories": 2, "turn_len": (4, 40), "turn_len_median": 12}
# (key, label, deterministic, extension): the configurations timed side by side
CONFIGS = (
    ("ext", "default, extension", False, True),
    ("ops", "default, torch ops", False, False),
    ("det", "deterministic, extension", True, True),
)
PLAN_FIELDS = ("group_tokens", "checkpoint_layers", "path_checkpoint_layers", "logprob_chunk")


def workloads(smoke: bool) -> dict[str, tuple[str, dict]]:
    if smoke:
        return {
            "agentic32k": ("agentic", {**SMALL_TREE, "target_unique_tokens": 300}),
            "agentic64k": ("agentic", {**SMALL_TREE, "target_unique_tokens": 400}),
            "case1": ("grpo", {"num_prompts": 1, "prompt_len": 64, "group_size": 4, "answer_len": 16}),
        }
    return {
        "agentic32k": ("agentic", {"num_trees": 1, "target_unique_tokens": 32768}),
        "agentic64k": ("agentic", {"num_trees": 1, "target_unique_tokens": 65536}),
        "case1": ("grpo", CASE1),
    }


def _scope(ext: bool):
    return contextlib.nullcontext() if ext else stack_ops.extension_disabled()


# ----------------------------------------------------------------------- profiling
def profile_kernels(fn, device, with_cpu: bool = False) -> dict[str, list[float]]:
    """Kernels ``fn()`` launches: name -> [launches, GPU microseconds] (every CUDA-device
    event: kernels, memcpy and memset, as the issue's baseline counted them; on CPU, for
    the smoke run, every aten op, nested ones too, with its CPU time). On a GPU only the
    device is traced (a 64k step's host events would take minutes to read back), unless
    that recorded nothing: then ``fn`` runs again with the host traced too."""
    on_gpu = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA] if on_gpu else [torch.profiler.ProfilerActivity.CPU]
    if on_gpu and with_cpu:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync_device(device)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if on_gpu and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name][0] += 1
            kernels[evt.name][1] += getattr(evt, "device_time_total", 0.0)
        elif not on_gpu and evt.name.startswith("aten::"):
            kernels[evt.name][0] += 1
            kernels[evt.name][1] += evt.cpu_time_total
    if on_gpu and not kernels and not with_cpu:
        return profile_kernels(fn, device, with_cpu=True)
    return dict(kernels)


def _profiled_step(rt, model, forest, loss, device) -> tuple[dict, object]:
    holder = {}

    def step():
        model.zero_grad(set_to_none=True)
        holder["out"] = rt.forward_backward(forest, loss)

    kernels = profile_kernels(step, device)
    return kernels, holder["out"]


def count_launches(model, forest, loss, device, spec, config: dtree.RuntimeConfig | None = None) -> dict:
    """Kernels per layer per model call in one step of ``config`` (default: dtree's
    defaults) after a warm-up step, with and without the extension."""
    out = {}
    for label, ext in (("extension", True), ("torch ops", False)):
        with _scope(ext):
            rt = dtree.TreeRuntime(model, config=config)
            timed_step(rt, forest, loss, model, device)  # warm-up: Triton compiles, the memory probe
            kernels, step = _profiled_step(rt, model, forest, loss, device)
            del rt
        total = sum(c for c, _ in kernels.values())
        out[label] = {
            "kernels": total, "model_calls": step.num_model_calls,
            "per_layer_per_call": total / (step.num_model_calls * spec.num_layers),
            "plan": plan_of(step),
        }
        model.zero_grad(set_to_none=True)
    return out


# ----------------------------------------------------------------------- stack glue alone
def _time_us(fn, device, reps: int) -> float:
    """Median microseconds of ``fn()`` (CUDA events on a GPU)."""
    return median_ms(fn, device, reps) * 1e3


def glue_costs(spec, device, rows_list: dict[str, int], reps: int) -> dict:
    """The stack glue of one call with grad, per call size (name -> rows): launches and
    time with and without the extension (:func:`_glue_one`)."""
    return {name: {"rows": t, **_glue_one(spec, device, t, reps)} for name, t in rows_list.items()}


def _glue_one(spec, device, t: int, reps: int) -> dict:
    """One layer's push (K and V) and seed (the slots' gradients folded into dK/dV) of a
    call of ``t`` rows, and the call's zeroing of its gradient slots in every layer
    (shared by its layers)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stack = KVStack(spec.num_layers, t + 64, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
    k = torch.randn(t, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
    device_lo = torch.tensor([64], device=device)

    def per_layer():
        stack.push(3, 64, k, k, device_lo=device_lo)
        stack.seed_grad(3, 64, 64 + t, k, k, (dtype, dtype), device_lo=device_lo)

    def per_call():
        stack.zero_grad(64, 64 + t, device_lo=device_lo)

    row = {}
    for label, ext in (("extension", True), ("torch ops", False)):
        with _scope(ext):
            per_layer(), per_call()
            sync_device(device)
            layer = sum(c for c, _ in profile_kernels(per_layer, device).values())
            call = sum(c for c, _ in profile_kernels(per_call, device).values())
            row[label] = {
                "launches_per_layer": layer + call / spec.num_layers,
                "layer_us": _time_us(per_layer, device, reps), "call_us": _time_us(per_call, device, reps),
            }
    return row


# ----------------------------------------------------------------------- interleaved timing
def plan_of(out) -> dict:
    """A step's memory plan and what it made of it (``StepOutput``)."""
    plan = out.metrics.get("memory_plan") or {}
    return {
        **{f: plan.get(f) for f in PLAN_FIELDS},
        "model_calls": out.num_model_calls, "recomputed_tokens": out.metrics.get("recomputed_tokens"),
        "predicted_total_gib": plan.get("predicted_total_gib"),
    }


def _plan_key(plan: dict) -> tuple:
    return tuple(plan[f] for f in (*PLAN_FIELDS, "model_calls", "recomputed_tokens"))


class _Run:
    """One configuration: its runtime, its extension setting, and what its steps did."""

    def __init__(self, key: str, label: str, config: dtree.RuntimeConfig, ext: bool):
        self.key, self.label, self.config, self.ext = key, label, config, ext
        self.rt = None
        self.warmup_plans: list[dict] = []
        self.steps: list[dict] = []

    def start(self, model, config: dtree.RuntimeConfig | None = None) -> None:
        self.rt = None
        gc.collect()
        self.config = config or self.config
        self.rt = dtree.TreeRuntime(model, config=self.config)

    def step(self, model, forest, loss, device, timed: bool) -> dict:
        gc.collect()  # outside the timed region: no collection of earlier steps' garbage inside it
        mallocs = _device_mallocs(device)
        with _scope(self.ext):
            out, seconds = timed_step(self.rt, forest, loss, model, device)
        rec = {
            "seconds": seconds, "plan": plan_of(out), "cuda_mallocs": _device_mallocs(device) - mallocs,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        }
        if timed:
            self.steps.append(rec)
        else:
            self.warmup_plans.append(rec["plan"])
        return rec


def _device_mallocs(device) -> int:  # cudaMalloc calls so far (the allocator's growth inside a step)
    return int(torch.cuda.memory_stats(device).get("num_device_alloc", 0)) if device.type == "cuda" else 0


def pinned_config(run: _Run, forest) -> dict:
    """The default's plan as explicit runtime options: call size, checkpointed layers and
    head chunk; the path (recomputed, or retained with the call's checkpointed layers)
    and the retain budget the policy gave it."""
    plan = run.warmup_plans[-1]
    recompute = plan["path_checkpoint_layers"] == "recompute"
    budget = run.rt.memory_plan.retain_budget(run.config.mode, run.config.retain_budget_tokens)
    tokens = forest.num_unique_tokens if math.isinf(budget) else int(budget)
    return {
        "group_tokens": plan["group_tokens"], "checkpoint_layers": plan["checkpoint_layers"],
        "logprob_chunk": plan["logprob_chunk"], "mode": "recompute" if recompute else "retain",
        "retain_budget_tokens": tokens,
    }


def _warm(runs, model, forest, loss, device, warmup: int) -> None:
    for run in runs:
        for _ in range(warmup):
            run.step(model, forest, loss, device, timed=False)


def time_interleaved(model, forest, loss, device, steps: int, warmup: int, configs: dict | None = None) -> dict:
    """The three configurations on one forest, interleaved step by step after their
    warm-ups, at one memory plan (pinned to the default's when theirs differ).
    ``configs``: key -> RuntimeConfig instead of :data:`CONFIGS`' (tests force a plan)."""
    configs = configs or {}
    runs = [_Run(key, label, configs.get(key, dtree.RuntimeConfig(deterministic=det)), ext)
            for key, label, det, ext in CONFIGS]
    for run in runs:
        run.start(model)
    _warm(runs, model, forest, loss, device, warmup)
    chosen = {run.key: run.warmup_plans[-1] for run in runs}
    pin = None
    if len({_plan_key(p) for p in chosen.values()}) > 1:
        pin = pinned_config(runs[0], forest)
        for run in runs:
            run.start(model, run.config.replace(**pin))
            run.warmup_plans.clear()
        _warm(runs, model, forest, loss, device, warmup)
    for i in range(steps):
        for j in range(len(runs)):  # A B C, B C A, C A B, ...: no configuration always runs first
            runs[(i + j) % len(runs)].step(model, forest, loss, device, timed=True)
    breakdown = {}
    for run in runs:  # after the timing: one profiled step of each
        with _scope(run.ext):
            kernels, _ = _profiled_step(run.rt, model, forest, loss, device)
        breakdown[run.key] = kernels
    result = {"unpinned_plans": chosen, "pinned": pin, "configs": {}, "kernels": kernel_summary(breakdown)}
    for run in runs:
        secs = [s["seconds"] for s in run.steps]
        result["configs"][run.key] = {
            "label": run.label, "backend": run.rt.attention, "steps": run.steps, "steps_s": secs,
            "median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
            "plans": sorted({_plan_key(s["plan"]) for s in run.steps}, key=str),
        }
        run.rt = None
    result["same_plan"] = len({p for c in result["configs"].values() for p in c["plans"]}) == 1
    result["paired"] = {
        "ext_vs_ops": _paired(result["configs"]["ext"]["steps_s"], result["configs"]["ops"]["steps_s"]),
        "det_vs_ext": _paired(result["configs"]["det"]["steps_s"], result["configs"]["ext"]["steps_s"]),
    }
    result["paired_interval"] = {
        "ext_vs_ops": _paired_interval(result["configs"]["ext"]["steps_s"], result["configs"]["ops"]["steps_s"]),
        "det_vs_ext": _paired_interval(result["configs"]["det"]["steps_s"], result["configs"]["ext"]["steps_s"]),
    }
    model.zero_grad(set_to_none=True)
    gc.collect()
    return result


def _paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of a_i / b_i - 1 (each round's steps ran back to back)."""
    return statistics.median(x / y - 1 for x, y in zip(a, b, strict=True))


def _paired_interval(a: list[float], b: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval of :func:`_paired` (rounds resampled, seeded)."""
    ratios = [x / y - 1 for x, y in zip(a, b, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


# ----------------------------------------------------------------------- determinism
def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel_diff(a: dict, b: dict) -> tuple[float, str, int]:
    """(largest relative difference over parameters, its name, parameters not bitwise equal)."""
    worst, name, unequal = 0.0, "", 0
    for n, g in a.items():
        if torch.equal(g, b[n]):
            continue
        unequal += 1
        d = ((g.float() - b[n].float()).norm() / g.float().norm().clamp_min(1e-30)).item()
        if d > worst:
            worst, name = d, n
    return worst, name, unequal


def check_determinism(model, forest, loss, device, runs: int = 3) -> dict:
    """Bitwise comparison of every parameter gradient between every pair of ``runs``
    deterministic runs (and of two default runs for contrast), with each run's memory plan:
    a run that planned differently (other call sizes: other sums) is named as such."""
    out = {"parameters": sum(1 for _ in model.parameters())}
    for label, deterministic in (("default", False), ("deterministic", True)):
        rt = dtree.TreeRuntime(model, config=dtree.RuntimeConfig(deterministic=deterministic))
        kept, seconds, plans = [], [], []
        for _ in range(runs if deterministic else 2):
            step, s = timed_step(rt, forest, loss, model, device)
            seconds.append(s)
            plans.append(_plan_label(step.metrics.get("memory_plan") or {}, step.num_model_calls))
            kept.append(_grads(model))
        pairs = {f"{i + 1}-{j + 1}": _max_rel_diff(kept[i], kept[j])
                 for i in range(len(kept)) for j in range(i + 1, len(kept))}
        diffs = list(pairs.values())
        out[label] = {
            "backend": rt.attention,
            "bitwise_identical": all(d[2] == 0 for d in diffs),
            "max_rel_diff": max(d[0] for d in diffs),
            "worst_parameter": max(diffs)[1],
            "unequal_parameters": max(d[2] for d in diffs),
            "unequal_by_pair": {k: d[2] for k, d in pairs.items()},
            "plans": plans,
            "same_plan": len(set(plans)) == 1,
            "step_s": seconds,
        }
        del rt, kept
        model.zero_grad(set_to_none=True)
    return out


def _plan_label(plan: dict, calls: int) -> str:
    return (f"{calls} calls of <= {plan.get('group_tokens')} tokens, {plan.get('checkpoint_layers')} ckpt, path "
            f"{plan.get('path_checkpoint_layers')}, chunk {plan.get('logprob_chunk')}")


# ----------------------------------------------------------------------- main
def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--layers", choices=LAYER_CHOICES, default="auto",
                   help="the decoder layers of the timed model (dtree bench's --layers; default auto, as the bench)")
    p.add_argument("--steps", type=int, default=6,
                   help="timed steps per configuration (>= 5); case 1: five times as many")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per configuration before the timed rounds")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, small trees: checks the plumbing")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args()
    if args.steps < 5 or args.warmup < 1:
        p.error("--steps must be >= 5 and --warmup >= 1 (the medians and min/max need them)")
    return args


def main() -> int:
    args = _args()
    on_gpu = not args.smoke and torch.cuda.is_available()
    allocator = use_expandable_segments() if on_gpu else None  # as dtree bench: before CUDA allocates
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model_name = "tiny" if args.smoke else args.model
    model = build_model(model_name, dtype=dtype, device=device)
    spec = adapt(model).dtree_spec()
    loss = ppo_clip(clip_eps=0.2, reduction="token_mean")  # dtree bench's loss on RL forests
    forests = {n: make_workload(kind, vocab_size=spec.vocab_size, **params)
               for n, (kind, params) in workloads(args.smoke).items()}
    result = {
        "env": environment(device), "model": model_name, "dtype": str(dtype).removeprefix("torch."),
        "extension": stack_ops.extension_error(), "allocator": allocator, "steps": args.steps,
        "warmup": args.warmup, "forests": {n: f.num_unique_tokens for n, f in forests.items()},
        "baseline_per_layer_per_call": BASELINE_PER_LAYER_PER_CALL, "launches": {}, "cost": {},
    }
    t0 = time.perf_counter()

    def done(part: str) -> None:
        write(result, args.out)
        print(f"{part} done at {time.perf_counter() - t0:.0f} s", flush=True)

    # the model as users hand it over (HF's eager layers): the baseline path
    # (lean_layers=False), then dtree's defaults (its lean norms and MLPs during its steps)
    result["launches"]["eager"] = count_launches(model, forests["case1"], loss, device, spec,
                                                 dtree.RuntimeConfig(lean_layers=False))
    done("launches, eager layers")
    result["launches"]["default"] = count_launches(model, forests["case1"], loss, device, spec)
    done("launches, the default path")
    result["layers"] = apply_layers(model, args.layers, device)
    print(f"decoder layers from here on: {result['layers']}", flush=True)
    result["launches"]["bench"] = count_launches(model, forests["case1"], loss, device, spec)
    done("launches, the bench's layers")
    for name, factor in (("case1", 5), ("agentic64k", 1)):  # case 1: a short, noisy step; many rounds
        result["cost"][name] = time_interleaved(model, forests[name], loss, device, args.steps * factor, args.warmup)
        done(f"{name} interleaved")
    # the glue at the call sizes the steps ran: case 1's one call, the 64k plan's call budget
    calls = {"case1": forests["case1"].num_unique_tokens,
             "agentic64k": result["cost"]["agentic64k"]["configs"]["ext"]["steps"][-1]["plan"]["group_tokens"]}
    calls = {n: max(16, min(int(t or 0), 32768, forests[n].num_unique_tokens)) for n, t in calls.items()}
    result["glue"] = glue_costs(spec, device, calls, reps=5 if args.smoke else 30)
    done("stack glue")
    result["determinism"] = check_determinism(model, forests["agentic32k"], loss, device)
    done("determinism")
    print(write(result, args.out))
    return 0 if result["determinism"]["deterministic"]["bitwise_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
