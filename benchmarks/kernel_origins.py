"""Which code launches each kernel of one dtree step, per layer and call.

A host-bound step pays for every launch (GRPO case 1 on an H200: 75 kernels per decoder layer,
about half of them copies, fills, memsets, adds and reductions around the matmuls and the
attention). This script profiles one steady step, links every kernel to the CPU op that
launched it, and counts kernels by (kernel kind, launching op, the autograd node it ran in),
per decoder layer and model call: what a change would remove, and from where.
(``benchmarks/kernel_sources.py`` groups small ops by their Python frames instead, which the
GPU machine's torch 2.11 does not record.)

    python benchmarks/kernel_origins.py                          # GPU: GRPO case 1
    python benchmarks/kernel_origins.py --workload agentic64k --opt memory=low
    python benchmarks/kernel_origins.py --smoke                  # CPU, tiny model (plumbing)

Prints Markdown, also written to ``$OUT/kernel_origins_<workload><_tag>.md`` when OUT is set.
On CPU there are no kernels: the CPU ops are counted instead (plumbing only).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, profiled_step, script_setup
from dtree.bench.measure import emit_report

# generic kernels that are glue whoever launches them; a short name is cut from these markers
_GLUE_KERNELS = ("FillFunctor", "copy_kernel", "reduce_kernel", "CatArray", "Memset", "Memcpy")
_GLUE_OPS = ("aten::add", "aten::add_", "aten::sum", "aten::copy_", "aten::fill_", "aten::zero_", "aten::mul", "aten::cat")


def _is_glue(kind: str, op: str) -> bool:
    """A copy, fill, memset, elementwise add or multiply, reduction or concatenation."""
    return kind.startswith(_GLUE_KERNELS) or op.split(" in ")[0] in _GLUE_OPS


def _kind(kernel: str) -> str:
    """A kernel's short name: from the generic kernel's marker on, or the Triton / CuTe name."""
    for marker in ("Functor_", *_GLUE_KERNELS):
        if marker in kernel:
            return kernel[kernel.find(marker):][:48]
    return kernel.split("(")[0].split("<")[0][-60:]


def _op(event):
    """The op that launched: the innermost event that is not a CUDA runtime or driver call."""
    while event is not None and event.name.startswith(("cuda", "cu")):
        event = event.cpu_parent
    return event


def _node(event) -> str:
    """The autograd node an op runs in (backward), or ''."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function: "):
            return " in " + event.name.split(": ", 1)[1]
        event = event.cpu_parent
    return ""


def origins(prof, device: torch.device) -> tuple[collections.Counter, collections.Counter]:
    """(kernels, GPU microseconds), each keyed by (kernel kind, launching op and autograd node), from one
    profiled step (on CPU, which has no kernels: the aten ops, for the plumbing, and no times)."""
    counts, micros = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if device.type != "cuda":
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
                counts[(e.name, e.name + _node(e))] += 1
            continue
        op = _op(e)
        for k in e.kernels:
            key = (_kind(k.name), (op.name if op is not None else "?") + _node(e))
            counts[key] += 1
            micros[key] += k.duration
    return counts, micros


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p, "case1")
    p.add_argument("--tag", default="")
    p.add_argument("--top", type=int, default=70)
    args = p.parse_args()
    model, device, rt, loss, forests, _, options = script_setup(args, 5)
    prof, out = profiled_step(rt, model, forests[4], loss, device)
    counts, micros = origins(prof, device)
    calls = max(1, int(out.metrics.get("groups", 1)))
    layers = max(1, len(getattr(model.config, "layer_types", None) or range(model.config.num_hidden_layers)))
    total = sum(counts.values())
    glue = [key for key in counts if _is_glue(*key)]
    summary = (f"torch {torch.__version__}; runtime options {options or 'default'}; {calls} model call(s), "
               f"{layers} decoder layers; **{total} kernels** ({total / calls / layers:.1f} per layer and call), "
               f"{sum(micros.values()) / 1e3:.1f} ms of kernel time; {sum(counts[k] for k in glue)} of them "
               f"({sum(micros[k] for k in glue) / 1e3:.1f} ms) copies, fills, memsets, elementwise adds and "
               "multiplies, reductions and concatenations")
    order = micros.most_common() if micros else counts.most_common()  # GPU time first where there is one
    lines = [f"# Kernels of one dtree step by origin: {args.workload}, {device.type}", "", summary, "",
             "| kernel | launched by (in the autograd node) | kernels | per layer and call | GPU ms |",
             "|---|---|---|---|---|"]
    for key, _ in order[: args.top]:
        kind, op = key
        n = counts[key]
        lines.append(f"| `{kind}` | `{op}` | {n} | {n / calls / layers:.2f} | {micros[key] / 1e3:.2f} |")
    tag = f"_{args.tag}" if args.tag else ""
    emit_report("\n".join(lines), f"kernel_origins_{args.workload}{tag}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
