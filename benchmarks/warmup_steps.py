"""Time of each of the first training steps of a fresh process, a fresh forest each step:
what compiling (and, with DTREE_TRITON_AUTOTUNE=1, autotuning) the Triton kernels costs.

    python benchmarks/warmup_steps.py --model qwen2.5-1.5b --workload agentic --set num_trees=1
    DTREE_TRITON_AUTOTUNE=1 python benchmarks/warmup_steps.py --model qwen2.5-1.5b ...

Run each in its own process (Triton's on-disk cache also holds compiled kernels: set
TRITON_CACHE_DIR to an empty directory for a cold start). Prints one line per step:
step, seconds, unique tokens of its forest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import dtree  # noqa: E402
from dtree.bench.runner import _parse_assignments  # noqa: E402
from dtree.models import adapt  # noqa: E402
from dtree.presets import build_model  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--workload", default="agentic")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="workload parameter KEY=VALUE")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--attention", default="auto")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    vocab = adapt(model).dtree_spec().vocab_size
    rt = dtree.TreeRuntime(model, attention=args.attention)
    loss = dtree.losses.nll()
    print(f"model {args.model}, attention {rt.attention}, DTREE_TRITON_AUTOTUNE={os.environ.get('DTREE_TRITON_AUTOTUNE', '0')}")
    for step in range(args.steps):
        forest = make_workload(args.workload, seed=step, vocab_size=vocab, **_parse_assignments(args.overrides, "--set"))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.forward_backward(forest, loss)
        if cuda:
            torch.cuda.synchronize()
        print(f"step {step}: {time.perf_counter() - t0:.2f} s ({forest.num_unique_tokens} unique tokens)", flush=True)
        model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
