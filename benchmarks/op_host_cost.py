"""Host time per launch of the ops a decoder layer is made of, on the GPU machine.

The memory-capped 64k steps are partly host-bound (``benchmarks/queue_depth.py``: the queue's
depth falls to zero in some of their checkpointed forwards), and the sampled profiles put
much of their host time in ``Linear.forward`` (70-190 us per call inside steps) and the
autograd engine. This script times, per op and per call, the host's cost of issuing it, on
inputs small enough (``--rows``) that the GPU never holds the host back:

* projections as a decoder layer runs them: ``F.linear`` with and without bias, the same
  as ``torch.mm``/``torch.addmm`` on a transposed weight, and q, k, v as one fused
  projection against three;
* the same with autograd recording, forward and backward;
* a Triton launch (dtree's RMSNorm) and a plain torch elementwise op, for scale.

The GPU column is the events' elapsed time per call; where it equals the host's, the GPU
waited for the host between calls, and the host column is the cost of issuing the op.

    python benchmarks/op_host_cost.py                 # CUDA
    python benchmarks/op_host_cost.py --rows 64       # smaller still

Prints Markdown, also written to ``$OUT/op_host_cost.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtree.bench.measure import emit_report  # noqa: E402


def per_call(fn, device: torch.device, iters: int) -> tuple[float, float]:
    """(host us, GPU us) per call of ``fn`` after a warm-up."""
    for _ in range(20):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = end = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    gpu = float("nan")
    if end is not None:
        end.record()
        end.synchronize()
        gpu = start.elapsed_time(end) / iters * 1e3
    return host, gpu


def cases(rows: int, hidden: int, kv: int, device: torch.device, dtype: torch.dtype) -> dict:
    """name -> a function issuing one call (qwen2.5-1.5b's projection shapes by default)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, grad=False):
        return (torch.randn(*shape, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_(grad)

    x = rand(rows, hidden)
    wq, wk, wv = rand(hidden, hidden), rand(kv, hidden), rand(kv, hidden)
    bq, bk, bv = rand(hidden), rand(kv), rand(kv)
    wqkv, bqkv = torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv])
    wq_t = wq.t()
    xg = rand(rows, hidden, grad=True)
    wqg, wkg, wvg = rand(hidden, hidden, grad=True), rand(kv, hidden, grad=True), rand(kv, hidden, grad=True)
    bqg, bkg, bvg = rand(hidden, grad=True), rand(kv, grad=True), rand(kv, grad=True)
    dq, dk = torch.ones(rows, hidden, device=device, dtype=dtype), torch.ones(rows, kv, device=device, dtype=dtype)
    out: dict = {
        "F.linear(x, W, b) [T,1536]x[1536,1536]": lambda: F.linear(x, wq, bq),
        "F.linear(x, W) no bias": lambda: F.linear(x, wq),
        "torch.mm(x, W.t())": lambda: torch.mm(x, wq_t),
        "torch.addmm(b, x, W.t())": lambda: torch.addmm(bq, x, wq_t),
        "F.linear(x, Wk, bk) [T,1536]x[1536,256]": lambda: F.linear(x, wk, bk),
        "q, k, v: three F.linear with bias": lambda: (F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)),
        "q, k, v: one F.linear with bias, split": lambda: F.linear(x, wqkv, bqkv).split([hidden, kv, kv], -1),
        "x + x (elementwise)": lambda: x + x,
    }

    def with_grad_one():
        y = F.linear(xg, wqg, bqg)
        torch.autograd.backward(y, dq)

    def with_grad_three():
        ys = (F.linear(xg, wqg, bqg), F.linear(xg, wkg, bkg), F.linear(xg, wvg, bvg))
        torch.autograd.backward(ys, (dq, dk, dk))

    def with_grad_fused():
        w = torch.cat([wqg, wkg, wvg])
        b = torch.cat([bqg, bkg, bvg])
        q, k, v = F.linear(xg, w, b).split([hidden, kv, kv], -1)
        torch.autograd.backward((q, k, v), (dq, dk, dk))

    out["autograd: F.linear with bias, forward+backward"] = with_grad_one
    out["autograd: q, k, v three F.linear, forward+backward"] = with_grad_three
    out["autograd: q, k, v one fused F.linear (cat), forward+backward"] = with_grad_fused
    if device.type == "cuda":
        from dtree.ops.rms_norm.interface import rms_norm

        wn = rand(hidden)
        out["dtree rms_norm (Triton launch)"] = lambda: rms_norm(x, wn, 1e-6)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lines = [f"# Host time per call ({device.type}, {dtype}, {args.rows} rows, torch {torch.__version__})", "",
             "| op | host us | GPU us |", "|---|---|---|"]
    for name, fn in cases(args.rows, 1536, 256, device, dtype).items():
        host, gpu = per_call(fn, device, args.iters)
        lines.append(f"| {name} | {host:.1f} | {gpu:.1f} |")
    emit_report("\n".join(lines), "op_host_cost.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
