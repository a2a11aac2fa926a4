"""``dtree bench``: dtree against its baselines on one workload, in one process.

Every configuration gets the same model object, forests and loss; they run one after
the other, so the ratios are taken under the same conditions. By default every step
trains a fresh seeded forest (``seed + step``), as RL does; ``--same-forest`` repeats
one forest (for kernel work). Reports go under ``--out`` (default ``./dtree-results``,
git-ignored, so a run never overwrites the committed reports under
``benchmarks/results/``) and are rewritten after every configuration, so a run cut
short still leaves the configurations it finished.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..presets import DTYPES, MODEL_PRESETS, build_model
from .configs import PRESETS, MethodConfig, parse_assignments, parse_configs
from .layers import LAYER_CHOICES, bench_layers, dtree_layer_options
from .measure import (
    MethodResult,
    StepForest,
    device_name,
    limit_memory,
    measure_method,
    measure_steps,
    peak_tflops,
    use_expandable_segments,
)
from .report import environment, finish_report, format_table, write_reports

__all__ = ["BenchConfig", "add_bench_parser", "run", "run_bench", "CPU_WORKLOADS", "DEFAULT_OUT"]

DEFAULT_OUT = "dtree-results"  # relative to the working directory; .gitignore lists it

def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark dtree against linearized and tree-mask training",
        description="Time training steps (forward+backward over a whole forest) of dtree and its baselines on the "
        "same model, in one process: by default a fresh seeded forest every step (first, second and steady steps "
        "reported apart); write JSON/Markdown/PNG reports.",
    )
    p.add_argument("--model", default=None, help=f"{', '.join(MODEL_PRESETS)} or a HF config.json path "
                   "(default: tiny on CPU, qwen2.5-1.5b on GPU)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None,
                     help="grpo, agentic, search or mixed (all three in one batch) (default: grpo)")
    src.add_argument("--data", default=None, help="a JSONL batch instead of a generated workload (implies --same-forest)")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a workload parameter (repeatable), e.g. --set group_size=8")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--methods", default=None,
                     help="comma-separated methods, each at its defaults: dtree, linearized, tree-mask")
    sel.add_argument("--configs", default=None,
                     help="comma-separated configurations METHOD[:PART+PART...] and presets; parts: whole, splitN "
                          "(split16k), ckpt, plain, recompute, KEY=VALUE. Presets: "
                          + "; ".join(f"{k} = {','.join(v)}" for k, v in PRESETS.items())
                          + ". Default: gpu on a GPU, basic on CPU")
    p.add_argument("--opt", action="append", metavar="METHOD.KEY=VALUE",
                   help="option under every configuration of METHOD (repeatable), e.g. --opt dtree.logprob_chunk=1024")
    p.add_argument("--loss", choices=("auto", "nll", "ppo"), default="auto",
                   help="ppo when the forest has advantages and old_logprobs, else nll (default: auto)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model's decoder layers (applies to every method alike)")
    p.add_argument("--layers", choices=LAYER_CHOICES, default="auto",
                   help="decoder-layer kernels, applied once to the model, so every method runs them: auto (dtree's "
                        "lean RMSNorm/SwiGLU where the family has them, Liger's rotary on CUDA when installed; else "
                        "Liger's layers; else eager), lean, liger, eager (default: auto)")
    p.add_argument("--fused", action="store_true", help="the same as --layers liger")
    p.add_argument("--no-expandable-segments", action="store_true",
                   help="keep the CUDA allocator's default segments (by default the bench process runs with "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, for every method alike)")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="cap this process's GPU memory (e.g. 80 to emulate an 80 GB GPU on a larger one)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per configuration, one fresh forest each (seeds seed..seed+steps-1); "
                        "default 6 on GPU, 4 on CPU. Steady figures are over steps 3..N")
    p.add_argument("--accumulate", action="store_true",
                   help="clear the gradients before a configuration's first step only: every later step adds to "
                        "them, as the micro-batches of one optimizer step do (the baselines accumulate in place, as "
                        "the trainers they stand for; dtree keeps its grad_guard default unless a configuration sets "
                        "it)")
    p.add_argument("--same-forest", action="store_true",
                   help="repeat one forest instead: --warmup untimed steps, then the median of --repeats")
    p.add_argument("--warmup", type=int, default=2, help="(--same-forest) untimed steps first (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="(--same-forest) timed steps (default 3)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="no step starts after this many seconds; the configurations left are reported as skipped")
    p.add_argument("--max-config-seconds", type=float, default=None, metavar="SECONDS",
                   help="a configuration stops once its steps took this long (after at least 3 steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"report directory (default: ./{DEFAULT_OUT} in the working directory; git-ignored in a dtree "
                        "checkout, so a run never overwrites committed reports)")
    p.add_argument("--tag", default="", help="suffix for the report file names")
    p.add_argument("--no-report", action="store_true", help="print the table only")
    p.set_defaults(func=run_bench)


def _method_options(opts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    per: dict[str, dict[str, Any]] = {}
    for key, value in opts.items():
        method, _, name = key.partition(".")
        if method not in ("dtree", "linearized", "tree-mask") or not name:
            raise ValueError(f"--opt {key}: expected METHOD.KEY with METHOD one of dtree, linearized, tree-mask")
        per.setdefault(method, {})[name] = value
    return per


def select_configs(args: argparse.Namespace, on_gpu: bool, layers: str = "auto") -> list[MethodConfig]:
    """``--configs``, else ``--methods`` at their defaults, else the device's preset.
    With ``layers`` (the run's ``--layers`` choice) ``eager`` or ``liger`` dtree's
    configurations get ``lean_layers=False`` (its default runs lean layers during its
    steps; the baselines would not)."""
    base = _method_options(parse_assignments(args.opt, "--opt"))
    if own := dtree_layer_options(layers):  # dtree too runs the layers --layers names
        base["dtree"] = {**own, **base.get("dtree", {})}
    text = args.configs or args.methods or ("gpu" if on_gpu else "basic")
    if args.methods:
        unknown = [m for m in args.methods.split(",") if m.strip() and m.strip() not in ("dtree", "linearized", "tree-mask")]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from dtree, linearized, tree-mask (or use --configs)")
    return parse_configs(text, base)


# CPU-sized shapes for the default CPU run (tiny model): a few thousand linearized
# tokens, enough that per-call overheads do not hide the effect of the tree.
CPU_WORKLOADS: dict[str, dict[str, Any]] = {
    "grpo": dict(num_prompts=2, prompt_len=(256, 512), group_size=8, answer_len=(32, 128)),
    "agentic": dict(num_trees=1, system_prompt_len=512, task_len=(16, 64), trajectories=(6, 10), depth=(3, 6),
                    turn_len=(8, 160), turn_len_median=32.0),
    "search": dict(num_trees=1, prompt_len=(128, 256), branching=3, beam_width=2, depth=4, step_len=(8, 32)),
}
# the three shapes above, without their tree counts, in one batch (no 1k-32k length bounds)
CPU_WORKLOADS["mixed"] = dict(
    grpo_groups=1, agentic_trees=1, search_trees=1, min_sequence_len=None, max_sequence_len=None,
    grpo_args={k: v for k, v in CPU_WORKLOADS["grpo"].items() if k != "num_prompts"},
    agentic_args={k: v for k, v in CPU_WORKLOADS["agentic"].items() if k != "num_trees"},
    search_args={k: v for k, v in CPU_WORKLOADS["search"].items() if k != "num_trees"},
)


def _data_forest(cfg: "BenchConfig"):
    """``--data``'s forest, read and checked before any model is built (None without
    ``--data``): a malformed file fails fast, naming its file and line."""
    from ..forest.forest import Forest

    return Forest.from_jsonl(cfg.data) if cfg.data else None


def _step_forests(cfg: "BenchConfig", spec, data=None) -> tuple[list[StepForest], dict]:
    """The forests of the run (one, or one per step) and the workload's description;
    ``data``: ``--data``'s forest, checked against the model's vocabulary and positions."""
    from ..engine.checks import validate_forest
    from ..workloads import make_workload, workload_parameters

    flops = (spec.forward_flops_per_token(), spec.forward_attention_flops_per_key())

    def wrap(seed: int, forest) -> StepForest:
        return StepForest(seed, forest, spec.training_flops(torch.from_numpy(forest.positions.copy())),
                          forest.flop_compression_ratio(*flops))

    if data is not None:
        try:
            validate_forest(data, spec)
        except ValueError as e:
            raise ValueError(f"{cfg.data}: {e} (choose a --model that fits the data)") from None
        return [wrap(cfg.seed, data)], {"name": os.path.basename(cfg.data), "params": None}
    name = cfg.workload
    small = not cfg.on_gpu and cfg.model_name == "tiny"
    overrides = {**(CPU_WORKLOADS.get(name, {}) if small else {}), **cfg.overrides}
    params = {**workload_parameters(name), **overrides}
    forests = []
    for i in range(cfg.steps):
        t0 = time.perf_counter()
        seed = cfg.seed + i
        forests.append(wrap(seed, make_workload(name, seed=seed, vocab_size=spec.vocab_size, **overrides)))
        st = forests[-1].forest.stats()
        print(f"  forest {i + 1}/{cfg.steps} (seed {seed}): {st.num_trees} trees, {st.unique_tokens:,} unique / "
              f"{st.linearized_tokens:,} linearized tokens, {st.compression_ratio:.2f}x "
              f"(FLOP-weighted {forests[-1].flop_ratio:.2f}x), built in {time.perf_counter() - t0:.1f} s", flush=True)
    desc = {
        "name": name + (" (cpu size)" if small else ""),
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
        "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()},
    }
    return forests, desc


def _forest_summary(forests: list[StepForest]) -> list[dict]:
    rows = []
    for sf in forests:
        st = sf.forest.stats()
        rows.append({
            "seed": sf.seed, "sequences": st.num_sequences, "trees": st.num_trees, "nodes": st.num_nodes,
            "unique_tokens": st.unique_tokens, "linearized_tokens": st.linearized_tokens,
            "compression_ratio": st.compression_ratio, "flop_compression_ratio": sf.flop_ratio,
            "max_path_length": st.max_path_length, "max_depth": st.max_depth, "unique_flops": sf.unique_flops,
        })
    return rows


def _loss(kind: str, forest):
    from .. import losses

    rl = all(f in forest.fields for f in ("advantages", "old_logprobs"))
    if kind == "ppo" or (kind == "auto" and rl):
        return losses.ppo_clip(clip_eps=0.2, reduction="token_mean"), "ppo_clip(eps=0.2, token_mean)"
    return losses.nll(reduction="token_mean"), "nll(token_mean)"


def _progress(start: float):
    def line(i: int, dt: float, r: MethodResult) -> None:
        mem = r.step_peak_mem_gib[-1]
        print(f"  [{time.monotonic() - start:7.1f} s] {r.config:<28} step {i + 1}: {dt:8.3f} s"
              + (f", peak {mem:6.2f} GiB" if mem is not None else "")
              + f", loss {r.step_losses[-1]:.6g}, calls {r.step_calls[-1]}", flush=True)

    return line


@dataclass(frozen=True)
class BenchConfig:
    """One ``dtree bench`` run, resolved from the command line (:meth:`from_args`):
    the device's defaults filled in, the configurations parsed, the counts checked."""

    device: torch.device
    dtype: torch.dtype
    model_name: str
    configs: list[MethodConfig]
    workload: str = "grpo"
    data: str | None = None  # a JSONL batch instead of a workload (implies same_forest)
    overrides: dict[str, Any] = field(default_factory=dict)  # workload parameters
    loss: str = "auto"
    compile: bool = False
    layers: str = "auto"
    expandable_segments: bool = True
    memory_limit_gib: float | None = None
    steps: int = 1
    same_forest: bool = False
    accumulate: bool = False
    warmup: int = 2
    repeats: int = 3
    time_budget: float | None = None
    max_config_seconds: float | None = None
    seed: int = 0
    out: str = DEFAULT_OUT
    tag: str = ""
    write_reports: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.repeats < 1 or self.warmup < 0:
            raise ValueError("--steps and --repeats must be >= 1, --warmup >= 0")

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BenchConfig":
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        on_gpu = device.type == "cuda"
        same_forest = args.same_forest or bool(args.data)
        layers = "liger" if args.fused else args.layers
        return cls(
            device=device,
            dtype=DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")],
            model_name=args.model or ("qwen2.5-1.5b" if on_gpu else "tiny"),
            configs=select_configs(args, on_gpu, layers),
            workload=args.workload or "grpo",
            data=args.data,
            overrides=parse_assignments(args.overrides, "--set"),
            loss=args.loss,
            compile=args.compile,
            layers=layers,
            expandable_segments=not args.no_expandable_segments,
            memory_limit_gib=args.memory_limit_gib,
            steps=1 if same_forest else (args.steps or (6 if on_gpu else 4)),
            same_forest=same_forest,
            accumulate=args.accumulate,
            warmup=args.warmup,
            repeats=args.repeats,
            time_budget=args.time_budget,
            max_config_seconds=args.max_config_seconds,
            seed=args.seed,
            out=args.out,
            tag=args.tag,
            write_reports=not args.no_report,
        )


