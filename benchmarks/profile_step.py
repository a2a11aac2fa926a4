"""Profile one training step of each method with torch.profiler (GPU).

Prints, per method: step wall time, GPU busy time (sum of kernel times), launch
count, and the kernels that take the most time, grouped into attention / matmul /
other. Writes the same as Markdown with ``--out DIR``.

    python benchmarks/profile_step.py --model qwen2.5-1.5b --workload grpo \
        --set num_prompts=1 --set prompt_len=2048 --set group_size=8 --set answer_len=512 \
        --configs dtree,tree-mask:split16k,dtree:group_tokens=2048

Configurations use ``dtree bench --configs``'s grammar (:mod:`dtree.bench.configs`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtree.baselines import make_method  # noqa: E402
from dtree.bench.configs import parse_assignments, parse_configs  # noqa: E402
from dtree.bench.layers import LAYER_CHOICES, bench_layers  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.presets import build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402


def setup(model_name: str, workload: str, overrides: list[str], dtype=torch.bfloat16):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        dtype = torch.float32
    model = build_model(model_name, dtype=dtype, device=device)
    spec = adapt(model).dtree_spec()
    forest = make_workload(workload, vocab_size=spec.vocab_size, **parse_assignments(overrides, "--set"))
    return model, forest, ppo_clip(), spec


def classify(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("attn", "attention", "flash", "flex", "_fwd_kernel", "_dkdv", "_dq_kernel", "_delta")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "wgmma")):
        return "matmul"
    return "other"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile(runner, forest, loss, model, steps: int = 2):
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        runner.forward_backward(forest, loss)
    _sync()
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        runner.forward_backward(forest, loss)
        _sync()
        wall = time.perf_counter() - t0
    cpu = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CPU:
            cpu[evt.key] += evt.self_cpu_time_total
    kernels = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[evt.name]
            k[0] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            k[1] += 1
    return wall, kernels, cpu


def _profile_configs(model, forest, loss, args) -> list[str]:
    """The Markdown lines of every configuration's profiled step."""
    lines = []
    for config in parse_configs(args.configs):
        cfg = config.label
        runner = make_method(config.method, model, **config.options)
        wall, kernels, cpu = profile(runner, forest, loss, model)
        busy = sum(v[0] for v in kernels.values()) / 1e6
        launches = sum(v[1] for v in kernels.values())
        groups = defaultdict(float)
        for name, (us, _) in kernels.items():
            groups[classify(name)] += us / 1e6
        lines += [
            f"## {cfg}",
            f"wall {wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%}), {launches} kernel launches; "
            + ", ".join(f"{g} {t * 1e3:.1f} ms" for g, t in sorted(groups.items())),
            "",
            "| kernel | ms | calls |",
            "|---|---|---|",
        ]
        for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]:
            lines.append(f"| `{name[:90]}` | {us / 1e3:.2f} | {n} |")
        lines += ["", f"CPU (self time, total {sum(cpu.values()) / 1e3:.1f} ms):", "", "| op | ms |", "|---|---|"]
        for name, us in sorted(cpu.items(), key=lambda kv: -kv[1])[: args.top]:
            lines.append(f"| `{name[:90]}` | {us / 1e3:.2f} |")
        lines.append("")
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--workload", default="grpo")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--configs", default="dtree,tree-mask", help="as dtree bench --configs")
    p.add_argument("--out", default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (all configs)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--name", default="")
    p.add_argument("--layers", default="auto", choices=LAYER_CHOICES,
                   help="decoder layers of every method, as dtree bench --layers (default auto: dtree's lean layers)")
    args = p.parse_args()
    model, forest, loss, _ = setup(args.model, args.workload, args.overrides)
    if args.compile:
        from dtree.models import compile_layers

        compile_layers(model)
    device = next(model.parameters()).device
    with bench_layers(model, args.layers, device) as layers:
        lines = [f"# profile: {args.model} / {args.workload} {args.overrides}", "", f"layers (every method): {layers}", ""]
        lines += _profile_configs(model, forest, loss, args)
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_{args.model}_{args.workload}{args.name}.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
