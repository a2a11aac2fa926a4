"""Kernel benchmark of the fused Triton stack attention against FlashAttention (SDPA).

    python benchmarks/bench_stack_attention.py                   # bf16, 32 q / 8 kv heads of 128
    python benchmarks/bench_stack_attention.py --out benchmarks/results

For each layout, the same attention three ways, median time by
``triton.testing.do_bench``, forward and forward+backward:

* ``triton``: ``dtree.ops.stack_attention_triton``, every segment in one launch,
  ancestors read from the KV stack in place;
* ``flash``: ``F.scaled_dot_product_attention`` on the flash backend over the
  equivalent dense batch: one row per segment, its ancestors copied in front of its
  own keys, lower-right causal (the same query tokens and keys per query, i.e. the
  linearized computation). K/V are repeated to the q heads (the flash op takes equal
  head counts), which costs it memory traffic but no FLOPs;
* ``dtree sdpa``: the current default backend, one SDPA call per segment.

TFLOP/s count only the visible (query, key) pairs: forward 4 * D * Hq per pair, the
backward 2.5 times that (FlashAttention's convention), so the three are comparable.

Layouts (tokens of one call): ``grpo`` one 2048-token prompt shared by 8 answers of
512; ``grpo_long`` a 256-token prompt under 8 answers of 2048 (few prefix slots, many
rows: what ``_PREFIX_ITEM_ROWS`` is for); ``chain`` one 2048-token segment under a
6144-token prefix; ``many_small`` 256 segments of 32 tokens, 16 groups of 16 siblings,
each under a shared 1024-token system prompt plus its group's 256-token context
(two-range prefixes).

Then, for the atomics-vs-segmented-reduction question in the kernel's docstring, the
dK/dV kernel's own time (torch.profiler) for ``_PREFIX_ITEM_ROWS`` = 256, 1024 (the
default), 4096 and unbounded, and the time of each kernel of one forward+backward.

Prints everything and, with ``--out DIR``, writes ``DIR/stack_attention_<gpu>.md``
(with GPU, CUDA, torch and Triton versions and the tuned configs). About 1-2 minutes
on an H100, most of it compiling the autotuning candidates (``--fixed-config`` skips
the tuning).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from dtree.kv_stack import KVStack  # noqa: E402
from dtree.ops.stack_attention import SegmentLayout, stack_attention_sdpa  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PREFIX_ITEM_ROWS = [256, 1024, 4096, 1 << 30]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", default="grpo,grpo_long,chain,many_small", help="comma-separated subset")
    p.add_argument("--fixed-config", action="store_true", help="no autotuning (as DTREE_TRITON_AUTOTUNE=0)")
    p.add_argument("--out", default=None, help="directory for the Markdown report")
    return p.parse_args()


# --------------------------------------------------------------------------- layouts
class Case:
    """One call: segments of equal length ``seg_len`` with equal-length prefixes, so
    the dense equivalent is one batched SDPA call of ``len(prefixes)`` rows."""

    def __init__(self, name: str, seg_len: int, prefixes: list[tuple[tuple[int, int], ...]], note: str):
        self.name, self.seg_len, self.note = name, seg_len, note
        self.prefix_len = sum(hi - lo for lo, hi in prefixes[0])
        assert all(sum(hi - lo for lo, hi in p) == self.prefix_len for p in prefixes)
        self.slots = max(hi for p in prefixes for _, hi in p)
        n = len(prefixes)
        q_off = np.arange(n + 1, dtype=np.int64) * seg_len
        self.layout = SegmentLayout(q_off, self.slots + q_off[:-1], list(prefixes))
        self.tokens = n * seg_len

    def pairs(self) -> float:
        """Visible (query, key) pairs."""
        n = self.layout.num_segments
        return n * (self.seg_len * self.prefix_len + self.seg_len * (self.seg_len + 1) / 2)


def cases(names: list[str]) -> list[Case]:
    groups = [((0, 1024), (1024 + 256 * g, 1024 + 256 * (g + 1))) for g in range(16)]
    all_cases = {
        "grpo": Case("grpo", 512, [((0, 2048),)] * 8, "prompt 2048, 8 answers x 512"),
        "grpo_long": Case("grpo_long", 2048, [((0, 256),)] * 8, "prompt 256, 8 answers x 2048"),
        "chain": Case("chain", 2048, [((0, 6144),)], "1 segment x 2048 under a 6144 prefix"),
        "many_small": Case(
            "many_small", 32, [groups[i // 16] for i in range(256)], "256 x 32 tokens, prefix 1024 + 256 (2 ranges)"
        ),
    }
    return [all_cases[n] for n in names]


# --------------------------------------------------------------------------- inputs
def stack_inputs(case: Case, hq: int, hkv: int, d: int, dtype: torch.dtype):
    """KV stack holding the ancestors, and this call's q, k, v (leaves)."""
    stack = KVStack(1, case.slots + case.tokens, hkv, d, dtype=dtype, device="cuda")
    stack.k[0, : case.slots].normal_()
    stack.v[0, : case.slots].normal_()
    stack.zero_grad(0, stack.capacity)
    q = torch.randn(case.tokens, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(case.tokens, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(case.tokens, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    stack.write(0, case.slots, k.detach(), v.detach())
    return stack, q, k, v


def dense_inputs(case: Case, stack: KVStack, q, k, v):
    """The equivalent dense batch [segments, Hq, len, D] / [segments, Hq, prefix + len, D]:
    each segment's ancestors gathered in front of its own keys, K/V heads repeated."""
    n, length, group = case.layout.num_segments, case.seg_len, q.shape[1] // k.shape[1]
    rows = []
    for own, store in ((k.detach(), stack.k[0]), (v.detach(), stack.v[0])):
        batch = [
            torch.cat([store[case.layout.prefix_index(i, q.device)], own[i * length : (i + 1) * length]])
            for i in range(n)
        ]
        rows.append(torch.stack(batch).repeat_interleave(group, dim=2).transpose(1, 2).contiguous())
    qd = q.detach().view(n, length, q.shape[1], q.shape[2]).transpose(1, 2).contiguous()
    return [x.requires_grad_() for x in (qd, *rows)]


def flash(q, k, v, *, scale):
    """SDPA on the flash backend, lower-right causal: q [B, H, Lq, D], k/v [B, H, Lk, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        mask = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# --------------------------------------------------------------------------- timing
def bench_ms(fn, grads=None) -> float:
    from triton.testing import do_bench

    return do_bench(fn, grad_to_none=grads, return_mode="median")


def forward(fn, inputs):
    return lambda: fn(*inputs)


def fwd_bwd(fn, inputs, go):
    return lambda: fn(*inputs).backward(go)


def kernel_ms(fn, iters: int = 10) -> dict[str, float]:
    """CUDA time per call of each Triton kernel of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        name = next((n for n in ("_fwd_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel") if n in event.key), None)
        if name:
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
            out[name] = out.get(name, 0.0) + total / iters / 1e3
    return out


def stack_on_stack(attention, stack, layout, scale, q, k, v):
    """A stack attention backend with the stack, layout and scale bound."""
    return attention(q, k, v, stack, 0, layout, scale)


def run_case(case: Case, args, sat, dtype) -> dict:
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    stack, q, k, v = stack_inputs(case, hq, hkv, d, dtype)
    triton_fn = functools.partial(stack_on_stack, sat.stack_attention_triton, stack, case.layout, scale)
    sdpa_fn = functools.partial(stack_on_stack, stack_attention_sdpa, stack, case.layout, scale)
    dense = dense_inputs(case, stack, q, k, v)
    go = torch.randn_like(q)
    go_dense = go.view(case.layout.num_segments, case.seg_len, hq, d).transpose(1, 2).contiguous()

    with torch.no_grad():  # sanity: one computation three ways
        out = triton_fn(q, k, v).float()
        err_sdpa = (out - sdpa_fn(q, k, v).float()).abs().max().item()
        out_dense = flash(*dense, scale=scale).transpose(1, 2).reshape(out.shape).float()
        err_flash = (out - out_dense).abs().max().item()

    flops_fwd = 4 * d * hq * case.pairs()
    row = {"case": case.name, "note": case.note, "tokens": case.tokens, "diff_sdpa": err_sdpa, "diff_flash": err_flash}
    impls = {
        "triton": (triton_fn, (q, k, v), go),
        "flash": (functools.partial(flash, scale=scale), tuple(dense), go_dense),
        "dtree sdpa": (sdpa_fn, (q, k, v), go),
    }
    for name, (fn, inputs, g) in impls.items():
        with torch.no_grad():
            ms_f = bench_ms(forward(fn, inputs))
        ms_fb = bench_ms(fwd_bwd(fn, inputs, g), grads=list(inputs))
        row[name] = {
            "fwd_ms": ms_f,
            "fwd_bwd_ms": ms_fb,
            "fwd_tflops": flops_fwd / ms_f / 1e9,
            "fwd_bwd_tflops": 3.5 * flops_fwd / ms_fb / 1e9,
        }

    row["kernels_ms"] = kernel_ms(fwd_bwd(triton_fn, (q, k, v), go))
    if case.layout.num_segments > 1 or case.prefix_len:
        sweep = {}
        default = sat._PREFIX_ITEM_ROWS
        try:
            for rows in PREFIX_ITEM_ROWS:
                sat._PREFIX_ITEM_ROWS = rows
                sweep[rows] = kernel_ms(fwd_bwd(triton_fn, (q, k, v), go)).get("_dkdv_kernel")
        finally:
            sat._PREFIX_ITEM_ROWS = default
        row["dkdv_ms_by_prefix_item_rows"] = sweep
    return row


# --------------------------------------------------------------------------- report
def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def tuned_configs(sat) -> list[str]:
    lines = []
    for name, tuner in getattr(sat, "_TUNED", {}).items():
        for key, config in tuner.cache.items():
            lines.append(f"{name} {key}: {config}")
    return lines


def table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + ["| " + " | ".join(c) + " |" for c in lines]


def report(rows: list[dict], args, env: dict, sat, seconds: float) -> str:
    impls = ["triton", "flash", "dtree sdpa"]
    mode = "fixed configs" if args.fixed_config else "autotuned"
    out = [
        "# Stack attention kernel benchmark",
        "",
        (
            f"{env['gpu']}, CUDA {env['cuda']}, torch {env['torch']}, Triton {env['triton']}, "
            f"Python {env['python']}, {env['date']}. {args.dtype}, {args.heads} q heads / {args.kv_heads} kv heads "
            f"of {args.head_dim}; {mode}; {seconds:.0f} s in all."
        ),
        "",
        "TFLOP/s (and median ms) of the visible (query, key) pairs; fwd+bwd counts the backward as 2.5x the forward.",
        "",
    ]
    header = ["layout", "tokens"] + [f"{i} {p}" for i in impls for p in ("fwd", "fwd+bwd")] + ["flash / triton time"]
    lines = []
    for r in rows:
        cells = [f"{r['case']}: {r['note']}", str(r["tokens"])]
        for i in impls:
            for p in ("fwd", "fwd_bwd"):
                cells.append(f"{r[i][p + '_tflops']:.0f} ({r[i][p + '_ms']:.2f} ms)")
        cells.append(f"{r['flash']['fwd_bwd_ms'] / r['triton']['fwd_bwd_ms']:.2f}x")
        lines.append(cells)
    out += table(header, lines)

    names = ["_fwd_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel"]
    out += ["", "Per-kernel time of one triton forward+backward (ms):", ""]
    kernel_rows = [[r["case"]] + [f"{r['kernels_ms'].get(n, float('nan')):.3f}" for n in names] for r in rows]
    out += table(["layout", *names], kernel_rows)

    out += [
        "",
        (
            "dK/dV kernel time (ms) by `_PREFIX_ITEM_ROWS`, the query rows per prefix work item (fewer rows: more "
            "programs and more atomic adds per stack slot; the default is 1024):"
        ),
        "",
    ]
    swept = [r for r in rows if "dkdv_ms_by_prefix_item_rows" in r]
    out += table(
        ["layout"] + ["unbounded" if n >= 1 << 30 else str(n) for n in PREFIX_ITEM_ROWS],
        [[r["case"]] + [f"{r['dkdv_ms_by_prefix_item_rows'][n]:.3f}" for n in PREFIX_ITEM_ROWS] for r in swept],
    )
    diffs = ", ".join(f"{r['case']} {r['diff_sdpa']:.1e} / {r['diff_flash']:.1e}" for r in rows)
    out += ["", f"Max |triton - dtree sdpa| / |triton - flash| of the forward outputs: {diffs}."]
    configs = tuned_configs(sat)
    if configs:
        out += ["", "Tuned configs (kernel (key): config):", ""] + [f"- `{c}`" for c in configs]
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_stack_attention needs a CUDA GPU")
    from dtree.ops import stack_attention_triton as sat

    sat.require_triton("cuda")
    if args.fixed_config:
        sat._AUTOTUNE = False
    torch.manual_seed(0)
    start = time.time()
    rows = []
    for case in cases(args.layouts.split(",")):
        t0 = time.time()
        rows.append(run_case(case, args, sat, DTYPES[args.dtype]))
        torch.cuda.empty_cache()
        print(f"{case.name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    text = report(rows, args, environment(), sat, time.time() - start)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_").lower()
        path = os.path.join(args.out, f"stack_attention_{gpu}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
