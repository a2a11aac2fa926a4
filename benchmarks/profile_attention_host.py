"""Host (CPU) cost of one stack-attention forward+backward per backend: where the
Python time goes when the GPU work is small.

    python benchmarks/profile_attention_host.py --out benchmarks/results   # GPU

For each implementation of ``bench_stack_attention.py`` and each layout (12 q / 2 kv
heads of 128 by default, qwen2.5-1.5b's), after a warm-up: the host time to enqueue
one forward+backward (the loop without synchronizing, averaged over ``--iters``; the
GPU queue is deep enough to absorb it), the GPU time of the same (CUDA events around
the loop, synchronized), and the functions with the most own time under cProfile.
Writes ``attention_host_<gpu>.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_stack_attention import implementations  # noqa: E402
from stack_attention_cases import bind, cases, environment, stack_inputs, table  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layouts", default="grpo,agentic")
    p.add_argument("--impls", default="triton fused,triton split,flash-attn,flash-attn det")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    return p.parse_args()


def profile_impl(fn, case, hq: int, hkv: int, iters: int) -> dict:
    stack, q, k, v = stack_inputs(case, hq, hkv, 128, torch.bfloat16, "cuda")
    go = torch.randn(q.shape[0], hq, 128, device="cuda", dtype=torch.bfloat16)
    call = bind(fn, stack, case.layout, 128**-0.5)

    def step():
        call(q, k, v).backward(go)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / iters
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return {"host_ms": host_ms, "wall_ms": wall_ms, "top": text.getvalue()}


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_attention_host needs a CUDA GPU")
    from dtree.ops.stack_attention import triton_autograd as sat

    fns, absent = implementations(sat, False, args.impls)
    rows, details = [], []
    for case in cases(args.layouts.split(",")):
        for name, fn in fns.items():
            r = profile_impl(fn, case, args.heads, args.kv_heads, args.iters)
            rows.append([case.name, name, f"{r['host_ms']:.3f}", f"{r['wall_ms']:.3f}"])
            details += ["", f"### {case.name}, {name}: cProfile, {args.iters} forward+backward, by own time", "",
                        "```", r["top"].strip()[:6000], "```"]
            print(rows[-1], flush=True)
    env = environment()
    text = "\n".join([
        "# Host cost of a stack-attention forward+backward",
        "",
        f"{env['gpu']}, CUDA {env['cuda']}, torch {env['torch']}, Triton {env['triton']}, {env['flash_attn']}; "
        f"{env['date']}. bf16, {args.heads} q / {args.kv_heads} kv heads of 128.",
        "",
        *(f"- not run: {n}: {w}" for n, w in absent.items()),
        "",
        "`host ms`: the CPU time to enqueue one forward+backward; `wall ms`: the elapsed time per forward+backward "
        "over the same loop (the GPU's, or the host's when the host is slower).",
        "",
        *table(["layout", "impl", "host ms", "wall ms"], rows),
        *details,
    ]) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_").lower()
        with open(os.path.join(args.out, f"attention_host_{gpu}.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