def run_bench(args: argparse.Namespace) -> int:
    """``dtree bench``: :func:`run` on the command line's :class:`BenchConfig`."""
    return run(BenchConfig.from_args(args))


def run(cfg: BenchConfig) -> int:
    """Every configuration of ``cfg`` on one model and the same forests; returns the
    exit code (0 when at least one configuration ran)."""
    start = time.monotonic()
    data = _data_forest(cfg)
    allocator = _prepare_device(cfg)
    protocol = (f"one forest, {cfg.warmup} warm-up + {cfg.repeats} timed steps" if cfg.same_forest
                else f"{cfg.steps} steps, a fresh forest each")
    print(f"dtree bench: {cfg.model_name} ({cfg.dtype}) on {device_name(cfg.device)}; {protocol}; "
          f"configurations: {', '.join(c.label for c in cfg.configs)}", flush=True)
    model, spec = _bench_model(cfg)
    forests, workload = _step_forests(cfg, spec, data)
    loss, loss_desc = _loss(cfg.loss, forests[0].forest)
    report = _report_header(cfg, model, spec, workload, forests, loss_desc, allocator)
    results: list[MethodResult] = []
    with bench_layers(model, cfg.layers, cfg.device) as layers:
        print(f"decoder layers, for every method: {layers}", flush=True)
        if cfg.compile:
            from ..models import compile_layers

            compile_layers(model)
        report["layers"] = layers
        for method_cfg in cfg.configs:
            res = _measure_config(cfg, method_cfg, model, forests, loss, start)
            results.append(res)
            report["results"] = [r.as_dict() for r in results]
            finish_report(report)
            if cfg.write_reports:
                write_reports(report, cfg.out, chart=False)
    print()
    print(format_table(report))
    for line in report.get("summary_lines", []):
        print(line)
    if cfg.write_reports:
        paths = write_reports(report, cfg.out)
        print("reports: " + ", ".join(paths.values()))
    print(f"total {time.monotonic() - start:.1f} s", flush=True)
    return 0 if any(r.status == "ok" for r in results) else 1


