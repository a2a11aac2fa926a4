"""Peak memory and step time against tree size, per method (issue 10, part 5).

Two sweeps on one GPU, one model, one process:

* ``branches``: GRPO, one prompt of ``--prompt-len`` (4096) tokens and G answers of
  ``--answer-len`` (1024), G in ``--branches`` (8 .. 256);
* ``tree``: one agentic tree of at least N unique tokens (``agentic`` workload,
  ``target_unique_tokens=N``), N in ``--tree-sizes`` (16k .. 512k).

Per configuration (``dtree bench --configs`` grammar; default dtree, dtree:recompute,
tree-mask whole and split at 16k, linearized with and without checkpointing), the sizes
go up until its first out-of-memory, or until a step takes longer than its method's cap
(``--step-cap``), or would (its last step time scaled by the work: linearized tokens
for linearized, unique tokens otherwise). Sizes run in order, every configuration
still running at each size (so a cut by the global ``--time-budget`` takes the largest
sizes, and says what it skipped). Each configuration gets one warm-up step (its first
point, untimed: compilation, autotuning), then ``--steps-per-point`` steps per point;
the last one's time and the most allocated in them are reported.

Writes ``memory_scaling_<gpu>_<model>.{md,json,png}`` under ``--out``: per sweep a
table (step time / peak memory per size), the largest tree each configuration trains
and its step time there, and a plot of memory against size, one line per
configuration. On CPU (``--model tiny``, small sizes) it runs in seconds; memory is
then not measured.

    python benchmarks/bench_memory_scaling.py --out benchmarks/results          # H100: ~8 min
    python benchmarks/bench_memory_scaling.py --model tiny --branches 2,4 --prompt-len 64 \\
        --answer-len 16 --tree-sizes 600,1200 --out /tmp/ms                         # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from dtree.baselines import make_method  # noqa: E402
from dtree.bench.configs import MethodConfig, parse_assignments, parse_configs  # noqa: E402
from dtree.bench.measure import device_name, free_memory, is_out_of_memory, limit_memory, timed_step  # noqa: E402
from dtree.bench.report import environment, write_profile_reports  # noqa: E402
from dtree.bench.runner import CPU_WORKLOADS  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.presets import DTYPES, build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

DEFAULT_CONFIGS = "dtree,dtree:recompute,tree-mask:whole,tree-mask:split16k,linearized,linearized:ckpt"
# Per-method step caps (s): dtree may take longer per step, as it is the one expected
# to reach the largest trees; linearized's memory does not grow with G (fixed micro-
# batches), only its time does, so its curve is clear well before the cap.
DEFAULT_CAPS = {"dtree": 60.0, "tree-mask": 30.0, "linearized": 20.0}


def _sizes(text: str) -> list[int]:
    out = []
    for t in text.split(","):
        t = t.strip().lower()
        out.append(int(t[:-1]) * 1024 if t.endswith("k") else int(t))
    return out


@dataclass
class Point:
    """One size of a sweep: its label, the forest, and the work measures of the forest."""

    sweep: str
    label: str
    size: int  # the swept value: G, or the target unique tokens
    forest: object
    unique_tokens: int
    linearized_tokens: int


@dataclass
class Cell:
    """One (configuration, point) measurement."""

    sweep: str
    point: str
    size: int
    config: str
    method: str
    status: str  # ok, oom, error, over-cap (ran, slower than the cap), skipped
    unique_tokens: int
    linearized_tokens: int
    step_s: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None
    calls: int | None = None
    note: str | None = None
    step_times_s: list[float] = field(default_factory=list)


def _work(config: MethodConfig, unique: int, linearized: int) -> int:
    return linearized if config.method == "linearized" else unique


def _step(runner, forest, loss, model, device) -> tuple[float, float | None, float | None, int | None]:
    out, dt = timed_step(runner, forest, loss, model, device)
    if device.type != "cuda":
        return dt, None, None, out.num_model_calls
    return (dt, torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30,
            out.num_model_calls)


class Sweeper:
    """Runs the sweeps; keeps one runner per configuration (as a trainer keeps its own)."""

    def __init__(self, model, configs: list[MethodConfig], device, caps: dict[str, float], steps_per_point: int,
                 deadline: float, log=print) -> None:
        self.model, self.configs, self.device = model, configs, device
        self.caps, self.steps, self.deadline, self.log = caps, steps_per_point, deadline, log
        self.loss = ppo_clip()
        self.runners: dict[str, object] = {}
        self.warm: set[str] = set()
        self.warmup_s: dict[str, float] = {}
        self.start = time.monotonic()

    def _runner(self, config: MethodConfig):
        if config.label not in self.runners:
            self.runners[config.label] = make_method(config.method, self.model, **config.options)
        return self.runners[config.label]

    def _release(self, config: MethodConfig) -> None:
        release = getattr(self.runners.get(config.label), "release_memory", None)
        if release is not None:
            release()  # the KV stack must not count against the next configuration
        self.model.zero_grad(set_to_none=True)
        free_memory(self.device)

    def run(self, points_of: "list[tuple[str, int, callable]]", sweep: str) -> list[Cell]:
        """``points_of``: (label, size, build forest) in increasing size."""
        cells: list[Cell] = []
        stopped: dict[str, str] = {}  # config -> why it takes no larger sizes
        last: dict[str, tuple[float, int]] = {}  # config -> (step time, work) at its last point
        for label, size, build in points_of:
            if time.monotonic() > self.deadline:
                for c in self.configs:
                    cells.append(Cell(sweep, label, size, c.label, c.method, "skipped", 0, 0, note="time budget spent"))
                continue
            t0 = time.perf_counter()
            forest = build()
            unique, lin = forest.num_unique_tokens, forest.num_linearized_tokens
            self.log(f"[{time.monotonic() - self.start:7.1f} s] {sweep} {label}: {unique:,} unique / {lin:,} "
                     f"linearized tokens (built in {time.perf_counter() - t0:.1f} s)")
            for c in self.configs:
                cell = Cell(sweep, label, size, c.label, c.method, "skipped", unique, lin)
                cells.append(cell)
                cap = self.caps.get(c.method, float("inf"))
                remaining = self.deadline - time.monotonic()
                if c.label in stopped:
                    cell.note = stopped[c.label]
                    continue
                if c.label in last:
                    t_last, w_last = last[c.label]
                    predicted = t_last * _work(c, unique, lin) / max(w_last, 1) * self.steps
                    if predicted / self.steps > cap:
                        cell.note = stopped[c.label] = f"predicted step {predicted / self.steps:.0f} s > cap {cap:g} s"
                        continue
                    if predicted > remaining:
                        cell.note = f"predicted {predicted:.0f} s > {max(remaining, 0):.0f} s of time budget left"
                        continue
                elif remaining <= 0:
                    cell.note = "time budget spent"
                    continue
                self._measure(c, cell, forest)
                if cell.status in ("oom", "error"):
                    stopped[c.label] = f"{cell.status} at {label}"
                elif cell.status == "over-cap":
                    stopped[c.label] = f"step over cap ({cell.step_s:.0f} s > {cap:g} s) at {label}"
                if cell.step_s is not None:
                    last[c.label] = (cell.step_s, _work(c, unique, lin))
            del forest
        return cells

    def _measure(self, c: MethodConfig, cell: Cell, forest) -> None:
        try:
            runner = self._runner(c)
            if c.label not in self.warm:
                t0 = time.perf_counter()
                _step(runner, forest, self.loss, self.model, self.device)
                self.warmup_s[c.label] = time.perf_counter() - t0
                self.warm.add(c.label)
            peaks, reserved = [], []
            for _ in range(self.steps):
                dt, peak, res, calls = _step(runner, forest, self.loss, self.model, self.device)
                cell.step_times_s.append(dt)
                peaks.append(peak)
                reserved.append(res)
                cell.calls = calls
            cell.step_s = cell.step_times_s[-1]
            cell.peak_gib = max(peaks) if peaks[0] is not None else None
            cell.reserved_gib = max(reserved) if reserved[0] is not None else None
            cap = self.caps.get(c.method, float("inf"))
            cell.status = "over-cap" if cell.step_s > cap else "ok"
        except Exception as e:  # one configuration's failure must not end the sweep
            cell.status = "oom" if is_out_of_memory(e) else "error"
            cell.note = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            if cell.status == "oom":
                self.runners.pop(c.label, None)  # a fresh runner for the next sweep
        finally:
            self._release(c)
        mem = f", peak {cell.peak_gib:.2f} GiB" if cell.peak_gib is not None else ""
        step = f"{cell.step_s:.3f} s" if cell.step_s is not None else "-"
        self.log(f"[{time.monotonic() - self.start:7.1f} s]   {c.label:<22} {cell.status:<8} {step}{mem}"
                 + (f" ({cell.note})" if cell.note else ""))


# ----------------------------------------------------------------------------- report
def _cell_text(cell: dict) -> str:
    if cell["status"] in ("ok", "over-cap"):
        text = f"{cell['step_s']:.2f} s"
        if cell.get("peak_gib") is not None:
            text += f" / {cell['peak_gib']:.1f} GiB"
        return text + (" (over cap)" if cell["status"] == "over-cap" else "")
    if cell["status"] == "oom":
        return "**OOM**"
    if cell["status"] == "error":
        return "error"
    return "-"


def largest_trained(cells: list[dict], config: str, sweep: str) -> dict | None:
    """The largest point of ``sweep`` that ``config`` trained (ok or over the cap)."""
    done = [c for c in cells if c["config"] == config and c["sweep"] == sweep and c["status"] in ("ok", "over-cap")]
    return max(done, key=lambda c: c["size"]) if done else None


def markdown(report: dict) -> str:
    env, model = report["env"], report["model"]
    lines = [
        f"# Memory scaling: {model['name']} on {env['device']}",
        "",
        f"- torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, transformers {env['transformers']}",
        f"- model: {model['name']} ({model['params'] / 1e9:.2f}B params, {model['layers']} layers, hidden "
        f"{model['hidden']}), {model['dtype']}, random weights; weights + gradients: {model['weights_grads_gib']:.2f} GiB"
        + ("; decoder layers torch.compile'd" if report.get("compiled_layers") else "; eager decoder layers"),
        f"- one warm-up step per configuration (at its first point), then {report['steps_per_point']} step(s) per point; "
        "cells: last step's time / most allocated in the point's steps",
        f"- step caps (s): {report['caps']}; time budget {report['time_budget_s']:g} s; took {report['elapsed_s']:.0f} s",
        "- configurations: " + "; ".join(f"`{c['label']}` = {c['method']} {c['options'] or '(defaults)'}"
                                         for c in report["configs"]),
    ]
    for sweep in report["sweeps"]:
        cells = [c for c in report["cells"] if c["sweep"] == sweep["name"]]
        points = []
        for c in cells:
            if c["point"] not in [p[0] for p in points]:
                points.append((c["point"], c))
        lines += ["", f"## {sweep['title']}", "", f"{sweep['description']}", ""]
        header = ["config"] + [p for p, _ in points] + ["largest trained", "step there"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        tokens = ["unique / linearized tokens"] + [
            f"{c['unique_tokens']:,} / {c['linearized_tokens']:,}" if c["unique_tokens"] else "-" for _, c in points
        ] + ["", ""]
        lines.append("| " + " | ".join(tokens) + " |")
        for cfg in report["configs"]:
            row = [f"`{cfg['label']}`"]
            for p, _ in points:
                cell = next(c for c in cells if c["config"] == cfg["label"] and c["point"] == p)
                row.append(_cell_text(cell))
            best = largest_trained(report["cells"], cfg["label"], sweep["name"])
            row += [best["point"] if best else "none", f"{best['step_s']:.2f} s" if best else "-"]
            lines.append("| " + " | ".join(row) + " |")
        notes = sorted({f"`{c['config']}` at {c['point']}: {c['status']}, {c['note']}" for c in cells if c.get("note")})
        if notes:
            lines += ["", "Skipped or stopped:", ""] + [f"- {n}" for n in notes]
    if report.get("warmup_s"):
        lines += ["", "Warm-up steps (s): " + ", ".join(f"`{k}` {v:.1f}" for k, v in report["warmup_s"].items())]
    return "\n".join(lines) + "\n"


def chart(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = report["sweeps"]
    fig, axes = plt.subplots(2, len(sweeps), figsize=(6.5 * len(sweeps), 8), squeeze=False)
    for j, sweep in enumerate(sweeps):
        ax_mem, ax_time = axes[0][j], axes[1][j]
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for k, cfg in enumerate(report["configs"]):
            color = colors[k % len(colors)]
            cells = [c for c in report["cells"] if c["sweep"] == sweep["name"] and c["config"] == cfg["label"]]
            done = [c for c in cells if c["status"] in ("ok", "over-cap")]
            xs = [c["unique_tokens"] for c in done]
            if done:
                ax_time.plot(xs, [c["step_s"] for c in done], marker="o", color=color, label=cfg["label"])
            if done and done[0].get("peak_gib") is not None:
                ax_mem.plot(xs, [c["peak_gib"] for c in done], marker="o", color=color, label=cfg["label"])
            for c in cells:
                if c["status"] == "oom" and report.get("device_memory_gib"):  # an x at the device's memory
                    ax_mem.plot([c["unique_tokens"]], [report["device_memory_gib"]], marker="x", markersize=10,
                                color=color, label=f"{cfg['label']} OOM")
        for ax, what in ((ax_mem, "peak memory (GiB)"), (ax_time, "step time (s)")):
            if ax.lines:
                ax.set_xscale("log", base=2)
            ax.set_xlabel("unique tokens")
            ax.set_title(f"{sweep['title']}: {what}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        if ax_time.lines:
            ax_time.set_yscale("log")
        if not ax_mem.lines:
            ax_mem.text(0.5, 0.5, "no memory measured (CUDA only)", ha="center", va="center", transform=ax_mem.transAxes)
        if report.get("device_memory_gib"):
            ax_mem.axhline(report["device_memory_gib"], color="grey", ls="--", lw=0.8)
    env = report["env"]
    fig.suptitle(f"{report['model']['name']} on {env['device']}; torch {env['torch']}, CUDA {env['cuda']}, "
                 f"triton {env['triton']} (x: out of memory)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def _caps(text: str | None) -> dict[str, float]:
    caps = dict(DEFAULT_CAPS)
    for key, value in parse_assignments(text.split(",") if text else [], "--step-cap").items():
        if key not in caps:
            raise ValueError(f"--step-cap {key}: expected one of {sorted(caps)}")
        caps[key] = float(value)
    return caps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: qwen2.5-1.5b on GPU, tiny on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (every method)")
    p.add_argument("--sweeps", default="branches,tree", help="branches, tree or both (default)")
    p.add_argument("--branches", default="8,16,32,64,128,256", help="GRPO group sizes G")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--answer-len", type=int, default=1024)
    p.add_argument("--tree-sizes", default="16k,32k,64k,128k,256k,512k", help="agentic tree sizes (unique tokens)")
    p.add_argument("--set-tree", action="append", metavar="KEY=VALUE", help="agentic workload parameter (repeatable)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="dtree bench --configs grammar")
    p.add_argument("--steps-per-point", type=int, default=1)
    p.add_argument("--step-cap", default=None, metavar="METHOD=S,...",
                   help=f"per-method step time caps in seconds (default {DEFAULT_CAPS})")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds for everything (default 420)")
    p.add_argument("--memory-limit-gib", type=float, default=None, help="cap GPU memory (emulate a smaller GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    start = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    model_name = args.model or ("qwen2.5-1.5b" if device.type == "cuda" else "tiny")
    if args.memory_limit_gib:
        limit_memory(device, args.memory_limit_gib)
    configs = parse_configs(args.configs)
    caps = _caps(args.step_cap)
    sweeps = [s.strip() for s in args.sweeps.split(",") if s.strip()]
    if not sweeps or any(s not in ("branches", "tree") for s in sweeps):
        raise ValueError(f"--sweeps takes branches and/or tree, got {args.sweeps!r}")
    print(f"memory scaling: {model_name} ({dtype}) on {device_name(device)}; sweeps {sweeps}; "
          f"configurations {[c.label for c in configs]}; time budget {args.time_budget:g} s", flush=True)
    model = build_model(model_name, dtype=dtype, device=device, seed=args.seed)
    spec = adapt(model).dtree_spec()
    if args.compile:
        from dtree.models import compile_layers

        compile_layers(model)
    vocab = spec.vocab_size
    tree_params = {**(CPU_WORKLOADS["agentic"] if model_name == "tiny" and device.type == "cpu" else {}),
                   "num_trees": 1, **parse_assignments(args.set_tree, "--set-tree")}
    tree_params.pop("trajectories", None)  # the target size decides how many

    def grpo_point(g: int):
        return (f"G={g}", g, lambda: make_workload("grpo", seed=args.seed, vocab_size=vocab, num_prompts=1,
                                                   prompt_len=args.prompt_len, group_size=g, answer_len=args.answer_len))

    def tree_point(n: int):
        label = f"{n // 1024}k" if n % 1024 == 0 else str(n)
        return (label, n, lambda: make_workload("agentic", seed=args.seed, vocab_size=vocab, trajectories=1,
                                                target_unique_tokens=n, **tree_params))

    sweep_defs = {
        "branches": dict(title="Branches (GRPO)", points=[grpo_point(g) for g in _sizes(args.branches)],
                         description=f"One prompt of {args.prompt_len:,} tokens, G answers of {args.answer_len:,} "
                                     f"tokens each; G = {args.branches}."),
        "tree": dict(title="Tree size (agentic)", points=[tree_point(n) for n in _sizes(args.tree_sizes)],
                     description=f"One agentic tree (tool-use trajectories under a shared system prompt) grown to at "
                                 f"least N unique tokens; parameters {json.dumps(tree_params)}."),
    }
    # the first sweep may take up to its share of the budget; what it leaves goes to the next
    shares = {"branches": 0.4, "tree": 1.0}
    cells: list[Cell] = []
    sweeper = None
    for i, name in enumerate(sweeps):
        remaining = args.time_budget - (time.monotonic() - start)
        share = 1.0 if i == len(sweeps) - 1 else shares[name]
        deadline = time.monotonic() + max(0.0, remaining * share)
        if sweeper is None:
            sweeper = Sweeper(model, configs, device, caps, args.steps_per_point, deadline,
                              log=lambda s: print(s, flush=True))
        sweeper.deadline = deadline
        cells += sweeper.run(sweep_defs[name]["points"], name)

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    report = {
        "env": environment(device),
        "model": {"name": model_name, "dtype": str(dtype).replace("torch.", ""),
                  "params": sum(p.numel() for p in model.parameters()), "layers": spec.num_layers,
                  "hidden": spec.hidden_size, "weights_grads_gib": 2 * params / 2**30},
        "device_memory_gib": (args.memory_limit_gib or torch.cuda.get_device_properties(device).total_memory / 2**30)
        if device.type == "cuda" else None,
        "compiled_layers": bool(args.compile),
        "configs": [{"label": c.label, "method": c.method, "options": c.options} for c in configs],
        "caps": caps,
        "steps_per_point": args.steps_per_point,
        "time_budget_s": args.time_budget,
        "elapsed_s": time.monotonic() - start,
        "warmup_s": sweeper.warmup_s if sweeper else {},
        "sweeps": [{"name": n, "title": sweep_defs[n]["title"], "description": sweep_defs[n]["description"]}
                   for n in sweeps],
        "cells": [asdict(c) for c in cells],
    }
    text = markdown(report)
    stem = write_profile_reports(report, text, args.out, "memory_scaling", model_name)
    chart(report, stem + ".png")
    print(text)
    print(f"reports: {stem}.md, .json, .png", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
