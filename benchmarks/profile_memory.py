"""What makes up dtree's peak memory on one step (issue 11 item 4: profile the fixed
costs before building a low-memory setting).

For each configuration (default: dtree's low-memory setting, its default, recompute
mode), on one agentic tree of ~21k unique tokens (the issue's DTA comparison case):
a warm-up step, then one step under ``torch.cuda.memory._record_memory_history``
(Python stacks), then one untraced step for the time. The allocator trace is replayed
to the moment of the peak, and the blocks alive then are attributed:

* weights, and the gradients (by address: ``param.grad`` storages);
* the KV stack (the runtime's stack tensors, by address, or allocations made in
  ``dtree/kv_stack*``);
* the LM head: ``[rows, vocab]`` logits chunks, their gradient, the float32 weight-
  gradient accumulator (allocations made in ``dtree/ops/logprobs/interface.py``);
* stack attention (allocations made in ``dtree/ops/stack_attention*``);
* decoder-layer activations of the forward (allocated under transformers / torch.nn),
  and backward temporaries (allocated inside ``torch.autograd.backward``);
* fragmentation: reserved minus allocated at the peak.

Printed and written (``memory_profile_<gpu>_<model>.md/.json``): per configuration the
peak, the breakdown, and the top allocation sites alive at the peak; next to the
measurement, what dtree's memory policy predicted for the step by part
(:mod:`dtree.plan.memory_policy`; weights and the stack held from the previous step added).
On CPU there is no allocator trace: only the step times. The process runs with
``expandable_segments`` like ``dtree bench`` (``--no-expandable-segments`` to compare), and
every method runs the same decoder-layer kernels, as in ``dtree bench`` (``--layers``,
default ``auto``: dtree's lean layers where the family has them; ``eager`` gives the
baselines HF's own layers and dtree too).

    python benchmarks/profile_memory.py --out benchmarks/results          # H100: ~2 min
    python benchmarks/profile_memory.py --model tiny --set target_unique_tokens=800 --set system_prompt_len=64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from dtree.baselines import make_method  # noqa: E402
from dtree.bench.configs import MethodConfig, parse_assignments, parse_configs  # noqa: E402
from dtree.bench.layers import LAYER_CHOICES, bench_layers, dtree_layer_options  # noqa: E402
from dtree.bench.measure import device_name, free_memory, timed_step, use_expandable_segments  # noqa: E402
from dtree.bench.report import environment, write_profile_reports  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.presets import build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

DEFAULT_CONFIGS = "dtree:low,dtree,dtree:recompute"
DEFAULT_SET = ["num_trees=1", "target_unique_tokens=21000"]

# Attribution rules, in order: the first whose path fragment appears in an allocation's
# Python stack names its category.
FRAME_RULES = (
    ("dtree/ops/logprobs", "LM head (logits chunks, their gradient, weight-grad accumulator)"),
    ("dtree/kv_stack", "KV stack"),
    ("dtree/ops/stack_attention", "stack attention (kernel outputs, workspace)"),
    ("torch/utils/checkpoint", "checkpointed layers re-run in backward"),
    ("torch/autograd/", "backward temporaries (activation gradients)"),
    ("dtree/losses", "loss terms"),
    ("transformers/", "decoder-layer activations (forward)"),
    ("torch/nn/", "decoder-layer activations (forward)"),
)


def _frames_text(frames: list[dict]) -> list[str]:
    return [str(f.get("filename", "")).replace("\\", "/") for f in frames]


def categorize(frames: list[dict]) -> str:
    files = _frames_text(frames)
    for fragment, category in FRAME_RULES:
        if any(fragment in f for f in files):
            return category
    return "other"


def site(frames: list[dict]) -> str:
    """The innermost frame in dtree or transformers code (else the innermost one)."""
    for f in frames:
        name = str(f.get("filename", "")).replace("\\", "/")
        if "/dtree/" in name or "/transformers/" in name:
            return f"{name.split('/site-packages/')[-1].split('/wt/')[-1]}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "(no stack)"


def peak_moment(trace: list[dict], index: int, depth: int = 10) -> list[str]:
    """The dtree and transformers frames (innermost first, at most ``depth``) of the
    allocation that reached the peak (``trace[index]``): what the step was doing then."""
    if not 0 <= index < len(trace):
        return []
    frames = trace[index].get("frames") or []
    out = []
    for f in frames:
        name = str(f.get("filename", "")).replace("\\", "/")
        if "/dtree/" in name or "/transformers/" in name:
            out.append(f"{name.split('/site-packages/')[-1].split('/wt/')[-1]}:{f.get('line')} {f.get('name')}")
    return out[:depth]


def replay_peak(trace: list[dict], start_allocated: int, start_reserved: int) -> dict:
    """Replay an allocator trace (``snapshot["device_traces"][device]`` entries) that began
    with ``start_allocated`` / ``start_reserved`` bytes in use.

    Returns the peak of allocated bytes, the reserved bytes at that moment, the traced
    blocks alive then (``{addr: entry}``), and the blocks from before the trace that had
    been freed by then (``{addr: bytes}``): a free of a block that is not in the trace
    (allocated before recording) counts against the starting bytes.
    """
    def walk(stop: int | None):
        live: dict[int, dict] = {}
        cur = best = 0
        best_i = -1
        reserved = best_reserved = start_reserved
        pre_freed: dict[int, int] = {}
        best_pre_freed: dict[int, int] = {}
        for i, e in enumerate(trace):
            action = e["action"]
            if action == "alloc":
                live[e["addr"]] = e
                cur += e["size"]
            elif action == "free_requested":
                if live.pop(e["addr"], None) is None:
                    pre_freed[e["addr"]] = e["size"]
                cur -= e["size"]
            elif action == "segment_alloc":
                reserved += e["size"]
            elif action == "segment_free":
                reserved -= e["size"]
            if cur > best:
                best, best_i, best_reserved, best_pre_freed = cur, i, reserved, dict(pre_freed)
            if stop is not None and i == stop:
                break
        return live, best, best_i, best_reserved, best_pre_freed

    _, peak_delta, peak_i, reserved, pre_freed = walk(None)
    live = walk(peak_i)[0] if peak_i >= 0 else {}
    return {
        "peak_allocated": start_allocated + peak_delta,
        "reserved_at_peak": reserved,
        "live": live,
        "pre_existing_freed": pre_freed,
        "event_index": peak_i,
    }


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


def _stack_tensors(runner) -> dict[str, torch.Tensor]:
    """The runtime's stack tensors by name: each KV stack's (one per attention shape) and the
    recurrent states' (none for the baselines)."""
    stacks = getattr(runner, "_stack", None)
    if stacks is None:
        return {}
    out = {f"{k}{i}": v for i, kv in enumerate(stacks.kv) for k, v in vars(kv).items() if isinstance(v, torch.Tensor)}
    if stacks.states is not None:
        out.update({f"state {key}": t for key, t in stacks.states.value.items()})
        out.update({f"grad state {key}": t for key, t in (stacks.states.grad or {}).items()})
    return out


