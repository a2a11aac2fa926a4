"""What the LM head's row chunk costs: the fused head's forward+backward time and peak at each
chunk size the memory policy picks from, to fit ``HEAD_CHUNK_PENALTY``
(``dtree/plan/plan_candidates.py``: the extra head time of a chunk, as a fraction of the
head's time at 4,096 rows).

    python benchmarks/head_chunk_cost.py --out benchmarks/results   # H100/H200, ~20 s
    python benchmarks/head_chunk_cost.py --smoke                     # CPU, tiny, plumbing only

For each row count (a call's predictions) and chunk: median CUDA time of
``token_logprobs_triton`` forward+backward (hidden states, weight; gradients on the log-probs)
over ``--reps`` after a warm-up, and the allocator's peak above the inputs. The penalty of a
chunk is its time over the 4,096-row chunk's, minus one, at the same rows; the fit is its
mean over the row counts, rounded to 0.01 (negative values, a smaller chunk being faster, are
kept as measured). ``--out`` writes ``DIR/head_chunk_cost_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

from dtree.ops.logprobs.fused_head import token_logprobs_triton  # noqa: E402
from dtree.plan.memory_policy import LOGPROB_CHUNKS  # noqa: E402
from dtree.plan.plan_candidates import HEAD_CHUNK_PENALTY  # noqa: E402

REFERENCE_CHUNK = 4096


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", default="2048,8192,16384,32768", help="comma-separated row counts")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (the torch stages)")
    p.add_argument("--out", default=None, help="directory for the Markdown report")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.vocab, args.rows, args.reps = 16, 300, "64,256", 1
    args.rows = [int(r) for r in args.rows.split(",") if r]
    if not args.rows or min(args.rows) < 1 or args.reps < 1:
        p.error("--rows needs positive row counts and --reps at least 1")
    return args


def time_one(h, w, labels, chunk: int, reps: int, device: torch.device) -> tuple[float, float]:
    """(median ms of forward+backward, peak bytes above the inputs)."""
    times = []
    for rep in range(reps + 1):  # the first is the warm-up
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        logp, _ = token_logprobs_triton(hh, ww, labels, chunk_size=chunk)
        torch.autograd.grad(logp.sum(), (hh, ww))
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            ms, peak = start.elapsed_time(end), torch.cuda.max_memory_allocated() - base
        else:
            ms, peak = (time.perf_counter() - t0) * 1e3, float("nan")
        if rep:
            times.append(ms)
    return statistics.median(times), peak


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, generator=gen, device=device) * 0.02).to(dtype)
    chunks = sorted(set(LOGPROB_CHUNKS) | {REFERENCE_CHUNK})
    rows_out, penalties = [], {c: [] for c in chunks}
    for n in args.rows:
        h = torch.randn(n, args.hidden, generator=gen, device=device).to(dtype)
        labels = torch.randint(0, args.vocab, (n,), generator=gen, device=device)
        got = {c: time_one(h, w, labels, c, args.reps, device) for c in chunks}
        ref = got[REFERENCE_CHUNK][0]
        for c in chunks:
            ms, peak = got[c]
            penalties[c].append(ms / ref - 1.0)
            rows_out.append((n, c, ms, peak, ms / ref - 1.0))
        print(f"rows {n}: " + ", ".join(f"chunk {c} {got[c][0]:.2f} ms" for c in chunks), file=sys.stderr)
    fit = {c: round(statistics.mean(p), 2) for c, p in penalties.items()}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = [
        f"# LM head chunk cost: {name}",
        "",
        f"torch {torch.__version__}, hidden {args.hidden}, vocab {args.vocab}, {dtype}, fused head "
        f"(`token_logprobs_triton`), forward+backward, median of {args.reps}",
        "",
        "| rows | chunk | fwd+bwd (ms) | peak above inputs (MiB) | over the 4,096-row chunk |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {c} | {ms:.2f} | {peak / 2**20:.0f} | {pen:+.1%} |" for n, c, ms, peak, pen in rows_out]
    lines += ["", f"Fitted penalty (mean over rows): `{fit}`; in the policy now: `{HEAD_CHUNK_PENALTY}`"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = name.lower().replace("nvidia ", "").replace(" ", "-")
        with open(os.path.join(args.out, f"head_chunk_cost_{tag}.md"), "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
