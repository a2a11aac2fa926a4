"""Which code launches a step's small kernels: torch ops (zero_, fill_, copy_, add, ...) by
the Python frames that called them, with their launch counts and GPU time per step.

A GRPO case-1 step launches ~2,300 kernels, ~500 of them fills and memsets; each costs the
host a launch and the GPU a bubble. This script profiles one steady step with Python stacks
(torch.profiler ``with_stack``) and groups the ops whose names match ``--ops`` by their
innermost dtree (or transformers) frames.

    python benchmarks/kernel_sources.py --workload case1          # H100
    python benchmarks/kernel_sources.py --smoke                   # CPU, tiny model (plumbing)

Known gap: on the H100 machine's torch 2.11 the Python frames did not come back (every row
read ``(no dtree frame)``; torch 2.13 here records them as the ops' parent events), so there
it only counts the ops, their launches and GPU time: case 1 had 971 such ops, 982 kernels,
9.3 GPU ms per step (sums 231 kernels, copies 143, zero_ 137, adds 199, clones 84, zeros 89).
``benchmarks/kernel_origins.py`` attributes every kernel to the op and the autograd node that
launched it instead, which that torch does record.

Prints Markdown, also written to ``$OUT/kernel_sources_<workload>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, profiled_step, script_setup  # noqa: E402
from dtree.bench.measure import emit_report  # noqa: E402

OPS = r"^aten::(zero_|zeros|zeros_like|fill_|copy_|add_?|sum|to|_to_copy|mul|cat|index|new_zeros|clone)$"
FRAMES = re.compile(r"(dtree/|transformers/models/)")


def _where(e, depth: int) -> str:
    """The innermost ``depth`` Python frames of ours or the model's above op ``e``, innermost
    first (the profiler's Python tracer records frames as parent events, ``path(line): fn``;
    older versions fill ``e.stack``)."""
    frames, x = list(e.stack or []), e.cpu_parent
    while x is not None and not frames:
        if "(" in x.name and "): " in x.name and FRAMES.search(x.name):
            frames.append(x.name)
            if len(frames) >= depth:
                break
        x = x.cpu_parent
    while x is not None and len(frames) < depth:
        x = x.cpu_parent
        if x is not None and FRAMES.search(x.name) and "): " in x.name:
            frames.append(x.name)
    mine = [f.split("site-packages/")[-1].split("/work/main/")[-1] for f in frames if FRAMES.search(f)]
    return " <- ".join(mine[:depth]) or "(no dtree frame)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--ops", default=OPS, help="regex of the torch op names to attribute")
    p.add_argument("--depth", type=int, default=2, help="frames shown per source")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    model, device, rt, loss, forests, kind, options = script_setup(args, 4)
    prof, _ = profiled_step(rt, model, forests[3], loss, device, with_stack=True)
    ops = re.compile(args.ops)
    rows: dict = collections.defaultdict(lambda: [0, 0, 0.0])  # (op, where) -> [calls, kernels, GPU us]
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not ops.search(e.name):
            continue
        if e.cpu_parent is not None and ops.search(e.cpu_parent.name):
            continue  # counted at the outermost matching op (aten::zeros -> zero_ -> fill_)
        kernels = [k for child in _subtree(e) for k in child.kernels]
        row = rows[(e.name, _where(e, args.depth))]
        row[0] += 1
        row[1] += len(kernels)
        row[2] += sum(k.duration for k in kernels)
    lines = [f"# Where a step's small ops come from: {args.workload} ({kind}), {device.type}", "",
             f"torch {torch.__version__}; options {options or 'default'}; ops matching `{args.ops}`, counted at the "
             "outermost matching op", "", "| op | called from (innermost first) | calls | kernels | GPU ms |",
             "|---|---|---|---|---|"]
    for (name, where), (calls, kernels, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[: args.top]:
        lines.append(f"| `{name}` | {where} | {calls} | {kernels} | {us / 1e3:.3f} |")
    total = [sum(v[i] for v in rows.values()) for i in range(3)]
    lines += ["", f"All matching ops: {total[0]} calls, {total[1]} kernels, {total[2] / 1e3:.2f} GPU ms."]
    emit_report("\n".join(lines), f"kernel_sources_{args.workload}.md")
    return 0


def _subtree(e):
    """``e`` and every op under it."""
    out, todo = [], [e]
    while todo:
        x = todo.pop()
        out.append(x)
        todo.extend(x.cpu_children)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