def stack_storages(runner) -> dict[int, tuple[str, int]]:
    """``{storage address: (category, bytes)}`` of the stacks: K/V values, recurrent states, their gradients."""
    out = {}
    for name, t in _stack_tensors(runner).items():
        what = "gradients" if name.startswith("grad") else "states" if name.startswith("state") else "K/V"
        owner = "state stack" if "state" in name else "KV stack"
        out[t.untyped_storage().data_ptr()] = (f"{owner}: {what} ({str(t.dtype).replace('torch.', '')})",
                                               t.untyped_storage().nbytes())
    return out


def breakdown(peak: dict, start_allocated: int, weights: int, grads: dict[int, int],
              stack: dict[int, tuple[str, int]], stack_before: dict[int, tuple[str, int]]
              ) -> tuple[dict[str, int], list[tuple[str, str, int, int]]]:
    """Bytes per category at the peak, and the top (category, site, bytes, blocks).

    ``grads``: ``{storage address: bytes}`` of the gradients after the step; ``stack``,
    ``stack_before``: the KV stack's ``{address: (category, bytes)}`` after the step and
    before it (the runtime keeps its stack between steps)."""
    cats: dict[str, int] = defaultdict(int)
    sites: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for addr, e in peak["live"].items():
        if addr in grads:
            cat = "gradients"
        elif addr in stack:
            cat = stack[addr][0]
        else:
            cat = categorize(e.get("frames") or [])
        cats[cat] += e["size"]
        entry = sites[(cat, site(e.get("frames") or []))]
        entry[0] += e["size"]
        entry[1] += 1
    freed = peak["pre_existing_freed"]
    before = start_allocated - sum(freed.values())
    stack_kept = 0
    for addr, (cat, n) in stack_before.items():
        if addr not in freed:
            cats[f"{cat}, kept from the previous step"] += n
            stack_kept += n
    cats["weights"] += weights
    cats["other, from before the step"] += max(0, before - weights - stack_kept)
    cats["fragmentation (reserved - allocated)"] = peak["reserved_at_peak"] - peak["peak_allocated"]
    top = sorted(((c, s, b, n) for (c, s), (b, n) in sites.items()), key=lambda x: -x[2])
    return dict(cats), top


