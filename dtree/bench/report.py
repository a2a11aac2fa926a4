"""Benchmark reports: a table on screen, and JSON, Markdown and a PNG chart on disk."""

from __future__ import annotations

import json
import os
import re
from typing import Any

__all__ = ["format_table", "write_reports", "environment"]


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


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


COLUMNS = [
    ("method", "method", "s"),
    ("status", "status", "s"),
    ("step (s)", "step_time_s", ".3f"),
    ("tokens/s", "tokens_per_s", ",.0f"),
    ("eff. tokens/s", "effective_tokens_per_s", ",.0f"),
    ("MFU", "mfu", ".1%"),
    ("peak mem (GiB)", "peak_mem_gib", ".2f"),
    ("loss", "loss", ".6g"),
    ("speedup", "speedup_vs_linearized", ".2f"),
    ("ideal", "ideal_speedup", ".2f"),
    ("of ideal", "fraction_of_ideal", ".0%"),
    ("calls", "model_calls", "d"),
]


def format_table(results: list[dict], markdown: bool = False) -> str:
    rows = [[h for h, _, _ in COLUMNS]]
    for r in results:
        rows.append([_fmt(r.get(k), spec) if spec != "s" else str(r.get(k)) for _, k, spec in COLUMNS])
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def report_stem(report: dict) -> str:
    env = report["env"]
    hw = env["gpu"] or "cpu"
    parts = (hw, report["model"]["name"], report["workload"]["name"], "compiled" if report.get("compiled_layers") else "",
             report.get("tag") or "")
    return "_".join(_slug(x) for x in parts if x)


def _markdown(report: dict) -> str:
    env, model, wl = report["env"], report["model"], report["workload"]
    lines = [
        f"# dtree bench: {model['name']} on `{wl['name']}`",
        "",
        f"- device: {env['device']}; torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, dtree {env['dtree']}",
        f"- model: {model['name']} ({model['params'] / 1e9:.2f}B params, {model['layers']} layers, hidden "
        f"{model['hidden']}, heads {model['heads']}/{model['kv_heads']} kv, head_dim {model['head_dim']}, "
        f"vocab {model['vocab']}), {model['dtype']}, random weights",
        f"- workload: `{wl['name']}` {wl.get('params') or ''}: {wl['sequences']} sequences, {wl['trees']} trees, "
        f"{wl['unique_tokens']:,} unique / {wl['linearized_tokens']:,} linearized tokens, "
        f"compression {wl['compression_ratio']:.2f}x (FLOP-weighted {wl['flop_compression_ratio']:.2f}x), "
        f"longest path {wl['max_path_length']:,} tokens",
        f"- decoder layers: {'torch.compile (dynamic shapes), for every method' if report.get('compiled_layers') else 'eager'}"
        + (f"; GPU memory capped at {report['memory_limit_gib']:g} GiB" if report.get("memory_limit_gib") else ""),
        "- method options: "
        + (", ".join(f"{m} {o}" for m, o in (report.get("method_options") or {}).items() if o) or "defaults"),
        f"- loss: {report['loss']}; step = forward + backward over the whole forest; median of "
        f"{report['repeats']} after {report['warmup']} warm-up",
        "",
        format_table(report["results"], markdown=True),
        "",
        "Speedup is over linearized training in the same run; ideal = FLOP-weighted compression ratio; "
        "MFU counts the FLOPs of the unique tokens only.",
    ]
    for r in report["results"]:
        if r.get("error"):
            lines.append(f"\n- `{r['method']}` {r['status']}: {r['error']}")
        if r.get("metrics"):
            lines.append(f"\n- `{r['method']}` metrics: {json.dumps(r['metrics'], sort_keys=True)}")
    if report.get("notes"):
        lines += ["", report["notes"]]
    return "\n".join(lines) + "\n"


def _chart(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = [r["method"] for r in res]
    thr = [r["effective_tokens_per_s"] or 0 for r in res]
    mem = [r["peak_mem_gib"] or 0 for r in res]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    bars = axes[0].bar(names, thr, color="#4477aa")
    axes[0].set_title("effective (linearized) tokens/s")
    for b, r in zip(bars, res):
        label = r["status"] if r["status"] != "ok" else f"{r['speedup_vs_linearized'] or 0:.2f}x"
        axes[0].annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
    axes[1].bar(names, mem, color="#cc6677")
    axes[1].set_title("peak memory (GiB)" if any(mem) else "peak memory (not measured on CPU)")
    env = report["env"]
    fig.suptitle(
        f"{report['model']['name']} / {report['workload']['name']} on {env['gpu'] or env['device']}\n"
        f"torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(report: dict, out_dir: str) -> dict[str, str]:
    """Write ``<stem>.json``, ``.md`` and ``.png`` under ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, report_stem(report))
    paths = {"json": stem + ".json", "md": stem + ".md", "png": stem + ".png"}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=False)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(_markdown(report))
    _chart(report, paths["png"])
    return paths
