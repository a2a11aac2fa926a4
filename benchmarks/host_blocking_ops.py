"""Which ops of the fused LM head's backward make the host wait for the GPU.

``benchmarks/queue_depth.py --backward-marks`` (session AS) found the host spending 70-160 ms in
``_FusedLogprobs.backward`` of every call whose loss rows span several vocabulary slices, and the
queue of work ahead of the GPU falling from ~130 ms to 0-9 ms across it: something in it waits for
the device. Each op here runs with ~``--queue-ms`` of matmuls queued ahead of it; an op that queues
returns in microseconds, one that waits takes about the queued time. Shapes are the head's backward
on qwen2.5-1.5b at the 64k tree's capped calls (``--rows`` loss rows, ``--width`` vocabulary
columns per slice, hidden 1536), in bf16.

    python benchmarks/host_blocking_ops.py            # a GPU
Prints Markdown, also written to ``$OUT/host_blocking_ops.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtree.bench.measure import emit_report


def _queue(ms: float, filler: tuple[torch.Tensor, torch.Tensor], per_mm_ms: float) -> None:
    a, b = filler
    for _ in range(max(1, int(ms / per_mm_ms))):
        torch.mm(a, b)


def _ops(rows: int, width: int, hidden: int, device) -> dict:
    bf = torch.bfloat16
    d = torch.randn(rows, width, device=device, dtype=bf)
    w = torch.randn(width, hidden, device=device, dtype=bf)
    acc = torch.zeros(rows, hidden, device=device, dtype=torch.float32)
    out16 = torch.empty(rows, hidden, device=device, dtype=bf)
    grad_w = torch.empty(width, hidden, device=device, dtype=bf)
    h = torch.randn(rows, hidden, device=device, dtype=bf)
    fresh = [rows * width]

    def empty_fresh():  # a size no cached block serves: the allocator maps more memory
        fresh[0] += 64 << 20
        return torch.empty(fresh[0], device=device, dtype=bf)

    return {
        "fused head backward": _head_backward(rows, hidden, device),
        "empty(a new size each time, bf16)": empty_fresh,
        "addmm(acc, d, w, out_dtype=float32, out=acc)": lambda: torch.addmm(acc, d, w, out_dtype=torch.float32, out=acc),
        "addmm(acc, d, w, out_dtype=float32)": lambda: torch.addmm(acc, d, w, out_dtype=torch.float32),
        "mm(d, w, out_dtype=float32)": lambda: torch.mm(d, w, out_dtype=torch.float32),
        "acc += d @ w": lambda: acc.add_(d @ w),
        "mm(d, w, out=out16)": lambda: torch.mm(d, w, out=out16),
        "mm(d.t(), h, out=grad_w)": lambda: torch.mm(d.t(), h, out=grad_w),
        "zeros(rows, hidden, float32)": lambda: torch.zeros(rows, hidden, device=device, dtype=torch.float32),
        "empty(rows * width, bf16)": lambda: torch.empty(rows * width, device=device, dtype=bf),
    }


def _head_backward(rows: int, hidden: int, device, vocab: int = 151936, chunk: int = 4096):
    """The fused head's backward (:func:`dtree.ops.logprobs.fused_head.token_logprobs_triton`) over
    ``rows`` rows at ``chunk``-row chunks; each call runs a new forward first (not timed: the caller times
    the returned function only)."""
    from dtree.ops.logprobs.fused_head import token_logprobs_triton

    weight = (torch.randn(vocab, hidden, device=device) * 0.02).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), device=device)
    hidden_states = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)

    class Backward:
        def prepare(self) -> None:
            weight.grad = None
            self.h = hidden_states.clone().requires_grad_(True)
            self.logp, _ = token_logprobs_triton(self.h, weight, labels, chunk_size=chunk)

        def __call__(self) -> None:
            self.logp.backward(torch.ones_like(self.logp))

    return Backward()


LAYER_INTERMEDIATE = 8960  # qwen2.5-1.5b


def fresh_shape_rows(device, queue_ms: float, filler, per_mm: float, count: int, hidden: int,
                     width: int = 88832, seed: int = 0, multiple: int = 1) -> list[str]:
    """The head backward's three products and two of a decoder layer's (its gate/up projection's forward and
    weight gradient, whose row and inner counts are a call's tokens) at ``count`` row counts never used before
    in the process (as a fresh forest's calls have; rounded up to ``multiple``), each with ~``queue_ms`` queued ahead,
    then at the same row counts again: how many launches waited for the queue in each pass, and in
    which order (1: waited) on the first."""
    import random

    bf = torch.bfloat16
    rows = [-(-n // multiple) * multiple for n in random.Random(seed).sample(range(4001, 12000), count)]
    w = torch.randn(width, hidden, device=device, dtype=bf)
    grad_w = torch.empty(width, hidden, device=device, dtype=bf)
    up = torch.randn(2 * LAYER_INTERMEDIATE, hidden, device=device, dtype=bf)  # a decoder layer's gate and up
    products = {
        "mm(d.t(), h, out=grad_w)": lambda d, h, acc: torch.mm(d.t(), h, out=grad_w),
        "addmm(acc, d, w, out_dtype=float32, out=acc)": lambda d, h, acc: torch.addmm(
            acc, d, w, out_dtype=torch.float32, out=acc),
        "mm(d, w, out=h)": lambda d, h, acc: torch.mm(d, w, out=h),
        "layer: mm(h, up.t())": lambda d, h, acc: torch.mm(h, up.t()),
        "layer: mm(d[:, :2I].t(), h)": lambda d, h, acc: torch.mm(d[:, : up.shape[0]].t(), h),
    }
    title = (f"## Fresh row counts: {count} of them (multiples of {multiple}), each product with ~{queue_ms:.0f} ms "
             f"queued ahead; BLAS library {torch.backends.cuda.preferred_blas_library()}")
    lines = ["", title, "",
             "| product | pass | launches that waited | host ms (max) | which waited, in order |", "|---|---|---|---|---|"]
    for name, product in products.items():
        for attempt in ("first use of each row count", "the same row counts again"):
            waited, worst, order = 0, 0.0, ""
            for n in rows:
                d = torch.randn(n, width, device=device, dtype=bf)
                h = torch.randn(n, hidden, device=device, dtype=bf)
                acc = torch.zeros(n, hidden, device=device)
                torch.cuda.synchronize()
                _queue(queue_ms, filler, per_mm)
                t0 = time.perf_counter()
                product(d, h, acc)
                ms = (time.perf_counter() - t0) * 1e3
                waited += ms > queue_ms / 2
                order += "1" if ms > queue_ms / 2 else "0"
                worst = max(worst, ms)
                torch.cuda.synchronize()
            lines.append(f"| `{name}` | {attempt} | {waited} of {count} | {worst:.1f} | {order} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=7000)
    p.add_argument("--width", type=int, default=88832)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--queue-ms", type=float, default=100.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fresh", type=int, default=12, help="row counts never used before, for the fresh-shape table")
    p.add_argument("--multiple", type=int, default=1, help="round the fresh row counts up to a multiple of this")
    p.add_argument("--blas", default=None, choices=["cublas", "cublaslt"], help="torch's preferred BLAS library")
    p.add_argument("--tag", default="", help="appended to the report's file name")
    p.add_argument("--smoke", action="store_true", help="the CPU plumbing run: nothing to measure there")
    p.add_argument("--only-fresh", action="store_true", help="only the fresh-shape table")
    args = p.parse_args()
    if args.smoke or not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return 0
    device = torch.device("cuda")
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    filler = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16),) * 2
    for _ in range(3):
        torch.mm(*filler)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.mm(*filler)
    end.record()
    end.synchronize()
    per_mm = start.elapsed_time(end) / 10
    ops = _ops(args.rows, args.width, args.hidden, device)
    for fn in ops.values():  # first uses (cuBLAS handles, heuristics) before any timing
        getattr(fn, "prepare", lambda: None)()
        fn()
    torch.cuda.synchronize()
    setup = (f"torch {torch.__version__}, {torch.cuda.get_device_name()}; rows {args.rows}, width {args.width}, "
             f"hidden {args.hidden}; an 8192^3 bf16 matmul {per_mm:.2f} ms")
    lines = [f"# Host time of ops with ~{args.queue_ms:.0f} ms of work queued ahead of them", "", setup, "",
             "| op | host ms (median of reps) | queue left after it (ms) | waits? |", "|---|---|---|---|"]
    for name, fn in ({} if args.only_fresh else ops).items():
        host, left = [], []
        for _ in range(args.reps):
            getattr(fn, "prepare", lambda: None)()
            torch.cuda.synchronize()
            _queue(args.queue_ms, filler, per_mm)
            mark = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            mark.record()
            t1 = time.perf_counter()
            mark.synchronize()
            left.append((time.perf_counter() - t1) * 1e3)
        host.sort(), left.sort()
        h, q = host[len(host) // 2], left[len(left) // 2]
        lines.append(f"| `{name}` | {h:.2f} | {q:.1f} | {'yes' if h > args.queue_ms / 2 else 'no'} |")
        torch.cuda.synchronize()
    lines += fresh_shape_rows(device, args.queue_ms, filler, per_mm, args.fresh, args.hidden, multiple=args.multiple)
    emit_report("\n".join(lines), f"host_blocking_ops{args.tag}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
