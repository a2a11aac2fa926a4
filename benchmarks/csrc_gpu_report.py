"""The Markdown (and JSON) report of ``benchmarks/csrc_gpu.py``: issue 21's targets first,
then the launches, the interleaved step times with the memory plan each configuration
ran, the GPU kernel time behind the differences, the stack glue alone and determinism."""

from __future__ import annotations

import json
import os
from collections import defaultdict

from benchmarks.profile_step import classify

__all__ = ["BASELINE_PER_LAYER_PER_CALL", "kernel_summary", "report", "write"]

# The issue's baseline: one default case-1 step, torch ops, HF's eager layers (H100 session C)
BASELINE_PER_LAYER_PER_CALL = 148.9
LABELS = {"ext": "default, extension", "ops": "default, torch ops", "det": "deterministic, extension"}
LAUNCH_ROWS = {
    "eager": "HF eager model, `lean_layers=False`",
    "default": "HF eager model, dtree's defaults (lean layers during its steps)",
    "bench": "the bench's layers",
}


def kernel_summary(breakdown: dict[str, dict]) -> dict:
    """Per configuration: launches and GPU time in total and by class; and the kernels
    whose time differs most between the deterministic and default steps, and between the
    extension's and the torch ops' steps."""
    out = {"totals": {}, "diffs": {}}
    for key, kernels in breakdown.items():
        by_class = defaultdict(float)
        for name, (_, us) in kernels.items():
            by_class[classify(name)] += us
        out["totals"][key] = {
            "launches": sum(c for c, _ in kernels.values()), "gpu_ms": sum(us for _, us in kernels.values()) / 1e3,
            **{f"{c}_ms": v / 1e3 for c, v in sorted(by_class.items())},
        }
    for label, (a, b) in {"det_vs_ext": ("det", "ext"), "ext_vs_ops": ("ext", "ops")}.items():
        names = set(breakdown[a]) | set(breakdown[b])
        rows = [
            (name, breakdown[a].get(name, [0, 0.0]), breakdown[b].get(name, [0, 0.0])) for name in names
        ]
        rows.sort(key=lambda r: -abs(r[1][1] - r[2][1]))
        out["diffs"][label] = [
            {"kernel": name[:90], "launches": [x[0], y[0]], "ms": [x[1] / 1e3, y[1] / 1e3]} for name, x, y in rows[:8]
        ]
    return out


def _pct(new: float, old: float) -> str:
    return f"{(new / old - 1) * 100:+.1f}%"


def _plan_text(key) -> str:
    """A plan key (group_tokens, checkpoint_layers, path, logprob_chunk, calls, recomputed)."""
    g, k, p, c, calls, rec = key
    return f"calls of <= {g} tokens ({calls} calls), {k} layers ckpt, path {p}, head chunk {c}, {rec} recomputed"


def _targets(result: dict) -> list[str]:
    lines = ["## Issue 21's targets", "", "| target | measured | met |", "|---|---|---|"]
    for name, c in result.get("cost", {}).items():
        det = c["paired"]["det_vs_ext"]
        med = c["configs"]["det"]["median_s"] / c["configs"]["ext"]["median_s"] - 1
        lines.append(f"| deterministic cost <= 5%, {name} | {med * 100:+.1f}% (medians), {det * 100:+.1f}% "
                     f"(paired) | {'yes' if max(med, det) <= 0.05 else 'no'} |")
        ext = c["paired"]["ext_vs_ops"]
        worst = c["configs"]["ext"]["median_s"] / c["configs"]["ops"]["median_s"] - 1
        low, high = c.get("paired_interval", {}).get("ext_vs_ops", (ext, ext))
        lines.append(f"| no step slower with the extension, {name} ({len(c['configs']['ext']['steps_s'])} rounds) | "
                     f"{worst * 100:+.1f}% (medians), {ext * 100:+.1f}% (paired; 90% interval {low * 100:+.1f}% "
                     f"to {high * 100:+.1f}%) | {'yes' if max(worst, ext) <= 0.01 else 'no'} |")
    launches = result.get("launches", {})
    for key in ("default", "bench"):
        if key in launches:
            x = launches[key]["extension"]["per_layer_per_call"]
            lines.append(f"| launches per layer per call -30% vs {BASELINE_PER_LAYER_PER_CALL} | {x:.1f} "
                         f"({_pct(x, BASELINE_PER_LAYER_PER_CALL)}), {LAUNCH_ROWS[key]} + extension "
                         f"| {'yes' if x <= 0.7 * BASELINE_PER_LAYER_PER_CALL else 'no'} |")
    det = result.get("determinism", {}).get("deterministic")
    if det:
        lines.append(f"| bitwise-identical gradients, 3 runs, 32k agentic | {det['unequal_parameters']} of "
                     f"{result['determinism']['parameters']} parameters differ | "
                     f"{'yes' if det['bitwise_identical'] else 'no'} |")
    return lines + ["", "(a paired figure: the median over rounds of one configuration's step over the other's, "
                    "the two steps run back to back; 'no step slower' allows 1% for noise)", ""]


