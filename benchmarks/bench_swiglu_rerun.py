"""A checkpointed layer's SwiGLU backward in a re-run (``swiglu_down(..., output_unused=True)``):
the chunks' down-projection weight gradients summed in float32 inside the matmul
(:func:`dtree.ops.swiglu.sum_chunk_in_matmul`) against the sum it replaced (each chunk's
product in bf16, then a float32 add kernel, after a zero fill).

The capped 64k step's kernels (``benchmarks/results/h200/session_ab``) showed three float32
adds per layer and call in this backward, ~0.3 ms of ~1.7 s per 6 calls x 28 layers. Both
variants run in one process on the same inputs: the median CUDA-event time of the whole
backward over ``--reps``, and each variant's largest deviation of the weight gradient from
the float64 sum of the same products.

    python benchmarks/bench_swiglu_rerun.py              # Hopper GPU, ~20 s
    python benchmarks/bench_swiglu_rerun.py --smoke      # CPU: tiny shapes, one variant (no out_dtype matmul)

Prints Markdown, also written to ``$OUT/swiglu_rerun.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtree.bench.measure import emit_report
from dtree.ops.swiglu import interface as swiglu


def _backward_ms(rows: int, hidden: int, inter: int, device: str, reps: int, in_matmul: bool):
    """(median ms of the re-run backward, max |dW - float64 sum|, float64 sum's max |dW|)."""
    gen = torch.Generator(device=device).manual_seed(rows)
    dtype = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    gate0, up0, dy = rand(rows, inter), rand(rows, inter), rand(rows, hidden)
    w = (rand(hidden, inter).float() / inter**0.5).to(dtype).requires_grad_(True)
    saved = swiglu._sums_in_matmul
    swiglu._sums_in_matmul = (lambda dy2, acc: saved(dy2, acc)) if in_matmul else (lambda dy2, acc: False)
    times = []
    try:
        for _ in range(reps + 1):
            gate = gate0.clone().requires_grad_(True)
            up = up0.clone().requires_grad_(True)
            w.grad = None
            g, u = gate * 1, up * 1  # non-leaf, as the re-run's projections are
            y = swiglu.swiglu_down(g, u, w, None, output_unused=True)
            _sync(device)
            t0 = time.perf_counter()
            y.backward(dy)
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
    finally:
        swiglu._sums_in_matmul = saved
    product = swiglu.silu_mul_forward_torch(gate0, up0)
    exact = dy.double().t() @ product.double()
    return statistics.median(times[1:]), (w.grad.double() - exact).abs().max().item(), exact.abs().max().item()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="12288,16384,32768", help="tokens of the call, comma-separated")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    hidden, inter = (1536, 8960) if device == "cuda" else (64, 160)
    rows = [int(r) for r in args.rows.split(",")] if device == "cuda" else [300]
    variants = [True, False] if device == "cuda" else [False]
    chunk = swiglu.CONSUMING_CHUNK_ROWS if device == "cuda" else 128
    saved_chunk, swiglu.CONSUMING_CHUNK_ROWS = swiglu.CONSUMING_CHUNK_ROWS, chunk
    lines = [f"# A re-run's SwiGLU backward: the chunk sum in the matmul or after it ({device})", "",
             (f"torch {torch.__version__}; {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; "
              f"hidden {hidden}, intermediate {inter}, bf16, chunks of {chunk} rows; median of {args.reps}"), "",
             ("| rows | chunks | in the matmul (ms) | bf16 part + float32 add (ms) | speedup "
              "| dW max deviation from float64, in / after (of max abs dW) |"), "|---|---|---|---|---|---|"]
    try:
        for n in rows:
            got = {v: _backward_ms(n, hidden, inter, device, args.reps, v) for v in variants}
            fused, plain = got.get(True), got[False]
            lines.append(
                f"| {n} | {-(-n // chunk)} | {f'{fused[0]:.3f}' if fused else '-'} | {plain[0]:.3f} | "
                f"{f'{plain[0] / fused[0]:.3f}x' if fused else '-'} | "
                f"{f'{fused[1]:.2e}' if fused else '-'} / {plain[1]:.2e} (of {plain[2]:.2e}) |")
    finally:
        swiglu.CONSUMING_CHUNK_ROWS = saved_chunk
    emit_report("\n".join(lines), "swiglu_rerun.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
