"""Is the memory probe's figure the same in a process's first runtime as in its later ones? (session AL)

The memory policy prices a call's kept bytes and its backward from
:func:`dtree.plan.memory_probe.measure_call_bytes`: two short probe calls (128 and 384 tokens),
the slope between them per token. On the 64k tree in one call the step's backward held ~81 KB
per token above its kept bytes where the probe had measured 72 (session AL, `predict/`). Measured
in one process with three fresh runtimes (each measures its model once), the first probe read less
than the later ones: one-time allocations of the process (kernel scratch, library workspaces) met in
the first short call counted against it and flattened the slope. The probe now runs its short call
once before measuring; this script shows whether the three runtimes agree.

    python benchmarks/probe_peaks.py            # GPU: qwen2.5-1.5b in bf16, through a runtime step each
    python benchmarks/probe_peaks.py --smoke    # CPU, tiny model (plumbing)

Writes ``$OUT/probe_peaks.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree
from dtree.bench.measure import emit_report, script_model
from dtree.models import adapt
from dtree.plan import memory_probe
from dtree.workloads import make_workload

RUNTIMES = 3


def figures(model: torch.nn.Module, device: torch.device) -> memory_probe.CallBytes:
    """The model's call figures as a fresh runtime measures them on CUDA (one step over a small
    forest, its lean layers), or directly on the tiny CPU model (no runtime probes off CUDA)."""
    if device.type != "cuda":
        adapter = adapt(model)
        return memory_probe.measure_call_bytes(adapter, adapter.dtree_spec(), (device, torch.float32), "sdpa", model)
    forest = make_workload("grpo", seed=0, vocab_size=model.config.vocab_size, num_prompts=1, prompt_len=256,
                           group_size=2, answer_len=64)
    rt = dtree.TreeRuntime(model, memory=12.5)
    rt.forward_backward(forest, dtree.losses.nll())
    model.zero_grad(set_to_none=True)
    return rt.memory_plan.call_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    args = p.parse_args()
    model, device = script_model(args.smoke)
    rows = []
    for k in range(RUNTIMES):
        d = figures(model, device).describe()
        rows.append(f"| {k + 1} | {d['full_kb']:.1f} | {d['checkpointed_kb']:.1f} | {d['backward_kb']:.1f} | "
                    f"{d['backward_checkpointed_kb']:.1f} |")
    text = "\n".join([
        "# The memory probe's figures, per fresh runtime in one process", "",
        ("Per token (KB): what a call keeps without and with every layer checkpointed, and the most its backward "
         "adds above that (its incoming gradient included) without and with checkpointing."), "",
        "| runtime (in order) | full | checkpointed | backward | backward, checkpointed |",
        "|---|---|---|---|---|", *rows])
    emit_report(text, "probe_peaks.md")


if __name__ == "__main__":
    main()
