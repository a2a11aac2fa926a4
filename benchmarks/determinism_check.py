"""Where do two deterministic runs of one forest part? (issue 21)

`benchmarks/csrc_gpu.py` found, on the H100, every parameter gradient differing between
the first and a later deterministic run of a 32k agentic forest once dtree's lean layers
were on (session C, with HF's eager layers: none differed). This script separates the
candidates in one process:

* the plan: every step's memory plan and model calls are recorded;
* the step: per run, an exact integer fingerprint of every parameter's gradient bits,
  compared between every pair of runs (so a first-run effect shows as run 1 differing
  from runs 2..n while those agree);
* the layer kernels: the lean RMSNorm and SwiGLU ops' forward and backward twice on the
  same inputs, bit for bit;
* the layers: the same runs with HF's eager layers.

    python benchmarks/determinism_check.py [--runs 4] [--tokens 32768] [--smoke]

Prints a Markdown report (also written to ``$OUT/determinism_check.md`` when OUT is set).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from dtree.bench.layers import apply_layers  # noqa: E402
from dtree.bench.measure import emit_report, script_model, timed_step  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.models.lean_layers import remove_lean_layers  # noqa: E402
from dtree.ops.rms_norm import rms_norm  # noqa: E402
from dtree.ops.swiglu import silu_mul  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """[P] int64: per parameter, a weighted sum of its gradient's raw bits (0 without one)."""
    out = []
    for p in model.parameters():
        if p.grad is None:
            out.append(torch.zeros((), dtype=torch.int64, device=p.device))
            continue
        bits = p.grad.detach().contiguous().view(-1).view(torch.int16 if p.grad.element_size() == 2 else torch.int32)
        weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 65521
        out.append((bits.to(torch.int64) * weights).sum())
    return torch.stack(out).cpu()


def runs_of(model, forest, loss, device, runs: int) -> list[dict]:
    rt = dtree.TreeRuntime(model, config=dtree.RuntimeConfig(deterministic=True))
    out = []
    for _ in range(runs):
        step, seconds = timed_step(rt, forest, loss, model, device)
        plan = step.metrics.get("memory_plan", {})
        out.append({
            "seconds": seconds, "calls": step.num_model_calls, "loss": step.loss,
            "plan": (plan.get("group_tokens"), plan.get("checkpoint_layers"), plan.get("path_checkpoint_layers"),
                     plan.get("logprob_chunk")),
            "fingerprint": fingerprint(model),
        })
    model.zero_grad(set_to_none=True)
    return out


def pair_lines(label: str, runs: list[dict]) -> list[str]:
    lines = [f"### {label}", "", "| run | seconds | calls | plan (group_tokens, ckpt, path, chunk) | loss |",
             "|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        lines.append(f"| {i + 1} | {r['seconds']:.2f} | {r['calls']} | {r['plan']} | {r['loss']:.9g} |")
    lines += ["", "| runs | parameters whose gradient bits differ |", "|---|---|"]
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            n = int((runs[i]["fingerprint"] != runs[j]["fingerprint"]).sum())
            lines.append(f"| {i + 1} vs {j + 1} | {n} of {len(runs[i]['fingerprint'])} |")
    return lines + [""]


def kernel_lines(device: torch.device, dtype: torch.dtype, hidden: int, rows: int) -> list[str]:
    """The lean ops twice on the same inputs: are outputs and gradients bitwise equal?"""
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, device=device, dtype=dtype)
    g = torch.randn(rows, 4 * hidden, device=device, dtype=dtype)
    u = torch.randn_like(g)
    results = []
    for name, fn, inputs in (
        ("rms_norm", lambda a, b: rms_norm(a, b, 1e-6), (x, w)),
        ("silu_mul", silu_mul, (g, u)),
    ):
        seen = []
        for _ in range(2):
            leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
            y = fn(*leaves)
            y.backward(torch.ones_like(y))
            seen.append([y.detach()] + [t.grad for t in leaves])
        same = all(torch.equal(a, b) for a, b in zip(*seen))
        results.append(f"| {name} | [{rows}, {hidden}] | {'yes' if same else 'NO'} |")
    return ["### Lean layer kernels twice on the same inputs", "", "| op | shape | bitwise equal |", "|---|---|---|",
            *results, ""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a small tree")
    args = p.parse_args()
    model, device = script_model(args.smoke)
    spec = adapt(model).dtree_spec()
    tree = {"num_trees": 1, "target_unique_tokens": 400 if args.smoke else args.tokens}
    if args.smoke:
        tree.update(system_prompt_len=64, trajectories=2, turn_len=(4, 40))
    forest = make_workload("agentic", vocab_size=spec.vocab_size, **tree)
    loss = ppo_clip()
    lines = [f"# Deterministic runs of one forest ({forest.num_unique_tokens} unique tokens), {device}", ""]
    lines += kernel_lines(device, next(model.parameters()).dtype, spec.hidden_size, 4096 if not args.smoke else 64)
    layers = apply_layers(model, "auto", device)
    lines += pair_lines(f"bench layers: {layers}", runs_of(model, forest, loss, device, args.runs))
    remove_lean_layers(model)
    lines += pair_lines("HF eager layers", runs_of(model, forest, loss, device, args.runs))
    emit_report("\n".join(lines), "determinism_check.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
