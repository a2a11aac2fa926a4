"""``dtree bench``: dtree against its baselines on one workload, in one process.

Every method gets the same model object, forest and loss; they run one after the
other, so the ratios are taken under the same conditions. Reports go under
``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from ..baselines import METHODS
from ..presets import DTYPES, MODEL_PRESETS, build_model
from .measure import MethodResult, device_name, limit_memory, measure_method, peak_tflops
from .report import environment, format_table, write_reports

__all__ = ["add_bench_parser", "run_bench"]



def _parse_value(text: str) -> Any:
    if "," in text:  # a range or a choice set, e.g. prompt_len=512,4096
        return tuple(_parse_value(t.strip()) for t in text.split(",") if t.strip())
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _parse_assignments(items: list[str] | None, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{what} takes KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = _parse_value(value.strip())
    return out


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark dtree against linearized and tree-mask training",
        description="Time one training step (forward+backward over the whole forest) of each method on the same "
        "model and forest, in one process, and write JSON/Markdown/PNG reports.",
    )
    p.add_argument("--model", default=None, help=f"{', '.join(MODEL_PRESETS)} or a HF config.json path "
                   "(default: tiny on CPU, qwen2.5-1.5b on GPU)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None, help="grpo, agentic or search (default: grpo)")
    src.add_argument("--data", default=None, help="a JSONL batch instead of a generated workload")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a workload parameter (repeatable), e.g. --set group_size=8")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--opt", action="append", metavar="METHOD.KEY=VALUE",
                   help="method option (repeatable), e.g. --opt dtree.mode=recompute --opt tree-mask.max_tokens_per_batch=32768")
    p.add_argument("--loss", choices=("auto", "nll", "ppo"), default="auto",
                   help="ppo when the forest has advantages and old_logprobs, else nll (default: auto)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model's decoder layers (applies to every method alike)")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="cap this process's GPU memory (e.g. 80 to emulate an 80 GB GPU on a larger one)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (default 2: compilation and autotuning, then the call sizes "
                        "dtree adapts after measuring its first step)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results", help="report directory (default: benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix for the report file names")
    p.add_argument("--no-report", action="store_true", help="print the table only")
    p.set_defaults(func=run_bench)


# Micro-batch budgets the baselines run with unless --opt says otherwise: packed rows
# of at most this many tokens (linearized: whole sequences; tree-mask: whole trees,
# larger trees split the way AReaL does). Without one, tree-mask packs the whole
# forest into one row.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {"tree-mask": {"max_tokens_per_batch": 32768}}


def _method_options(opts: dict[str, Any], methods: list[str]) -> dict[str, dict[str, Any]]:
    per: dict[str, dict[str, Any]] = {m: dict(METHOD_DEFAULTS.get(m, {})) for m in methods}
    for key, value in opts.items():
        method, _, name = key.partition(".")
        if method not in per or not name:
            raise ValueError(f"--opt {key}: expected METHOD.KEY with METHOD in {methods}")
        per[method][name] = value
    return per


# CPU-sized shapes for the default CPU run (tiny model): a few thousand linearized
# tokens, enough that per-call overheads do not hide the effect of the tree.
CPU_WORKLOADS: dict[str, dict[str, Any]] = {
    "grpo": dict(num_prompts=2, prompt_len=(256, 512), group_size=8, answer_len=(32, 128)),
    "agentic": dict(num_trees=1, system_prompt_len=512, task_len=(16, 64), trajectories=(6, 10), depth=(3, 6),
                    turn_len=(8, 160), turn_len_median=32.0),
    "search": dict(num_trees=1, prompt_len=(128, 256), branching=3, beam_width=2, depth=4, step_len=(8, 32)),
}


def _workload(args, vocab_size: int, on_gpu: bool):
    from ..tree import Forest
    from ..workloads import make_workload

    if args.data:
        return Forest.from_jsonl(args.data), os.path.basename(args.data), {}
    name = args.workload or "grpo"
    small = not on_gpu and args.model in (None, "tiny")
    overrides = {**(CPU_WORKLOADS.get(name, {}) if small else {}), **_parse_assignments(args.overrides, "--set")}
    forest = make_workload(name, seed=args.seed, vocab_size=vocab_size, **overrides)
    return forest, name + (" (cpu size)" if small else ""), overrides


def _loss(kind: str, forest):
    from .. import losses

    rl = all(f in forest.fields for f in ("advantages", "old_logprobs"))
    if kind == "ppo" or (kind == "auto" and rl):
        return losses.ppo_clip(clip_eps=0.2, reduction="token_mean"), "ppo_clip(eps=0.2, token_mean)"
    return losses.nll(reduction="token_mean"), "nll(token_mean)"


def run_bench(args: argparse.Namespace) -> int:
    from ..baselines import make_method

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    model_name = args.model or ("qwen2.5-1.5b" if on_gpu else "tiny")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
    method_opts = _method_options(_parse_assignments(args.opt, "--opt"), methods)

    if args.memory_limit_gib:
        limit_memory(device, args.memory_limit_gib)
    print(f"dtree bench: {model_name} ({dtype}) on {device_name(device)}", flush=True)
    model = build_model(model_name, dtype=dtype, device=device, seed=args.seed)
    from ..models import adapt

    spec = adapt(model).dtree_spec()
    if args.compile:
        from ..models import compile_layers

        compile_layers(model)
    forest, wl_name, overrides = _workload(args, spec.vocab_size, on_gpu)
    loss, loss_desc = _loss(args.loss, forest)
    st = forest.stats()
    flop_ratio = forest.flop_compression_ratio(spec.forward_flops_per_token(), spec.forward_attention_flops_per_key())
    unique_flops = spec.training_flops(torch.from_numpy(forest.positions))
    print(f"workload {wl_name}: {st.num_sequences} sequences, {st.unique_tokens:,} unique / "
          f"{st.linearized_tokens:,} linearized tokens, compression {st.compression_ratio:.2f}x "
          f"(FLOP-weighted {flop_ratio:.2f}x)", flush=True)

    from tqdm import tqdm

    steps = args.warmup + args.repeats
    bar = tqdm(total=steps * len(methods), desc="bench", unit="step", file=sys.stderr, dynamic_ncols=True)
    results: list[MethodResult] = []
    for name in methods:
        bar.set_postfix_str(name)
        res = measure_method(
            name,
            lambda name=name: make_method(name, model, **method_opts[name]),
            forest,
            loss,
            model,
            device=device,
            warmup=args.warmup,
            repeats=args.repeats,
            unique_flops=unique_flops,
            peak=peak_tflops(device, dtype),
            on_step=lambda: bar.update(1),
        )
        if res.status != "ok":
            bar.update(steps - len(res.step_times_s) - min(args.warmup, steps))
        results.append(res)
    bar.close()

    lin = next((r for r in results if r.method == "linearized" and r.status == "ok"), None)
    for r in results:
        r.ideal_speedup = flop_ratio
        if lin and r.status == "ok":
            r.speedup_vs_linearized = lin.step_time_s / r.step_time_s
            r.fraction_of_ideal = r.speedup_vs_linearized / flop_ratio
    rows = [r.as_dict() for r in results]
    ok = [r for r in results if r.status == "ok"]
    notes = ""
    if len(ok) > 1:
        spread = max(abs(r.loss - ok[0].loss) for r in ok) / max(abs(ok[0].loss), 1e-12)
        notes = f"Loss agreement across methods: max relative difference {spread:.1e}."
    print()
    print(format_table(rows))
    if notes:
        print(notes)
    report = {
        "env": environment(device),
        "model": {
            "name": model_name, "dtype": str(dtype).replace("torch.", ""),
            "params": sum(p.numel() for p in model.parameters()),
            "layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab_size,
        },
        "workload": {
            "name": wl_name, "params": {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()} or None,
            "seed": args.seed,
            "sequences": st.num_sequences, "trees": st.num_trees, "nodes": st.num_nodes,
            "unique_tokens": st.unique_tokens, "linearized_tokens": st.linearized_tokens,
            "compression_ratio": st.compression_ratio, "flop_compression_ratio": flop_ratio,
            "max_path_length": st.max_path_length, "max_depth": st.max_depth,
        },
        "loss": loss_desc,
        "compiled_layers": bool(args.compile),
        "memory_limit_gib": args.memory_limit_gib,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "method_options": method_opts,
        "tag": args.tag,
        "results": rows,
        "notes": notes,
    }
    if not args.no_report:
        paths = write_reports(report, args.out)
        print("reports: " + ", ".join(paths.values()))
    return 0 if ok else 1
