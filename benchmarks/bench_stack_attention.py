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
rows: what ``prefix_item_rows`` is for); ``chain`` one 2048-token segment under a
6144-token prefix; ``many_small`` 256 segments of 32 tokens, 16 groups of 16 siblings,
each under a shared 1024-token system prompt plus its group's 256-token context
(two-range prefixes).

Then, for the atomics-vs-segmented-reduction question in the kernel's docstring, the
dK/dV kernel's own time (torch.profiler) for ``prefix_item_rows`` = 256, 1024 (the
default), 4096 and unbounded, and the time of each kernel of one forward+backward.

Then the attention options (``--option-cases``): ``window``, a 4096-row chain under a
12288-slot prefix (a path of 16k, 4x the 4096 window), timed against the same call
without the window (full attention over the whole path) and against SDPA over only the
in-window keys (a banded boolean mask: the memory-efficient backend); ``softcap`` (50,
Gemma2's) and ``sinks`` on the ``grpo`` layout, against the same call without them.

Prints everything and, with ``--out DIR``, writes ``DIR/stack_attention_<gpu>.md``
(with GPU, CUDA, torch and Triton versions and the configs). About 1-2 minutes on an
H100 with the fixed configs.

``--smoke`` runs the option cases at tiny sizes in fp32 on the CPU, the kernels under
the Triton interpreter (no GPU needed; the times mean nothing): a check that the
script runs.
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

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PREFIX_ITEM_ROWS = [256, 1024, 4096, 1 << 30]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", default="grpo,grpo_long,chain,many_small", help="comma-separated subset ('' for none)")
    p.add_argument("--option-cases", default="window,softcap,sinks", help="comma-separated subset ('' for none)")
    p.add_argument("--smoke", action="store_true", help="tiny option cases on the CPU under the Triton interpreter")
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
def stack_inputs(case: Case, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str = "cuda"):
    """KV stack holding the ancestors, and this call's q, k, v (leaves)."""
    stack = KVStack(1, case.slots + case.tokens, hkv, d, dtype=dtype, device=device)
    stack.k[0, : case.slots].normal_()
    stack.v[0, : case.slots].normal_()
    stack.zero_grad(0, stack.capacity)
    q = torch.randn(case.tokens, hq, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(case.tokens, hkv, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(case.tokens, hkv, d, device=device, dtype=dtype, requires_grad=True)
    stack.store_kv(0, case.slots, k.detach(), v.detach())
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
    if not torch.cuda.is_available():  # --smoke: one timed call, to exercise the path
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
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
        for rows in PREFIX_ITEM_ROWS:
            kernel = functools.partial(sat.stack_attention_triton, prefix_item_rows=rows)
            tuned = functools.partial(stack_on_stack, kernel, stack, case.layout, scale)
            sweep[rows] = kernel_ms(fwd_bwd(tuned, (q, k, v), go)).get("_dkdv_kernel")
        row["dkdv_ms_by_prefix_item_rows"] = sweep
    return row


# --------------------------------------------------------------------------- options
class OptionCase:
    """A call timed with ``options`` and without them (same layout), and, for a window,
    against SDPA over only the in-window keys."""

    def __init__(self, name: str, case: Case, options: dict, note: str):
        self.name, self.case, self.options, self.note = name, case, options, note

    def pairs(self) -> float:
        """Visible (query, key) pairs with the options (a window drops the keys at
        distance >= window; query r of a segment is at depth prefix_len + r)."""
        window = self.options.get("window")
        if window is None:
            return self.case.pairs()
        depth = self.case.prefix_len + np.arange(self.case.seg_len)
        return float(self.case.layout.num_segments * np.minimum(depth + 1, window).sum())


def option_cases(names: list[str], smoke: bool, hq: int) -> list[OptionCase]:
    if smoke:  # tiny: path 64, window 16; 3 answers of 8 under a 16-token prompt
        chain = Case("chain", 16, [((0, 30), (30, 48))], "1 x 16 under a 48 prefix (2 ranges)")
        grpo = Case("grpo", 8, [((0, 16),)] * 3, "prompt 16, 3 answers x 8")
        window = 16
    else:
        chain = Case("chain", 4096, [((0, 12288),)], "1 segment x 4096 under a 12288 prefix")
        grpo = Case("grpo", 512, [((0, 2048),)] * 8, "prompt 2048, 8 answers x 512")
        window = 4096
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(0))
    all_cases = {
        "window": OptionCase("window", chain, {"window": window}, f"{chain.note}, window {window} (path 4x the window)"),
        "softcap": OptionCase("softcap", grpo, {"softcap": 50.0}, f"{grpo.note}, softcap 50"),
        "sinks": OptionCase("sinks", grpo, {"sinks": sinks}, f"{grpo.note}, sinks"),
    }
    return [all_cases[n] for n in names]


def windowed_sdpa_inputs(case: Case, window: int, stack: KVStack, q, k, v):
    """One segment's in-window keys (the last ``window - 1`` prefix slots + its own)
    as SDPA inputs [1, Hq, len, D], K/V heads repeated, and the banded boolean mask."""
    assert case.layout.num_segments == 1
    first = max(0, case.prefix_len - window + 1)
    index = case.layout.prefix_index(0, q.device)
    index = torch.arange(index.start, index.stop, device=q.device) if isinstance(index, slice) else index
    index = index[first:]
    group = q.shape[1] // k.shape[1]
    kk = torch.cat([stack.k[0, index], k.detach()]).repeat_interleave(group, 1)
    vv = torch.cat([stack.v[0, index], v.detach()]).repeat_interleave(group, 1)
    qs, ks, vs = (x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, kk, vv))
    tq, tk = qs.shape[2], ks.shape[2]
    dist = torch.arange(tq, device=q.device)[:, None] + (tk - tq) - torch.arange(tk, device=q.device)[None, :]
    return [qs, ks, vs], (dist >= 0) & (dist < window)


def sdpa_masked(q, k, v, *, scale, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def run_option_case(oc: OptionCase, args, sat, dtype, device) -> dict:
    case = oc.case
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    stack, q, k, v = stack_inputs(case, hq, hkv, d, dtype, device)
    opts = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in oc.options.items()}
    with_opts = functools.partial(stack_on_stack, functools.partial(sat.stack_attention_triton, **opts), stack,
                                  case.layout, scale)
    plain = functools.partial(stack_on_stack, sat.stack_attention_triton, stack, case.layout, scale)
    go = torch.randn(q.shape[0], hq, d, device=device, dtype=dtype)
    impls = {"triton": (with_opts, (q, k, v), go), "triton, no option": (plain, (q, k, v), go)}
    row = {"case": oc.name, "note": oc.note, "tokens": case.tokens, "pairs": oc.pairs()}
    if "window" in opts:
        dense, mask = windowed_sdpa_inputs(case, opts["window"], stack, q, k, v)
        go_dense = go.transpose(0, 1).unsqueeze(0).contiguous()
        impls["sdpa, in-window keys"] = (functools.partial(sdpa_masked, scale=scale, mask=mask), tuple(dense), go_dense)
        with torch.no_grad():
            want = sdpa_masked(*dense, scale=scale, mask=mask)[0].transpose(0, 1).float()
            row["diff_sdpa"] = (with_opts(q, k, v).float() - want).abs().max().item()
    flops_fwd = 4 * d * hq * row["pairs"]
    for name, (fn, inputs, g) in impls.items():
        with torch.no_grad():
            ms_f = bench_ms(forward(fn, inputs))
        ms_fb = bench_ms(fwd_bwd(fn, inputs, g), grads=list(inputs))
        row[name] = {"fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "fwd_tflops": flops_fwd / ms_f / 1e9,
                     "fwd_bwd_tflops": 3.5 * flops_fwd / ms_fb / 1e9}
    return row


def option_report(rows: list[dict]) -> list[str]:
    """Markdown table of the option cases: ms (and TFLOP/s of the visible pairs with the
    options) per implementation, and time ratios against the option-less call."""
    out = ["", "Attention options (fwd / fwd+bwd ms; TFLOP/s of the pairs visible with the options):", ""]
    header = ["case", "tokens", "visible pairs", "triton", "triton, no option", "sdpa, in-window keys",
              "no option / triton (fwd+bwd)"]
    lines = []
    for r in rows:
        cells = [f"{r['case']}: {r['note']}", str(r["tokens"]), f"{r['pairs']:.3g}"]
        for name in header[3:6]:
            m = r.get(name)
            cells.append("-" if m is None else (
                f"{m['fwd_ms']:.2f} / {m['fwd_bwd_ms']:.2f} ({m['fwd_tflops']:.0f} / {m['fwd_bwd_tflops']:.0f})"))
        cells.append(f"{r['triton, no option']['fwd_bwd_ms'] / r['triton']['fwd_bwd_ms']:.2f}x")
        lines.append(cells)
    out += table(header, lines)
    diffs = [f"{r['case']} {r['diff_sdpa']:.1e}" for r in rows if "diff_sdpa" in r]
    if diffs:
        out += ["", f"Max |triton - sdpa over the in-window keys| of the forward outputs: {', '.join(diffs)}."]
    return out


# --------------------------------------------------------------------------- report
def environment(device: str = "cuda") -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter; times are meaningless)",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def tuned_configs(sat) -> list[str]:
    """The configs that ran: the first fixed candidate of each kernel that fit."""
    lines = []
    for key, i in getattr(sat, "_FITTING", {}).items():
        kernel, table, dtype = key[:3]
        inner, warps, stages = sat._fixed_candidates(kernel, table, dtype)[i]
        lines.append(f"{kernel} {key}: {sat._INNER_NAME[kernel]} {inner}, num_warps {warps}, num_stages {stages}")
    return lines


