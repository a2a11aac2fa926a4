"""Who walks the model's modules during a step, and how often (host time before and between kernels).

``nn.Module.named_modules`` runs once per module of every subtree it walks, so a walk of
qwen2.5-1.5b's ~340 modules costs ~340 generator steps; session AO's host profile of GRPO
case 1 on an H200 counted 9,616 such steps and 339 ``_named_members`` calls (``parameters()``
and the like) per step. This script runs ``--steps`` steady steps with both counted: every
walk's first frame outside torch (its caller), the modules it visited, the calls per step.

    python benchmarks/module_walks.py                  # GPU: qwen2.5-1.5b, GRPO case 1
    python benchmarks/module_walks.py --smoke          # CPU, tiny model (plumbing)

Prints Markdown, also written to ``$OUT/module_walks_<workload>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup
from dtree.bench.measure import emit_report, host_timed_step


def _caller(skip: str = "/torch/") -> str:
    """The innermost frame of the stack outside torch (and this file): ``file:line (function)``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if skip not in frame.filename and not frame.filename.endswith("module_walks.py"):
            return f"{'/'.join(frame.filename.split('/')[-2:])}:{frame.lineno} ({frame.name})"
    return "?"


def counted_walks(run_steps) -> tuple[collections.Counter, collections.Counter]:
    """(modules visited per caller, walks per caller) of ``named_modules`` and ``_named_members``
    while ``run_steps()`` runs."""
    visited, walks = collections.Counter(), collections.Counter()
    named_modules, named_members = torch.nn.Module.named_modules, torch.nn.Module._named_members

    def counting_modules(self, memo=None, prefix="", remove_duplicate=True):
        if memo is None:  # a walk's root call (its recursion passes a memo)
            site = "named_modules <- " + _caller()
            walks[site] += 1
            for item in named_modules(self, memo, prefix, remove_duplicate):
                visited[site] += 1
                yield item
            return
        yield from named_modules(self, memo, prefix, remove_duplicate)

    def counting_members(self, *args, **kwargs):
        walks["_named_members <- " + _caller()] += 1
        return named_members(self, *args, **kwargs)

    torch.nn.Module.named_modules, torch.nn.Module._named_members = counting_modules, counting_members
    try:
        run_steps()
    finally:
        torch.nn.Module.named_modules, torch.nn.Module._named_members = named_modules, named_members
    return visited, walks


def report(workload: str, steps: int, visited: collections.Counter, walks: collections.Counter, top: int) -> str:
    lines = [f"# Module walks in a dtree step: {workload}", "",
             (f"{steps} steady steps; per step: {sum(walks.values()) / steps:.1f} walks, "
              f"{sum(visited.values()) / steps:.0f} modules visited"), "",
             "| caller | walks per step | modules visited per step |", "|---|---|---|"]
    for site, n in walks.most_common(top):
        lines.append(f"| `{site}` | {n / steps:.1f} | {visited.get(site, 0) / steps:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_setup_arguments(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    model, device, rt, loss, forests, _, _ = script_setup(args, 3 + args.steps)

    def run_steps():
        for forest in forests[3:]:
            host_timed_step(rt, forest, loss, model, device)

    visited, walks = counted_walks(run_steps)
    emit_report(report(args.workload, args.steps, visited, walks, args.top), f"module_walks_{args.workload}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