def _launch_lines(result: dict) -> list[str]:
    lines = [
        "## Launches (grpo case 1, one default step after a warm-up)",
        "",
        "Every CUDA-device event of the step (kernels, memcpy, memset), as the issue's baseline "
        f"({BASELINE_PER_LAYER_PER_CALL} per layer per call: torch ops, eager layers) counted them.",
        "",
        "| layers | stack ops | kernels | model calls | per layer per call | vs the baseline | vs torch ops |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {**LAUNCH_ROWS, "bench": f"{LAUNCH_ROWS['bench']} ({result.get('layers', '?')})"}
    for layers, rows in result["launches"].items():
        for label in ("torch ops", "extension"):
            x = rows[label]
            lines.append(
                f"| {names[layers]} | {label} | {x['kernels']} | {x['model_calls']} | {x['per_layer_per_call']:.1f} | "
                f"{_pct(x['per_layer_per_call'], BASELINE_PER_LAYER_PER_CALL)} | "
                f"{_pct(x['per_layer_per_call'], rows['torch ops']['per_layer_per_call'])} |"
            )
    return lines + [""]


def _vs_default(key: str, c: dict) -> str:
    """A configuration's step against the default's (the extension's against the torch
    ops' for the torch-ops row): by the medians and paired."""
    med = {k: x["median_s"] for k, x in c["configs"].items()}
    if key == "ops":
        return f"{_pct(med['ext'], med['ops'])} / {c['paired']['ext_vs_ops'] * 100:+.1f}% (extension vs torch ops)"
    if key == "det":
        return f"{_pct(med['det'], med['ext'])} / {c['paired']['det_vs_ext'] * 100:+.1f}%"
    return "-"


def _time_lines(name: str, c: dict, unique: int) -> list[str]:
    lines = [
        f"### {name} ({unique} unique tokens)",
        "",
        "| configuration | backend | median | min | max | steps | vs default, extension (medians / paired) "
        "| peak GiB | cudaMallocs per step (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, x in c["configs"].items():
        peaks = [s["peak_gib"] for s in x["steps"] if s["peak_gib"] is not None]
        mallocs = sorted(s["cuda_mallocs"] for s in x["steps"])
        memory = f"{max(peaks):.1f} | {mallocs[len(mallocs) // 2]}" if peaks else "- | -"
        lines.append(
            f"| {x['label']} | {x['backend']} | {x['median_s']:.3f} s | {x['min_s']:.3f} | {x['max_s']:.3f} | "
            f"{len(x['steps_s'])} | {_vs_default(key, c)} | {memory} |"
        )
    lines += ["", "Steps (s), in the order they ran: " + "; ".join(
        f"{x['label']}: " + ", ".join(f"{s:.3f}" for s in x["steps_s"]) for x in c["configs"].values()), ""]
    return lines + _plan_lines(c) + _kernel_lines(c["kernels"])


def _plan_lines(c: dict) -> list[str]:
    lines = ["Memory plans (chosen by each configuration's own policy in its last warm-up step):", ""]
    for key, plan in c["unpinned_plans"].items():
        lines.append(f"- {LABELS[key]}: calls of <= {plan['group_tokens']} tokens ({plan['model_calls']} calls), "
                     f"{plan['checkpoint_layers']} layers checkpointed, path {plan['path_checkpoint_layers']}, "
                     f"head chunk {plan['logprob_chunk']}, {plan['recomputed_tokens']} tokens recomputed")
    if c["pinned"]:
        lines.append(f"- **the plans differed: all three configurations were pinned to the default's** "
                     f"(`{c['pinned']}`) and warmed up again before the timed rounds")
    timed = sorted({_plan_text(tuple(p)) for x in c["configs"].values() for p in x["plans"]})
    verdict = "one plan in every timed step of every configuration" if c["same_plan"] else \
        "**the timed steps ran different plans**: " + "; ".join(timed)
    lines += [f"- timed steps: {verdict}" + (f" ({timed[0]})" if c["same_plan"] else ""), ""]
    return lines


def _kernel_lines(k: dict) -> list[str]:
    classes = sorted({c for t in k["totals"].values() for c in t if c.endswith("_ms") and c != "gpu_ms"})
    lines = [
        "GPU kernel time of one profiled step of each (after the timed rounds):",
        "",
        "| configuration | launches | GPU ms | " + " | ".join(c.removesuffix("_ms") + " ms" for c in classes) + " |",
        "|---|---|---|" + "---|" * len(classes),
    ]
    for key, t in k["totals"].items():
        lines.append(f"| {LABELS[key]} | {t['launches']} | {t['gpu_ms']:.1f} | "
                     + " | ".join(f"{t.get(c, 0.0):.1f}" for c in classes) + " |")
    for label, title in (("det_vs_ext", "deterministic - default"), ("ext_vs_ops", "extension - torch ops")):
        lines += ["", f"Largest differences, {title} (launches, ms):", ""]
        for row in k["diffs"][label]:
            (la, lb), (ma, mb) = row["launches"], row["ms"]
            lines.append(f"- `{row['kernel']}`: {la} vs {lb} launches, {ma:.2f} vs {mb:.2f} ms ({ma - mb:+.2f})")
    return lines + [""]


def _glue_lines(result: dict) -> list[str]:
    lines = [
        "## Stack glue alone (one call with grad: a layer's push + seed, the call's zeroing / layers)",
        "",
        "| call | rows | stack ops | launches per layer | push + seed per layer (us) | zeroing per call (us) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["glue"].items():
        for label in ("torch ops", "extension"):
            x = row[label]
            lines.append(f"| {name} | {row['rows']} | {label} | {x['launches_per_layer']:.2f} | "
                         f"{x['layer_us']:.1f} | {x['call_us']:.1f} |")
    return lines + [""]


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
    for label in ("default", "deterministic"):
        d = det[label]
        if "plans" in d:
            pairs = ", ".join(f"runs {k}: {n}" for k, n in d["unequal_by_pair"].items())
            lines += ["", f"{label}: parameters not equal by pair of runs: {pairs}; plans: "
                      + ("one plan in every run, " + d["plans"][0] if d["same_plan"] else "; ".join(d["plans"]))]
    return lines + [""]


def report(result: dict) -> str:
    """The Markdown of what has run so far."""
    env = result["env"]
    lines = [
        "# KV-stack CUDA extension (issue 21)",
        "",
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"transformers {env['transformers']}; model {result['model']}, {result['dtype']}; "
        f"layers after the launch count on eager ones: {result.get('layers', '(not yet applied)')}; "
        f"allocator: {result.get('allocator') or 'default'}; extension: {result['extension'] or 'loaded'}",
        "",
        f"Protocol: one model; per workload three runtimes ({'; '.join(LABELS.values())}), each with "
        f"{result['warmup']} warm-up steps, then rounds of one timed step each, the order rotating every round "
        f"({result['steps']} rounds on the 64k tree, {5 * result['steps']} on case 1); a garbage collection "
        f"before every step, outside its timing; the memory plan of every step recorded.",
        "",
    ]
    if result["extension"]:
        lines += [f"**The extension is not in use ({result['extension']}): its rows ran the torch ops.**", ""]
    if result.get("cost") or result.get("determinism"):
        lines += _targets(result)
    if result.get("launches"):
        lines += _launch_lines(result)
    if result.get("cost"):
        lines += ["## Step time, interleaved", ""]
        for name, c in result["cost"].items():
            lines += _time_lines(name, c, result["forests"][name])
    if result.get("glue"):
        lines += _glue_lines(result)
    if result.get("determinism"):
        lines += _determinism_lines(result)
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