def table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + ["| " + " | ".join(c) + " |" for c in lines]


def report(rows: list[dict], option_rows: list[dict], args, env: dict, sat, seconds: float) -> str:
    impls = ["triton", "flash", "dtree sdpa"]
    mode = "fixed configs"
    out = [
        "# Stack attention kernel benchmark",
        "",
        (
            f"{env['gpu']}, CUDA {env['cuda']}, torch {env['torch']}, Triton {env['triton']}, "
            f"Python {env['python']}, {env['date']}. {args.dtype}, {args.heads} q heads / {args.kv_heads} kv heads "
            f"of {args.head_dim}; {mode}; {seconds:.0f} s in all."
        ),
    ]
    if not rows:
        return "\n".join(out + option_report(option_rows)) + "\n"
    out += [
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
            "dK/dV kernel time (ms) by `prefix_item_rows`, the query rows per prefix work item (fewer rows: more "
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
    if option_rows:
        out += option_report(option_rows)
    configs = tuned_configs(sat)
    if configs:
        out += ["", "Configs (kernel (key): config):", ""] + [f"- `{c}`" for c in configs]
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    if args.smoke:  # before Triton is imported: the kernels run under its interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        args.layouts, args.heads, args.kv_heads, args.head_dim, args.dtype = "", 4, 2, 16, "fp32"
    elif not torch.cuda.is_available():
        sys.exit("bench_stack_attention needs a CUDA GPU (or --smoke)")
    from dtree.ops import stack_attention_triton as sat

    device = "cpu" if args.smoke else "cuda"
    sat.require_triton(device)
    torch.manual_seed(0)
    start = time.time()
    rows, option_rows = [], []
    for case in cases([n for n in args.layouts.split(",") if n]):
        t0 = time.time()
        rows.append(run_case(case, args, sat, DTYPES[args.dtype]))
        torch.cuda.empty_cache()
        print(f"{case.name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    for oc in option_cases([n for n in args.option_cases.split(",") if n], args.smoke, args.heads):
        t0 = time.time()
        option_rows.append(run_option_case(oc, args, sat, DTYPES[args.dtype], device))
        print(f"{oc.name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    text = report(rows, option_rows, args, environment(device), sat, time.time() - start)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = "cpu_smoke" if args.smoke else re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_").lower()
        path = os.path.join(args.out, f"stack_attention_{gpu}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
