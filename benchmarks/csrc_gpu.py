"""What issue 21 asks to measure of the KV-stack CUDA extension (csrc/), in one process:

* determinism: three runs of one ~32k-unique-token agentic forest in deterministic mode
  give bitwise-identical gradients on every parameter (and, for contrast, how far two
  default-mode runs are apart);
* the cost of deterministic mode: steady step time, deterministic vs default, on the
  64k agentic tree and grpo case 1 (prompt 2048, G=8, answers 512);
* no step slower with the extension: the default step with it and with the torch ops;
* launches: CUDA kernels per layer per model call in one step with and without the
  extension, and the stack glue alone (push + seed + zero of one layer of one call).

    python benchmarks/csrc_gpu.py --out DIR            # H100, qwen2.5-1.5b, bf16 (~4 min)
    python benchmarks/csrc_gpu.py --smoke --out DIR    # CPU, tiny model, small trees (plumbing)

Order: launches, the default step with and without the extension, determinism, then the
deterministic steps (slow while the Triton backward has no deterministic form: SDPA per
segment, one timed step). DIR/csrc_gpu.md and DIR/csrc_gpu.json are rewritten after every
part, so a run cut short keeps what it finished.
``benchmarks/csrc_gpu.sh`` builds the extension first and runs the GPU tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from dtree.bench.measure import timed_step  # noqa: E402
from dtree.bench.report import environment  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.ops.stack_ops import interface as stack_ops  # noqa: E402
from dtree.ops.stack_ops.kv_stack import KVStack  # noqa: E402
from dtree.presets import build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

CASE1 = {"num_prompts": 1, "prompt_len": 2048, "group_size": 8, "answer_len": 512}
SMALL_TREE = {"num_trees": 1, "system_prompt_len": 64, "trajectories": 2, "turn_len": (4, 40), "turn_len_median": 12}


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
    """Bitwise comparison of every parameter gradient over ``runs`` deterministic runs, and
    of two default runs for contrast."""
    out = {"parameters": sum(1 for _ in model.parameters())}
    for label, deterministic in (("default", False), ("deterministic", True)):
        rt = dtree.TreeRuntime(model, config=dtree.RuntimeConfig(deterministic=deterministic))
        first, diffs, seconds = None, [], []
        for _ in range(runs if deterministic else 2):
            _, s = timed_step(rt, forest, loss, model, device)
            seconds.append(s)
            grads = _grads(model)
            if first is None:
                first = grads
            else:
                diffs.append(_max_rel_diff(first, grads))
            del grads
        out[label] = {
            "backend": rt.attention,
            "bitwise_identical": all(d[2] == 0 for d in diffs),
            "max_rel_diff": max(d[0] for d in diffs),
            "worst_parameter": max(diffs)[1],
            "unequal_parameters": max(d[2] for d in diffs),
            "step_s": seconds,
        }
        del rt, first
        model.zero_grad(set_to_none=True)
    return out


def time_steps(
    model, forest, loss, device, config: dtree.RuntimeConfig, steps: int, ext: bool, warmup: bool = True
) -> dict:
    """Steady step time of ``config``: one warm-up step, then the median of ``steps``."""
    scope = contextlib.nullcontext() if ext else stack_ops.extension_disabled()
    with scope:
        rt = dtree.TreeRuntime(model, config=config)
        if warmup:
            timed_step(rt, forest, loss, model, device)
        times = sorted(timed_step(rt, forest, loss, model, device)[1] for _ in range(steps))
        backend = rt.attention
    del rt
    model.zero_grad(set_to_none=True)
    return {"median_s": times[len(times) // 2], "steps_s": times, "backend": backend}


def _count_kernels(fn, device) -> Counter:
    """CUDA kernels ``fn()`` launches, by name (CPU: aten ops, for the smoke run)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    names = Counter()
    for evt in prof.events():
        if device.type == "cuda":
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                names[evt.name] += 1
        elif evt.name.startswith("aten::"):  # the smoke run: every aten op, nested ones too
            names[evt.name] += 1
    return names


def count_launches(model, forest, loss, device, spec) -> dict:
    """Kernels per layer per model call in one default step, with and without the
    extension; and the stack glue of one layer of one call alone."""
    out = {}
    for label, ext in (("extension", True), ("torch ops", False)):
        scope = contextlib.nullcontext() if ext else stack_ops.extension_disabled()
        with scope:
            rt = dtree.TreeRuntime(model)
            timed_step(rt, forest, loss, model, device)  # warm-up (Triton compiles, stack allocation)
            holder = {}

            def step():
                model.zero_grad(set_to_none=True)
                holder["out"] = rt.forward_backward(forest, loss)

            kernels = _count_kernels(step, device)
            calls = holder["out"].num_model_calls
            del rt
        out[label] = {
            "kernels": sum(kernels.values()),
            "model_calls": calls,
            "per_layer_per_call": sum(kernels.values()) / (calls * spec.num_layers),
            "glue_per_layer_per_call": _glue_launches(spec, device, ext),
        }
        model.zero_grad(set_to_none=True)
    return out