def predicted(spec, runner, dtype: torch.dtype, params: int, out) -> dict[str, float]:
    """What dtree's memory policy predicted for the step, by part, in bytes (what was held
    when the step started, the weights at least, added); empty for the baselines."""
    plan = getattr(runner, "memory_plan", None)
    if plan is None or not plan.parts:
        return {}
    itemsize = torch.empty((), dtype=dtype).element_size()
    start = getattr(plan, "start_bytes", 0.0) or params * itemsize
    parts = {"held at the start (weights, ...)": start, **plan.parts}
    parts["total"] = sum(parts.values())
    return parts


def _start_recording() -> None:
    """Allocator history with Python stacks, earlier history cleared where torch can."""
    import inspect

    record = torch.cuda.memory._record_memory_history
    kw = dict(max_entries=2_000_000, stacks="python")
    try:
        if "clear_history" in inspect.signature(record).parameters:
            kw["clear_history"] = True
    except (TypeError, ValueError):  # no signature: call without it
        pass
    record(**kw)


def profile_config(config, model, forest, loss, device, spec, params: int, top: int) -> dict:
    runner = make_method(config.method, model, **config.options)
    out, warm_s = timed_step(runner, forest, loss, model, device)
    result = {"config": config.label, "options": config.options, "warmup_s": warm_s, "calls": out.num_model_calls,
              "peak_graph_tokens": out.peak_graph_tokens, "metrics": dict(out.metrics or {})}
    if device.type == "cuda":
        result["warmup_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        model.zero_grad(set_to_none=True)
        stack_before = stack_storages(runner)
        start_allocated, start_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        _start_recording()
        offset = len(torch.cuda.memory._snapshot()["device_traces"][index])  # events an earlier recording left
        try:
            out, traced_s = timed_step(runner, forest, loss, model, device)
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][index][offset:]
        peak = replay_peak(trace, start_allocated, start_reserved)
        grads = _storages(p.grad for p in model.parameters())
        stack = stack_storages(runner)
        cats, sites = breakdown(peak, start_allocated, params * torch.empty((), dtype=next(model.parameters()).dtype)
                                .element_size(), grads, stack, stack_before)
        result.update({
            "traced_s": traced_s,
            "trace_events": len(trace),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "replayed_peak_gib": peak["peak_allocated"] / 2**30,
            "reserved_at_peak_gib": peak["reserved_at_peak"] / 2**30,
            "breakdown_gib": {k: v / 2**30 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_sites": [{"category": c, "site": s, "gib": b / 2**30, "blocks": n} for c, s, b, n in sites[:top]],
            "peak_moment": peak_moment(trace, peak["event_index"]),
            "peak_block_mib": trace[peak["event_index"]]["size"] / 2**20 if peak["event_index"] >= 0 else 0.0,
        })
        del snapshot, trace, peak
    out, step_s = timed_step(runner, forest, loss, model, device)
    result["step_s"] = step_s
    if device.type == "cuda":
        result["untraced_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    result["predicted_gib"] = {k: v / 2**30 for k, v in predicted(spec, runner, next(model.parameters()).dtype,
                                                                   params, out).items()}
    del runner
    model.zero_grad(set_to_none=True)
    free_memory(device)
    return result


