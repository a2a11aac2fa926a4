"""Benchmark reports: a table on screen, and JSON, Markdown and a PNG chart on disk.

A report is a plain dict (what ``dtree bench`` builds; written as JSON as is).
:func:`finish_report` adds the derived figures: speedups over the best linearized
configuration, the best configuration of each method that fits, dtree's default
against each of them, and the loss agreement between configurations.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from typing import Any

from .configs import best_per_method
from .steady import OUTLIER_FACTOR, outlier_note, steady_ratio

__all__ = ["environment", "faster_or_slower", "finish_report", "format_table", "write_reports", "report_stem"]


def environment(device) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    from .. import __version__
    from .measure import device_name

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton is optional (absent on CPU-only installs)
        triton_version = None
    return {
        "gpu": device_name(device) if device.type == "cuda" else None,
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "dtree": __version__,
        "python": platform.python_version(),
    }


# ----------------------------------------------------------------------------- derived figures
def _fresh(report: dict) -> bool:
    return report.get("protocol", "same-forest") == "fresh-forests"


def _speedup(report: dict, slow: dict, fast: dict) -> float | None:
    """How many times faster ``fast`` is than ``slow``."""
    if _fresh(report):
        return steady_ratio(slow, fast)
    if slow.get("step_time_s") and fast.get("step_time_s"):
        return slow["step_time_s"] / fast["step_time_s"]
    return None


def _dtree_default(rows: list[dict]) -> dict | None:
    """The dtree row without options (its defaults), if it ran."""
    return next((r for r in rows if r["method"] == "dtree" and not r.get("options") and r["status"] == "ok"), None)


def finish_report(report: dict) -> None:
    """Fill in speedups over the best linearized configuration, ``best`` (per method, the
    fastest configuration that fits), ``vs_best`` (dtree's default against each), the
    loss agreement, and ``summary_lines``."""
    rows = report["results"]
    best = best_per_method(rows)
    lin = best.get("linearized")
    for r in rows:
        r["speedup_vs_linearized"] = r["fraction_of_ideal"] = None
        if lin and r["status"] == "ok" and r.get("step_time_s"):
            r["speedup_vs_linearized"] = _speedup(report, lin, r)
            # the compression bounds what computing each unique token once can save: it
            # applies to the tree methods, not to linearized configurations
            if r["speedup_vs_linearized"] and r.get("ideal_speedup") and r["method"] != "linearized":
                r["fraction_of_ideal"] = r["speedup_vs_linearized"] / r["ideal_speedup"]
    report["best"] = {m: r["config"] for m, r in best.items()}
    default = _dtree_default(rows)
    reference = default or best.get("dtree")
    vs_best = []
    if reference is not None:
        for method, r in best.items():
            vs_best.append({
                "method": method,
                "best_config": r["config"],
                "step_time_s": r["step_time_s"],
                "peak_mem_gib": r.get("peak_mem_gib"),
                "peak_reserved_gib": r.get("peak_reserved_gib"),
                "dtree": reference["config"],
                "dtree_speedup": _speedup(report, r, reference),
                "dtree_memory_ratio": (reference["peak_mem_gib"] / r["peak_mem_gib"])
                if reference.get("peak_mem_gib") and r.get("peak_mem_gib") else None,
            })
    report["vs_best"] = vs_best
    report["loss_agreement"] = _loss_agreement(report)
    lines = []
    for v in vs_best:
        if v["method"] == "dtree" and v["best_config"] == v["dtree"]:
            continue
        line = f"{v['dtree']} vs the best {v['method']} ({v['best_config']}): {faster_or_slower(v['dtree_speedup'])}"
        if v["dtree_memory_ratio"] is not None:
            line += f", {v['dtree_memory_ratio']:.0%} of its peak memory"
        lines.append(line)
    above = [r for r in rows if (r.get("fraction_of_ideal") or 0) > 1.0]
    for r in above:
        lines.append(
            f"{r['config']} reached {r['fraction_of_ideal']:.0%} of the ideal speedup: it computed its useful "
            f"FLOPs {r['fraction_of_ideal']:.2f}x as fast as the best linearized configuration computed its own "
            "(the ideal assumes equal FLOP rates); linearized ran below the rate the tree methods reached"
        )
    if report["loss_agreement"] is not None:
        lines.append(f"Loss agreement across configurations: max relative difference {report['loss_agreement']:.1e}"
                     + (" (per step, same forest)" if _fresh(report) else ""))
    report["summary_lines"] = lines


def faster_or_slower(ratio: float | None) -> str:
    """``"1.59x faster"`` or ``"1.59x slower"`` for a speed ratio (time of the other
    over time of this one): never "0.63x faster"."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x faster" if ratio >= 1.0 else f"{1.0 / ratio:.2f}x slower"


def _loss_agreement(report: dict) -> float | None:
    """Max relative difference between the losses of configurations on the same forest."""
    ok = [r for r in report["results"] if r["status"] in ("ok", "oom") and (r.get("step_losses") or r.get("loss"))]
    per_step: dict[int, list[float]] = {}
    for r in ok:
        losses = r.get("step_losses") or ([r["loss"]] if r.get("loss") is not None else [])
        for i, value in enumerate(losses):
            per_step.setdefault(i, []).append(value)
    spreads = [max(abs(v - vs[0]) for v in vs) / max(abs(vs[0]), 1e-12) for vs in per_step.values() if len(vs) > 1]
    return max(spreads) if spreads else None


# ----------------------------------------------------------------------------- tables
def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


SAME_FOREST_COLUMNS = [
    ("config", "config", "s"),
    ("status", "status", "s"),
    ("step (s)", "step_time_s", ".3f"),
    ("tokens/s", "tokens_per_s", ",.0f"),
    ("eff. tokens/s", "effective_tokens_per_s", ",.0f"),
    ("MFU", "mfu", ".1%"),
    ("peak alloc (GiB)", "peak_mem_gib", ".2f"),
    ("peak reserved (GiB)", "peak_reserved_gib", ".2f"),
    ("loss", "loss", ".6g"),
    ("speedup", "speedup_vs_linearized", ".2f"),
    ("ideal", "ideal_speedup", ".2f"),
    ("of ideal", "fraction_of_ideal", ".0%"),
    ("calls", "model_calls", "d"),
]
FRESH_COLUMNS = [
    ("config", "config", "s"),
    ("status", "status", "s"),
    ("first (s)", "first_step_s", ".3f"),
    ("second (s)", "second_step_s", ".3f"),
    ("steady mean (s)", "step_time_s", ".3f"),
    ("slowest steady (s)", "steady_max_s", ".3f"),
    ("peak alloc (GiB)", "peak_mem_gib", ".2f"),
    ("peak reserved (GiB)", "peak_reserved_gib", ".2f"),
    ("tokens/s", "tokens_per_s", ",.0f"),
    ("eff. tokens/s", "effective_tokens_per_s", ",.0f"),
    ("MFU", "mfu", ".1%"),
    ("speedup", "speedup_vs_linearized", ".2f"),
    ("ideal", "ideal_speedup", ".2f"),
    ("of ideal", "fraction_of_ideal", ".0%"),
    ("calls", "model_calls", "d"),
]


def _grid(header: list[str], body: list[list[str]], markdown: bool) -> str:
    rows = [header] + body
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def format_table(report: dict, markdown: bool = False) -> str:
    """One row per configuration (columns by protocol)."""
    columns = FRESH_COLUMNS if _fresh(report) else SAME_FOREST_COLUMNS
    body = []
    for r in report["results"]:
        cells = []
        for _, key, spec in columns:
            value = r.get(key)
            cells.append(f"`{value}`" if key == "config" and markdown else (str(value) if spec == "s" else _fmt(value, spec)))
        body.append(cells)
    return _grid([h for h, _, _ in columns], body, markdown)


def _best_table(report: dict) -> str:
    body = [
        [v["method"], f"`{v['best_config']}`", _fmt(v["step_time_s"], ".3f"), _fmt(v["peak_mem_gib"], ".2f"),
         _fmt(v.get("peak_reserved_gib"), ".2f"), faster_or_slower(v["dtree_speedup"]),
         _fmt(v["dtree_memory_ratio"], ".0%")]
        for v in report.get("vs_best", [])
    ]
    if not body:
        return ""
    ref = report["vs_best"][0]["dtree"]
    header = ["method", "best configuration (fastest that fit)", "steady step (s)", "peak alloc (GiB)",
              "peak reserved (GiB)", f"`{ref}` against it", f"`{ref}` memory (alloc)"]
    return _grid(header, body, markdown=True)


def _memory_table(report: dict) -> str:
    """Per configuration with a memory plan: predicted and measured peak (GiB, all
    allocated memory) per step, their worst ratio, and what was allocated and reserved
    after the last step."""
    rows = []
    for r in report.get("results", []):
        pred, meas = r.get("step_predicted_gib") or [], r.get("step_peak_mem_gib") or []
        pairs = [(p, m) for p, m in zip(pred, meas) if p is not None and m is not None]
        if not pairs:
            continue
        worst = max(pairs, key=lambda pm: abs(pm[1] / pm[0] - 1))
        held, reserved = (r.get("step_held_after_gib") or [None])[-1], (r.get("step_reserved_after_gib") or [None])[-1]
        rows.append(
            f"| `{r['config']}` | " + ", ".join(f"{p:.1f} / {m:.1f}" for p, m in pairs)
            + f" | {worst[1] / worst[0] - 1:+.1%} | {_gib(held)} | {_gib(reserved)} |"
        )
    if not rows:
        return ""
    return "\n".join([
        "| config | predicted / measured peak per step (GiB) | worst (measured / predicted - 1) | allocated after "
        "the last step (GiB) | reserved after it (GiB) |",
        "|---|---|---|---|---|",
        *rows,
    ])


def _gib(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _steps_table(report: dict) -> str:
    forests = report["workload"].get("forests") or []
    header = ["config"] + [f"step {i + 1}" for i in range(len(forests))]
    body = []
    for r in report["results"]:
        times = r.get("step_times_s") or []
        cells = [f"{t:.3f}" for t in times] + [r["status"] if r["status"] != "ok" else "-"] * (len(forests) - len(times))
        body.append([f"`{r['config']}`"] + cells[: len(forests)])
    body.append(["unique tokens"] + [f"{f['unique_tokens']:,}" for f in forests])
    body.append(["linearized tokens"] + [f"{f['linearized_tokens']:,}" for f in forests])
    body.append(["FLOP-weighted compression"] + [f"{f['flop_compression_ratio']:.2f}x" for f in forests])
    return _grid(header, body, markdown=True)


def _workload_line(report: dict) -> str:
    wl = report["workload"]
    forests = wl.get("forests") or []
    uniq = [f["unique_tokens"] for f in forests]
    lin = [f["linearized_tokens"] for f in forests]
    comp = [f["compression_ratio"] for f in forests]
    flop = [f["flop_compression_ratio"] for f in forests]

    def span(xs, spec):
        return format(xs[0], spec) if min(xs) == max(xs) else f"{format(min(xs), spec)}-{format(max(xs), spec)}"

    where = (f"{len(forests)} fresh forests (seeds {wl['seed']}..{wl['seed'] + len(forests) - 1})"
             if _fresh(report) else f"one forest (seed {wl['seed']})")
    return (
        f"- workload: `{wl['name']}`, {where}: {span([f['sequences'] for f in forests], ',')} sequences, "
        f"{span([f['trees'] for f in forests], ',')} trees, {span(uniq, ',')} unique / {span(lin, ',')} linearized "
        f"tokens per step, compression {statistics.fmean(comp):.2f}x (FLOP-weighted {statistics.fmean(flop):.2f}x) "
        f"on average, longest path {max(f['max_path_length'] for f in forests):,} tokens"
        + (f"\n- workload parameters: `{json.dumps(wl['params'])}`" if wl.get("params") else "")
    )


def _markdown(report: dict) -> str:
    env, model = report["env"], report["model"]
    fresh = _fresh(report)
    protocol = (
        f"{report['steps']} steps per configuration, a fresh forest each; first and second steps apart, steady = "
        f"mean of steps 3..N but any over {OUTLIER_FACTOR:g}x their median (tokens/s and MFU over those steps, each "
        "with its own unique-token FLOPs); the "
        "configurations run one after the other in one process, so compilation and autotuning land in the first "
        "step of the first configuration that needs them (benchmarks/profile_warmup.py measures fresh processes), "
        "and the first configuration of a method to meet each fresh forest pays that forest's once-per-shape costs "
        "(0.3-0.5 s a step on a 64k agentic tree on an H200)"
        if fresh else f"one forest; median of {report['repeats']} steps after {report['warmup']} warm-up"
    )
    if report.get("accumulate"):
        protocol += ("; gradients accumulated: cleared before a configuration's first step only, so every later "
                     "step adds to them (the micro-batches of one optimizer step; the baselines accumulate in place)")
    limits = []
    if report.get("memory_limit_gib"):
        limits.append(f"GPU memory capped at {report['memory_limit_gib']:g} GiB")
    if report.get("time_budget_s") is not None:
        limits.append(f"time budget {report['time_budget_s']:g} s")
    if report.get("max_config_seconds"):
        limits.append(f"at most {report['max_config_seconds']:g} s per configuration")
    lines = [
        f"# dtree bench: {model['name']} on `{report['workload']['name']}`" + (" (fresh forests)" if fresh else ""),
        "",
        f"- device: {env['device']}; torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, dtree {env['dtree']}, python {env['python']}",
        f"- model: {model['name']} ({model['params'] / 1e9:.2f}B params, {model['layers']} layers, hidden "
        f"{model['hidden']}, intermediate {model.get('intermediate', '?')}, heads {model['heads']}/{model['kv_heads']} kv, "
        f"head_dim {model['head_dim']}, vocab {model['vocab']}), {model['dtype']}, random weights",
        _workload_line(report),
        f"- decoder layers, the same for every method: {report.get('layers', 'eager')}"
        + ("; torch.compile (dynamic shapes)" if report.get("compiled_layers") else "")
        + (f"; {'; '.join(limits)}" if limits else ""),
        f"- CUDA allocator: `PYTORCH_CUDA_ALLOC_CONF={report['allocator']}`, for every method"
        if report.get("allocator") else "- CUDA allocator: default settings",
        f"- loss: {report['loss']}; step = forward + backward over the whole forest; {protocol}",
        "- configurations: " + "; ".join(f"`{c['label']}` = {c['method']} {c['options'] or '(defaults)'}"
                                         for c in report.get("configs", [])),
        "",
        format_table(report, markdown=True),
        "",
        "Speedup is over the best linearized configuration in the same run"
        + (" (over the steady steps both ran)" if fresh else "")
        + "; ideal = FLOP-weighted compression ratio, the speedup computing each unique token once gives at equal "
        "FLOP rates; of ideal = speedup / ideal, i.e. the configuration's rate of useful FLOPs (unique tokens) "
        "relative to the best linearized configuration's (above 100% when linearized runs at a lower FLOP rate, "
        "e.g. its attention sequence by sequence; not a speedup beyond the compression); MFU counts the FLOPs of "
        "the unique tokens only; "
        "peak alloc is the most allocated in any step, peak reserved the most the caching allocator held "
        "(allocated plus fragmentation).",
    ]
    best = _best_table(report)
    if best:
        lines += ["", "## Best configuration of each method", "", best]
    if report.get("summary_lines"):
        lines += [""] + [f"- {s}" for s in report["summary_lines"]]
    if fresh:
        lines += ["", "## Step times (s)", "", _steps_table(report)] + outlier_note(report["results"])
        memory = _memory_table(report)
        if memory:
            lines += ["", "## Memory: the plan's predicted peak against the measured one, and what a step leaves",
                      "", memory]
    notes = []
    for r in report["results"]:
        if r.get("error") or r.get("note"):
            notes.append(f"- `{r['config']}` {r['status']}: " + "; ".join(x for x in (r.get("error"), r.get("note")) if x))
        extra = dict(r.get("metrics") or {})
        if r.get("allocator"):
            extra["allocator"] = r["allocator"]
        if extra:
            notes.append(f"- `{r['config']}` (last step): {json.dumps(extra, sort_keys=True)}")
    if notes:
        lines += ["", "## Notes", ""] + notes
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- files
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def report_stem(report: dict) -> str:
    env = report["env"]
    hw = env["gpu"] or "cpu"
    parts = (hw, report["model"]["name"], report["workload"]["name"], "compiled" if report.get("compiled_layers") else "",
             report.get("tag") or "")
    return "_".join(_slug(x) for x in parts if x)


def _chart(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = [r["config"] for r in res]
    fresh = _fresh(report)
    fig, axes = plt.subplots(1, 3 if fresh else 2, figsize=(15 if fresh else 10, 4.5))
    ax_time, ax_mem = axes[-2], axes[-1]
    if fresh:
        for r in res:
            if r.get("step_times_s"):
                axes[0].plot(range(1, len(r["step_times_s"]) + 1), r["step_times_s"], marker="o", label=r["config"])
        axes[0].set_yscale("log")
        axes[0].xaxis.get_major_locator().set_params(integer=True)
        axes[0].set_xlabel("step (fresh forest each)")
        axes[0].set_title("step time (s)")
        if axes[0].lines:
            axes[0].legend(fontsize=7)
    times = [r["step_time_s"] or 0 for r in res]
    bars = ax_time.bar(range(len(res)), times, color="#4477aa")
    ax_time.set_title("steady step time (s)" if fresh else "step time (s)")
    for b, r in zip(bars, res):
        label = r["status"] if r["status"] != "ok" else (f"{r['speedup_vs_linearized']:.2f}x"
                                                          if r.get("speedup_vs_linearized") else "")
        ax_time.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    mem = [r["peak_mem_gib"] or 0 for r in res]
    ax_mem.bar(range(len(res)), mem, color="#cc6677")
    ax_mem.set_title("peak memory (GiB)" if any(mem) else "peak memory (not measured on CPU)")
    for ax in (ax_time, ax_mem):
        ax.set_xticks(range(len(res)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    env = report["env"]
    fig.suptitle(
        f"{report['model']['name']} / {report['workload']['name']} on {env['gpu'] or env['device']}; "
        f"torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_profile_reports(report: dict, text: str, out_dir: str, kind: str, model_name: str) -> str:
    """The benchmark scripts' reports: ``<out_dir>/<kind>_<gpu or cpu>_<model_name>.md``
    (``text``) and ``.json`` (``report``, which has ``env`` from :func:`environment`).
    Returns the path stem."""
    os.makedirs(out_dir, exist_ok=True)
    hw = (report["env"]["gpu"] or "cpu").lower().replace(" ", "-")
    stem = os.path.join(out_dir, f"{kind}_{hw}_{model_name}")
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
    return stem


def write_reports(report: dict, out_dir: str, chart: bool = True) -> dict[str, str]:
    """Write ``<stem>.json``, ``.md`` (and ``.png`` with ``chart``) under ``out_dir``;
    returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, report_stem(report))
    paths = {"json": stem + ".json", "md": stem + ".md"}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=False)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(_markdown(report))
    if chart:
        paths["png"] = stem + ".png"
        _chart(report, paths["png"])
    return paths