def _glue_launches(spec, device, ext: bool) -> float:
    """Kernels of one layer's stack glue in one call with grad: push (K and V), the seed's
    backward (dK, dV with the slots' gradients), and the call's zeroing shared by its layers."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stack = KVStack(spec.num_layers, 1024, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
    t = 256
    k = torch.randn(t, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
    device_lo = torch.tensor([64], device=device)
    scope = contextlib.nullcontext() if ext else stack_ops.extension_disabled()

    def per_layer():
        stack.push(3, 64, k, k, device_lo=device_lo)
        stack.seed_grad(3, 64, 64 + t, k, k, (dtype, dtype), device_lo=device_lo)

    def per_call():
        stack.zero_grad(64, 64 + t, device_lo=device_lo)

    with scope:
        per_layer(), per_call()
        layer = sum(_count_kernels(per_layer, device).values())
        call = sum(_count_kernels(per_call, device).values())
    return layer + call / spec.num_layers


def _pct(new: float, old: float) -> str:
    return f"{(new / old - 1) * 100:+.1f}%"


def _determinism_lines(result: dict) -> list[str]:
    det = result["determinism"]
    lines = [
        f"## Determinism: {result['forests']['agentic32k']} unique tokens, agentic",
        "",
        "| mode | backend | runs bitwise identical | parameters not equal | largest relative difference | steps (s) |",
        "|---|---|---|---|---|---|",
    ]
    for label in ("default", "deterministic"):
        d = det[label]
        lines.append(
            f"| {label} | {d['backend']} | {d['bitwise_identical']} | {d['unequal_parameters']} of {det['parameters']} "
            f"| {d['max_rel_diff']:.2e} ({d['worst_parameter'] or '-'}) | "
            + ", ".join(f"{s:.2f}" for s in d["step_s"]) + " |"
        )
    return lines + [""]


def _time_lines(result: dict) -> list[str]:
    lines = [
        "## Step time (median of steady steps, same forest)",
        "",
        "| workload | default, extension | default, torch ops | extension vs torch ops | deterministic "
        "| deterministic cost |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in result["cost"].items():
        ext, ops, det = c["default"], c["default_torch_ops"], c.get("deterministic")
        det_cells = "not run | -" if det is None else (
            f"{det['median_s']:.3f} s ({det['backend']}, {len(det['steps_s'])} steps) | "
            f"{_pct(det['median_s'], ext['median_s'])}"
        )
        lines.append(
            f"| {name} ({result['forests'][name]} unique) | {ext['median_s']:.3f} s | {ops['median_s']:.3f} s | "
            f"{_pct(ext['median_s'], ops['median_s'])} | {det_cells} |"
        )
    return lines + [""]


def _launch_lines(result: dict) -> list[str]:
    e, t = result["launches"]["extension"], result["launches"]["torch ops"]

    def row(label, x):
        return (f"| {label} | {x['kernels']} | {x['model_calls']} | {x['per_layer_per_call']:.1f} "
                f"| {x['glue_per_layer_per_call']:.2f} |")

    return [
        f"## Launches ({result['launch_workload']}, one default step)",
        "",
        "| | kernels | model calls | per layer per call | stack glue per layer per call |",
        "|---|---|---|---|---|",
        row("extension", e),
        row("torch ops", t),
        f"| change | {_pct(e['kernels'], t['kernels'])} | | {_pct(e['per_layer_per_call'], t['per_layer_per_call'])} "
        f"| {_pct(e['glue_per_layer_per_call'], t['glue_per_layer_per_call'])} |",
        "",
    ]


def report(result: dict) -> str:
    """The Markdown of what has run so far."""
    env = result["env"]
    lines = [
        "# KV-stack CUDA extension (issue 21)",
        "",
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"transformers {env['transformers']}; model {result['model']}, {result['dtype']}; "
        f"extension: {result['extension'] or 'loaded'}",
        "",
    ]
    if "launches" in result:
        lines += _launch_lines(result)
    if "determinism" in result:
        lines += _determinism_lines(result)
    if result.get("cost"):
        lines += _time_lines(result)
    return "\n".join(lines)


def write(result: dict, out: str) -> str:
    """Write csrc_gpu.md / .json (after every part: a run cut short keeps what it finished)."""
    text = report(result)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "csrc_gpu.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "csrc_gpu.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration after one warm-up")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, small trees: checks the plumbing")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model_name = "tiny" if args.smoke else args.model
    model = build_model(model_name, dtype=dtype, device=device)
    spec = adapt(model).dtree_spec()
    loss = ppo_clip()
    forests = {
        name: make_workload(kind, vocab_size=spec.vocab_size, **params)
        for name, (kind, params) in workloads(args.smoke).items()
    }
    result = {
        "env": environment(device), "model": model_name, "dtype": str(dtype).removeprefix("torch."),
        "extension": stack_ops.extension_error(),
        "forests": {n: f.num_unique_tokens for n, f in forests.items()},
        "cost": {},
    }
    t0 = time.perf_counter()

    def done(part: str) -> None:
        write(result, args.out)
        print(f"{part} done at {time.perf_counter() - t0:.0f} s", flush=True)

    result["launch_workload"] = "case1"
    result["launches"] = count_launches(model, forests["case1"], loss, device, spec)
    done("launches")
    plain, det = dtree.RuntimeConfig(), dtree.RuntimeConfig(deterministic=True)
    for name in ("agentic64k", "case1"):
        result["cost"][name] = {
            "default": time_steps(model, forests[name], loss, device, plain, args.steps, ext=True),
            "default_torch_ops": time_steps(model, forests[name], loss, device, plain, args.steps, ext=False),
        }
        done(f"{name} default")
    result["determinism"] = check_determinism(model, forests["agentic32k"], loss, device)
    done("determinism")
    # deterministic mode on a backend other than Triton (per-segment SDPA until the Triton
    # backward takes deterministic=True) is slow on large trees: one timed step, no warm-up
    fast = result["determinism"]["deterministic"]["backend"] == "triton"
    for name in ("case1", "agentic64k"):
        steps = args.steps if fast else 1
        result["cost"][name]["deterministic"] = time_steps(
            model, forests[name], loss, device, det, steps, ext=True, warmup=fast
        )
        done(f"{name} deterministic")
    print(report(result))
    return 0 if result["determinism"]["deterministic"]["bitwise_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
