"""Many configurations of dtree and its baselines on one model and forest, in one
process (the model is built once), as a Markdown table.

    python benchmarks/sweep.py --model qwen2.5-1.5b --workload grpo --set prompt_len=2048 ... \
        --config tree-mask --config dtree --config dtree:group_tokens=2048 --config dtree:mode=recompute

Used for the performance notes (benchmarks/PERF_NOTES.md): each row is a variant
whose step time, peak memory and MFU are compared in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtree.baselines import make_method  # noqa: E402
from dtree.bench.measure import device_name, limit_memory, measure_method, peak_tflops  # noqa: E402
from dtree.bench.runner import _parse_assignments, _parse_value  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.presets import build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402


def parse_config(text: str) -> tuple[str, dict]:
    """``METHOD`` or ``METHOD:key=value,key=value``."""
    method, _, rest = text.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        kw[key] = _parse_value(value)
    return method, kw


def setup(model_name: str, workload: str, overrides: list[str], dtype=torch.bfloat16):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(model_name, dtype=dtype, device=device)
    spec = adapt(model).dtree_spec()
    forest = make_workload(workload, vocab_size=spec.vocab_size, **_parse_assignments(overrides, "--set"))
    return model, forest, ppo_clip(), spec


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Model, workload and configurations: what sweep.py and profile_step.py share."""
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--workload", default="grpo")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--config", action="append", default=[], help="METHOD[:key=value,...] (repeatable)")
    p.add_argument("--out", default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (all configs)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="sweep")
    p.add_argument("--memory-limit-gib", type=float, default=None, help="cap GPU memory (e.g. 80 on an H200)")
    args = p.parse_args()
    if args.memory_limit_gib:
        limit_memory(torch.device("cuda"), args.memory_limit_gib)
    model, forest, loss, spec = setup(args.model, args.workload, args.overrides)
    if args.compile:
        from dtree.models import compile_layers

        compile_layers(model)
    device = next(model.parameters()).device
    flops = spec.training_flops(torch.from_numpy(forest.positions))
    peak = peak_tflops(device, torch.bfloat16)
    st = forest.stats()
    lines = [
        f"# sweep {args.name}: {args.model} / {args.workload} {' '.join(args.overrides)}"
        + (" (compiled layers)" if args.compile else "")
        + (f", GPU memory capped at {args.memory_limit_gib:g} GiB" if args.memory_limit_gib else ""),
        "",
        f"{device_name(device)}, torch {torch.__version__}; {st.unique_tokens:,} unique / "
        f"{st.linearized_tokens:,} linearized tokens ({st.compression_ratio:.2f}x), {st.num_trees} trees",
        "",
        "| config | status | step (s) | MFU | peak mem (GiB) | calls | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for cfg in args.config:
        method, kw = parse_config(cfg)
        r = measure_method(cfg, lambda: make_method(method, model, **kw), forest, loss, model, device=device,
                           warmup=1, repeats=args.repeats, unique_flops=flops, peak=peak)
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        row = (f"| `{cfg}` | {r.status} | {fmt(r.step_time_s, '.3f')} | {fmt(r.mfu, '.1%')} | "
               f"{fmt(r.peak_mem_gib, '.2f')} | {r.model_calls} | {fmt(r.loss, '.6g')} |")
        if r.error:
            row += f" {r.error[:120]}"
        lines.append(row)
        print(row, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"sweep_{args.name}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
