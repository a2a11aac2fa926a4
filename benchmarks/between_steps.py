"""What dtree holds on the GPU between training steps (issue 17 item 3).

A training loop as RL runs it: a fresh agentic forest every step (unique tokens drawn
between ``--min-tokens`` and ``--max-tokens``), ``rt.forward_backward``, AdamW's step,
``optimizer.zero_grad(set_to_none=True)``. After every step it reads the allocator:
what is allocated beyond the weights and the optimizer state (the gradients are None
by then: dtree's own leftovers), what is reserved (allocated plus the allocator's
cache, which another process on the GPU cannot have), and the step's peak; once with
``free_after_step=True`` (the allocator's cache emptied after every call) and once
with ``False`` (the default since session F: the cache kept; the KV stack is dropped
after every call either way). The issue measured, before this: 77 of 80
GiB reserved and ~10 GiB allocated beyond weights and optimizer state over 20 steps on
16k-41k-token trees.

    python benchmarks/between_steps.py --out benchmarks/results                  # H100: ~1.5 min
    python benchmarks/between_steps.py --model tiny --device cpu --steps 3 --min-tokens 200 --max-tokens 400
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import dtree  # noqa: E402
from dtree.bench.layers import apply_layers  # noqa: E402
from dtree.bench.measure import device_name, use_expandable_segments  # noqa: E402
from dtree.presets import build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

GIB = 2.0**30


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def run_loop(model, free: bool, targets: list[int], device: torch.device, overrides: dict) -> list[dict]:
    """One loop over ``targets`` (unique tokens per step); a row per step."""
    rt = dtree.TreeRuntime(model, free_after_step=free)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = rt.spec
    rows = []
    for i, target in enumerate(targets):
        forest = make_workload("agentic", seed=i, vocab_size=spec.vocab_size, num_trees=1,
                               target_unique_tokens=target, **overrides)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = rt.forward_backward(forest, dtree.losses.nll())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row = {"step": i + 1, "unique_tokens": forest.num_unique_tokens, "seconds": time.perf_counter() - t0,
               "loss": out.loss}
        if device.type == "cuda":
            base = weights + _state_bytes(optimizer)
            row.update(
                peak_gib=torch.cuda.max_memory_allocated(device) / GIB,
                predicted_gib=out.metrics["memory_plan"].get("predicted_total_gib"),
                beyond_weights_and_state_gib=(torch.cuda.memory_allocated(device) - base) / GIB,
                reserved_gib=torch.cuda.memory_reserved(device) / GIB,
            )
        rows.append(row)
        print(f"  free_after_step={free} step {i + 1}: {row}", flush=True)
    rt.release_memory()
    del optimizer
    return rows


def summary(rows: list[dict]) -> dict:
    if "reserved_gib" not in rows[0]:
        return {"steps": len(rows), "seconds_mean": float(np.mean([r["seconds"] for r in rows]))}
    return {
        "steps": len(rows),
        "seconds_mean_after_first": float(np.mean([r["seconds"] for r in rows[1:]] or [rows[0]["seconds"]])),
        "max_reserved_between_steps_gib": max(r["reserved_gib"] for r in rows),
        "max_allocated_beyond_weights_and_state_gib": max(r["beyond_weights_and_state_gib"] for r in rows),
        "max_peak_gib": max(r["peak_gib"] for r in rows),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: qwen2.5-1.5b on GPU, tiny on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--min-tokens", type=int, default=16384)
    p.add_argument("--max-tokens", type=int, default=41000)
    p.add_argument("--layers", default="auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="agentic workload parameter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from dtree.bench.configs import parse_assignments

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        use_expandable_segments()
    name = args.model or ("qwen2.5-1.5b" if device.type == "cuda" else "tiny")
    model = build_model(name, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    layers = apply_layers(model, args.layers, device)
    rng = np.random.default_rng(args.seed)
    targets = [int(t) for t in rng.integers(args.min_tokens, args.max_tokens + 1, args.steps)]
    overrides = parse_assignments(args.set, "--set")
    report = {"device": device_name(device), "torch": torch.__version__, "model": name, "layers": layers,
              "targets": targets, "runs": {}}
    for free in (True, False):
        rows = run_loop(model, free, targets, device, overrides)
        report["runs"][f"free_after_step={free}"] = {"rows": rows, "summary": summary(rows)}
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = _markdown(report)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"between_steps_{name}")
        with open(base + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(text)
    return 0


def _markdown(report: dict) -> str:
    lines = [f"# Between steps: {report['model']} on {report['device']}", "",
             f"torch {report['torch']}; layers: {report['layers']}; fresh agentic trees of {report['targets']} unique "
             "tokens; AdamW step and zero_grad(set_to_none=True) after each", "",
             "| setting | " + " | ".join(next(iter(report["runs"].values()))["summary"]) + " |",
             "|---|" + "---|" * len(next(iter(report["runs"].values()))["summary"])]
    for setting, run in report["runs"].items():
        lines.append(f"| `{setting}` | " + " | ".join(
            f"{v:.2f}" if isinstance(v, float) else str(v) for v in run["summary"].values()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