def _prepare_device(cfg: BenchConfig) -> str | None:
    """The allocator setting and the memory cap, before anything is allocated."""
    allocator = None
    if cfg.on_gpu and cfg.expandable_segments:
        allocator = use_expandable_segments()
    if cfg.memory_limit_gib:
        limit_memory(cfg.device, cfg.memory_limit_gib)
    return allocator


def _bench_model(cfg: BenchConfig):
    """The one model every configuration trains, and its spec (its layer kernels and
    compiled layers come once, for every method alike, in :func:`run`)."""
    from ..models import adapt

    model = build_model(cfg.model_name, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
    return model, adapt(model).dtree_spec()


def _report_header(cfg: BenchConfig, model, spec, workload: dict, forests: list[StepForest], loss_desc: str,
                   allocator: str | None) -> dict:
    """The report's description of the run (its results are filled in as they come)."""
    return {
        "env": environment(cfg.device),
        "model": {
            "name": cfg.model_name, "dtype": str(cfg.dtype).replace("torch.", ""),
            "params": sum(p.numel() for p in model.parameters()),
            "layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab_size,
            "intermediate": spec.intermediate_size,
        },
        "workload": {**workload, "seed": cfg.seed, "forests": _forest_summary(forests)},
        "protocol": "same-forest" if cfg.same_forest else "fresh-forests",
        "accumulate": cfg.accumulate,
        "steps": cfg.steps,
        "warmup": cfg.warmup if cfg.same_forest else None,
        "repeats": cfg.repeats if cfg.same_forest else None,
        "loss": loss_desc,
        "compiled_layers": cfg.compile,
        "layers": cfg.layers,
        "allocator": allocator,
        "memory_limit_gib": cfg.memory_limit_gib,
        "time_budget_s": cfg.time_budget,
        "max_config_seconds": cfg.max_config_seconds,
        "configs": [{"label": c.label, "method": c.method, "options": c.options} for c in cfg.configs],
        "tag": cfg.tag,
        "results": [],
    }


def _measure_config(cfg: BenchConfig, method_cfg: MethodConfig, model, forests: list[StepForest], loss,
                    start: float) -> MethodResult:
    """One configuration's steps (skipped once the run's time budget is spent)."""
    from ..baselines import make_method

    label, options = method_cfg.label, method_cfg.options
    if cfg.accumulate and method_cfg.method != "dtree":
        options = {"grad_guard": False, **options}  # as mask-based and linearized trainers accumulate

    def make():
        return make_method(method_cfg.method, model, **options)

    deadline = start + cfg.time_budget if cfg.time_budget is not None else None
    peak = peak_tflops(cfg.device, cfg.dtype)
    print(f"{label}: {method_cfg.method} {options or ''}", flush=True)
    if not cfg.same_forest:
        res = measure_steps(label, method_cfg.method, make, forests, loss, model, device=cfg.device, peak=peak,
                            options=options, on_step=_progress(start), deadline=deadline,
                            max_seconds=cfg.max_config_seconds, accumulate=cfg.accumulate)
    elif deadline is not None and time.monotonic() > deadline:
        res = MethodResult(method_cfg.method, "skipped", config=label, options=options,
                           note="time budget spent before it started")
    else:
        sf = forests[0]
        res = measure_method(method_cfg.method, make, sf.forest, loss, model, device=cfg.device, warmup=cfg.warmup,
                             repeats=cfg.repeats, unique_flops=sf.unique_flops, peak=peak, config=label,
                             options=options)
        res.ideal_speedup = sf.flop_ratio
    if res.status != "ok" or res.note:
        print(f"  {label}: {res.status}" + (f" ({res.error})" if res.error else "")
              + (f"; {res.note}" if res.note else ""), flush=True)
    return res