def markdown(report: dict) -> str:
    env = report["env"]
    wl = report["workload"]
    lines = [
        f"# Memory profile of one step: {report['model']} on {env['device']}",
        "",
        f"- torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, transformers {env['transformers']}; "
        f"CUDA allocator: {report.get('allocator') or 'default settings'}",
        f"- workload `agentic` {json.dumps(wl['set'])}: {wl['unique_tokens']:,} unique / {wl['linearized_tokens']:,} linearized "
        f"tokens, longest path {wl['max_path_length']:,}; weights {report['weights_gib']:.2f} GiB (+ the same in "
        "gradients)",
        f"- decoder layers, the same for every method: {report.get('layers') or 'not recorded'}",
        "- per configuration: a warm-up step, a step traced by the allocator (replayed to its peak), an untraced "
        "step for the time",
        "",
        "| config | step (s) | peak (GiB) | first step peak (GiB) | reserved at peak (GiB) | calls | largest call (tokens) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if r.get("error"):
            lines.append(f"| `{r['config']}` | {r['error']} | | | | | |")
            continue
        f = {k: f"{r[k]:.2f}" if r.get(k) is not None else "-"
             for k in ("untraced_peak_gib", "warmup_peak_gib", "reserved_at_peak_gib")}
        lines.append(f"| `{r['config']}` | {r['step_s']:.3f} | {f['untraced_peak_gib']} | {f['warmup_peak_gib']} | "
                     f"{f['reserved_at_peak_gib']} | {r['calls']} | {r['peak_graph_tokens']:,} |")
    for r in report["runs"]:
        if r.get("error"):
            continue
        lines += ["", f"## `{r['config']}`", ""]
        if "breakdown_gib" in r:
            lines += [f"Peak {r['replayed_peak_gib']:.2f} GiB (replayed; the allocator's max: {r['peak_gib']:.2f} GiB), "
                      f"{r['trace_events']:,} allocator events.", "", "| at the peak | GiB |", "|---|---|"]
            lines += [f"| {k} | {v:.2f} |" for k, v in r["breakdown_gib"].items() if abs(v) >= 0.005]
            lines += ["", "| top allocation sites alive at the peak | category | GiB | blocks |", "|---|---|---|---|"]
            lines += [f"| `{s['site']}` | {s['category']} | {s['gib']:.2f} | {s['blocks']} |" for s in r["top_sites"]]
            if r.get("peak_moment"):
                moment = f"The allocation that reached the peak ({r['peak_block_mib']:.1f} MiB), innermost frame first:"
                lines += ["", moment, ""] + [f"- `{frame}`" for frame in r["peak_moment"]]
        if r.get("predicted_gib"):
            plan = r["metrics"].get("memory_plan") or {}
            lines += ["", f"Predicted by the memory policy (`{json.dumps(plan, default=str)}`): "
                      + ", ".join(f"{k} {v:.2f} GiB" for k, v in r["predicted_gib"].items())]
    return "\n".join(lines) + "\n"


def _profile_all(configs: list[MethodConfig], args, model, forest, loss, device, spec, params, start) -> list[dict]:
    """Each configuration's profile (an error entry where it fails or the time budget is spent)."""
    runs = []
    for config in configs:
        if time.monotonic() - start > args.time_budget:
            runs.append({"config": config.label, "error": "skipped: time budget spent"})
            continue
        try:
            r = profile_config(config, model, forest, loss, device, spec, params, args.top)
        except Exception as e:  # an OOM in one configuration must not lose the others
            r = {"config": config.label, "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"}
            model.zero_grad(set_to_none=True)
            free_memory(device)
        runs.append(r)
        print(f"  {config.label}: " + (r.get("error") or f"{r['step_s']:.3f} s, peak "
              + (f"{r['untraced_peak_gib']:.2f} GiB" if "untraced_peak_gib" in r else "not measured")), flush=True)
    return runs


def _same_layers(configs: list[MethodConfig], layers: str) -> list[MethodConfig]:
    """dtree's configurations without its own lean layers where ``--layers`` names others."""
    own = dtree_layer_options(layers)
    return [MethodConfig(c.label, c.method, {**own, **c.options}) if c.method == "dtree" else c for c in configs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="dtree bench --configs grammar")
    p.add_argument("--model", default=None, help="default: qwen2.5-1.5b on GPU, tiny on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help=f"agentic workload parameter (repeatable; default {' '.join(DEFAULT_SET)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=12, help="allocation sites listed per configuration")
    p.add_argument("--time-budget", type=float, default=480.0, help="no configuration starts after this many seconds")
    p.add_argument("--out", default=None)
    p.add_argument("--no-expandable-segments", action="store_true", help="keep the CUDA allocator's default segments")
    p.add_argument("--layers", choices=LAYER_CHOICES, default="auto", help="decoder-layer kernels for every method")
    args = p.parse_args(argv)

    start = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    allocator = None
    if device.type == "cuda" and not args.no_expandable_segments:
        allocator = use_expandable_segments()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_name = args.model or ("qwen2.5-1.5b" if device.type == "cuda" else "tiny")
    configs = _same_layers(parse_configs(args.configs), args.layers)
    overrides = {**parse_assignments(DEFAULT_SET, "--set"), **parse_assignments(args.set, "--set")}
    print(f"memory profile: {model_name} ({dtype}) on {device_name(device)}; {[c.label for c in configs]}", flush=True)
    model = build_model(model_name, dtype=dtype, device=device, seed=args.seed)
    spec = adapt(model).dtree_spec()
    forest = make_workload("agentic", seed=args.seed, vocab_size=spec.vocab_size, **overrides)
    st = forest.stats()
    params = sum(p.numel() for p in model.parameters())
    loss = ppo_clip()
    with bench_layers(model, args.layers, device) as layers:
        print(f"decoder layers, for every method: {layers}", flush=True)
        runs = _profile_all(configs, args, model, forest, loss, device, spec, params, start)
    report = {
        "env": environment(device), "model": model_name, "allocator": allocator, "layers": layers,
        "weights_gib": params * torch.empty((), dtype=dtype).element_size() / 2**30,
        "workload": {"set": {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}, "seed": args.seed, "unique_tokens": st.unique_tokens,
                     "linearized_tokens": st.linearized_tokens, "max_path_length": st.max_path_length},
        "runs": runs,
    }
    text = markdown(report)
    print(text)
    if args.out:
        stem = write_profile_reports(report, text, args.out, "memory_profile", model_name)
        print(f"reports: {stem}.md, .json")
    return 0 if any("step_s" in r for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
