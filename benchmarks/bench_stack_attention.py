"""Kernel benchmark of dtree's stack attention backends against FlashAttention on the
equivalent dense batch.

    python benchmarks/bench_stack_attention.py                          # bf16, 32 q / 8 kv heads of 128
    python benchmarks/bench_stack_attention.py --heads 12 --kv-heads 2   # qwen2.5-1.5b's heads
    python benchmarks/bench_stack_attention.py --out benchmarks/results
    python benchmarks/bench_stack_attention.py --smoke                  # CPU, tiny, interpreter

For each layout (``stack_attention_cases.py``) one call, every implementation on the
same inputs:

* ``triton fused``: ``dtree.ops.stack_attention.triton_autograd``, every segment in one launch,
  ancestors read from the KV stack in place, prefix dK/dV added with float atomics, dq
  added by the dK/dV kernel with float atomics (``backward="fused"``, 5 matmuls per
  pair); ``triton split``: dq from a kernel of its own (``backward="split"``, 7
  matmuls); ``triton det``: ``deterministic=True`` (the split backward, ordered prefix
  adds); the report names the default (``DEFAULT_BACKWARD``);
* ``flash-attn``: the ``flash-attn`` backend (``dtree.ops.stack_attention.flash4``):
  flash-attn-4 varlen calls per region, stack read in place, merged by log-sum-exp;
  ``flash-attn det``: its deterministic backward (when flash-attn-4 imports);
* ``fa4 gathered``: ``varlen_attention_flash.stack_attention_flash_attn``, every
  prefix gathered in front of its segment, one flash-attn varlen call;
* ``sdpa dense``: ``F.scaled_dot_product_attention`` (flash backend) over the dense
  batch, ancestors copied in front of each segment, K/V heads repeated (the
  linearized computation; copies not timed);
* ``fa4 dense``: flash-attn-4's own kernel on that dense batch (grouped-query attention in
  the kernel, copies not timed): what FlashAttention-class kernels reach on the same
  (query, key) pairs without a tree, so its backward/forward ratio is the one to compare
  the stack kernels' with;
* ``regions (torch)``: only with ``--smoke``, the region path with the pure-torch kernel.

Reported per implementation: median ``do_bench`` ms of the forward and of
forward+backward, TFLOP/s over the visible (query, key) pairs (forward 4 D Hq per pair,
backward 2.5x that, FlashAttention's convention), the backward/forward time ratio, the
GPU time of its kernels per forward+backward (torch.profiler; below the wall time when
the host cannot keep up) and its longest kernels, the largest error of the output and
of every gradient (dq, dk, dv, the stack's dK/dV) relative to the largest value of
``stack_attention_reference`` in float32 on the same inputs, and whether two runs gave
bitwise-identical results. Then the attention options (``--option-cases``) of the
Triton kernel. ``--out DIR`` writes ``DIR/stack_attention_<gpu>[_<tag>].md``.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stack_attention_cases import (  # noqa: E402
    Case,
    bench_ms,
    bind,
    cases,
    dense_inputs,
    environment,
    fa4_dense,
    fa4_dense_inputs,
    flash,
    kernel_ms,
    short_kernel_name,
    stack_inputs,
    table,
    variant,
)

from dtree.ops.stack_attention import stack_attention_reference  # noqa: E402
from dtree.ops.stack_ops.kv_stack import KVStack  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRADS = ["out", "dq", "dk", "dv", "stack dk", "stack dv"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", default="grpo,agentic,grpo_long,chain,many_small", help="comma-separated ('' for none)")
    p.add_argument("--impls", default="", help="comma-separated subset of the implementations (default: all)")
    p.add_argument("--option-cases", default="window,softcap,sinks", help="comma-separated subset ('' for none)")
    p.add_argument("--smoke", action="store_true", help="tiny layouts on the CPU under the Triton interpreter")
    p.add_argument("--out", default=None, help="directory for the Markdown report")
    p.add_argument("--tag", default="", help="suffix of the report's file name")
    return p.parse_args()


# --------------------------------------------------------------------------- implementations
def implementations(sat, smoke: bool, wanted: str) -> tuple[dict, dict]:
    """name -> stack attention fn (the backends' signature), and name -> why absent."""
    fns, absent = {
        "triton fused": variant(sat.stack_attention_triton_tuned, False, backward="fused"),
        "triton split": variant(sat.stack_attention_triton_tuned, False, backward="split"),
        "triton det": variant(sat.stack_attention_triton, True),
    }, {}
    if smoke:
        from dtree.ops.stack_attention.regions import stack_attention_regions

        fns["regions (torch)"] = stack_attention_regions
    else:
        from dtree.baselines.kernels import varlen_attention_flash as vf
        from dtree.ops.backends import Target
        from dtree.ops.stack_attention.flash4 import flash4_unavailable, stack_attention_flash4

        why = flash4_unavailable(Target(torch.device("cuda"), torch.bfloat16, head_dim=128))
        if why is None:
            from dtree.ops.stack_attention.flash4 import FLASH4_REGIONS
            from dtree.ops.stack_attention.regions import stack_attention_regions

            fns["flash-attn"] = variant(stack_attention_flash4, False)  # one masked call (flash4_masked_call)
            fns["flash-attn regions"] = variant(functools.partial(stack_attention_regions, kernel=FLASH4_REGIONS), False)
            fns["flash-attn det"] = variant(stack_attention_flash4, True)
        else:
            absent["flash-attn"] = why
        if vf.flash_attn_impl() == "flash-attn-4":
            fns["fa4 gathered"] = vf.stack_attention_flash_attn
        else:
            absent["fa4 gathered"] = f"flash-attn-4 not importable (found {vf.flash_attn_impl()})"
    if wanted:
        keep = set(wanted.split(","))
        fns = {n: f for n, f in fns.items() if n in keep}
    return fns, absent


def reference_results(case: Case, stack: KVStack, q, k, v, go) -> list[torch.Tensor]:
    """out, dq, dk, dv, stack dK, stack dV of ``stack_attention_reference`` in float32."""
    ref = KVStack(1, stack.capacity, stack.num_kv_heads, stack.head_dim, dtype=torch.float32, device=q.device)
    ref.k.copy_(stack.k)
    ref.v.copy_(stack.v)
    ref.zero_grad(0, ref.capacity)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = bind(stack_attention_reference, ref, case.layout, q.shape[-1] ** -0.5)(*leaves)
    grads = torch.autograd.grad(out, leaves, go.float())
    return [out.detach(), *grads, ref.grad_k[0, : case.slots].clone(), ref.grad_v[0, : case.slots].clone()]


def results(fn, case: Case, stack: KVStack, q, k, v, go) -> list[torch.Tensor]:
    stack.zero_grad(0, stack.capacity)
    out = bind(fn, stack, case.layout, q.shape[-1] ** -0.5)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), go)
    return [out.detach(), *grads, stack.grad_k[0, : case.slots].clone(), stack.grad_v[0, : case.slots].clone()]


def run_case(case: Case, args, fns: dict, dtype, device) -> dict:
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    stack, q, k, v = stack_inputs(case, hq, hkv, d, dtype, device)
    go = torch.randn(q.shape[0], hq, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    want = reference_results(case, stack, q, k, v, go)
    flops_fwd = 4 * d * hq * case.pairs()
    row = {"case": case.name, "note": case.note, "tokens": case.tokens, "impls": {}}
    for name, fn in fns.items():
        t0 = time.time()
        try:
            first = results(fn, case, stack, q, k, v, go)
            second = results(fn, case, stack, q, k, v, go)
        except Exception as e:  # noqa: BLE001 (report it and go on with the others)
            row["impls"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{case.name} {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        errs = [((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item() for g, w in zip(first, want)]
        bitwise = all(torch.equal(a, b) for a, b in zip(first, second))
        call = bind(fn, stack, case.layout, scale)
        m = measure(call, (q, k, v), go, flops_fwd)
        row["impls"][name] = {**m, "errors": errs, "bitwise": bitwise}
        print(f"{case.name} {name}: {m['fwd_bwd_tflops']:.0f} TFLOP/s fwd+bwd, {time.time() - t0:.1f} s",
              file=sys.stderr, flush=True)
    if device == "cuda":
        dense = dense_inputs(case, stack, q, k, v)
        go_dense = go.view(case.layout.num_segments, case.seg_len, hq, d).transpose(1, 2).contiguous()
        m = measure(functools.partial(flash, scale=scale), tuple(dense), go_dense, flops_fwd)
        with torch.no_grad():
            out_dense = flash(*dense, scale=scale).transpose(1, 2).reshape(want[0].shape).float()
        err = ((out_dense - want[0]).abs().max() / want[0].abs().max()).item()
        row["impls"]["sdpa dense"] = {**m, "errors": [err] + [float("nan")] * 5, "bitwise": None}
        if "fa4 gathered" in fns:  # flash-attn-4 imports: its own kernel on the same dense batch
            inputs, go_fa4 = fa4_dense_inputs(dense, go_dense, hq // hkv)
            m = measure(functools.partial(fa4_dense, scale=scale), tuple(inputs), go_fa4, flops_fwd)
            with torch.no_grad():
                out_fa4 = fa4_dense(*inputs, scale=scale).reshape(want[0].shape).float()
            err = ((out_fa4 - want[0]).abs().max() / want[0].abs().max()).item()
            row["impls"]["fa4 dense"] = {**m, "errors": [err] + [float("nan")] * 5, "bitwise": None}
    return row


def measure(call, inputs, go, flops_fwd: float) -> dict:
    """do_bench times (forward; forward+backward), TFLOP/s, and the GPU time of the kernels."""
    with torch.no_grad():
        ms_f = bench_ms(lambda: call(*inputs))
    ms_fb = bench_ms(lambda: call(*inputs).backward(go), grads=list(inputs))
    kernels = kernel_ms(lambda: call(*inputs).backward(go))
    gpu_ms = sum(kernels.values())
    return {
        "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "fwd_tflops": flops_fwd / ms_f / 1e9,
        "fwd_bwd_tflops": 3.5 * flops_fwd / ms_fb / 1e9, "bwd_over_fwd": (ms_fb - ms_f) / ms_f,
        "gpu_ms": gpu_ms or float("nan"), "gpu_tflops": 3.5 * flops_fwd / gpu_ms / 1e9 if gpu_ms else float("nan"),
        "kernels": list(kernels.items())[:6],
    }


# --------------------------------------------------------------------------- options
def forward(fn, inputs):
    return lambda: fn(*inputs)


def fwd_bwd(fn, inputs, go):
    return lambda: fn(*inputs).backward(go)


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
        "window": OptionCase("window", chain, {"window": window},
                             f"{chain.note}, window {window} (path 4x the window)"),
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
    with_opts = bind(sat.stack_attention_triton, stack, case.layout, scale, **opts)
    plain = bind(sat.stack_attention_triton, stack, case.layout, scale)
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
def report(rows: list[dict], option_rows: list[dict], args, env: dict, absent: dict, seconds: float) -> str:
    out = [
        "# Stack attention kernel benchmark",
        "",
        (
            f"{env['gpu']}, CUDA {env['cuda']}, torch {env['torch']}, Triton {env['triton']}, Python {env['python']}, "
            f"{env['flash_attn']}; {env['date']}. {args.dtype}, {args.heads} q heads / {args.kv_heads} kv heads of "
            f"{args.head_dim}; {seconds:.0f} s in all."
        ),
        "",
        *(f"- not run: {n}: {w}" for n, w in absent.items()),
        "",
        f"The Triton backend's default backward (`DEFAULT_BACKWARD`) is `{args.default_backward}`.",
        "",
        "TFLOP/s over the visible (query, key) pairs, the backward counted as 2.5x the forward. `bwd/fwd`: backward "
        "time over forward time (do_bench). `GPU ms`: the kernels' time per forward+backward (profiler). Errors: "
        "max |x - ref| / max |ref| against `stack_attention_reference` in float32, for "
        + ", ".join(GRADS) + ". `bitwise`: two runs gave identical outputs and gradients.",
    ]
    for r in rows:
        out += ["", f"## {r['case']}: {r['note']} ({r['tokens']} tokens)", ""]
        lines = []
        for name, m in r["impls"].items():
            if "error" in m:
                lines.append([name, m["error"]] + [""] * 7)
                continue
            errs = " / ".join("-" if e != e else f"{e:.1e}" for e in m["errors"])
            lines.append([
                name, f"{m['fwd_ms']:.3f} ({m['fwd_tflops']:.0f})",
                f"{m['fwd_bwd_ms']:.3f} ({m['fwd_bwd_tflops']:.0f})",
                f"{m['bwd_over_fwd']:.2f}", f"{m['gpu_ms']:.3f} ({m['gpu_tflops']:.0f})", errs,
                "-" if m["bitwise"] is None else ("yes" if m["bitwise"] else "no"),
            ])
        out += table(["impl", "fwd ms (TFLOP/s)", "fwd+bwd ms (TFLOP/s)", "bwd/fwd", "GPU ms (TFLOP/s)",
                      "errors", "bitwise"], lines)
        out += ["", "Longest kernels per forward+backward (ms):", ""]
        for name, m in r["impls"].items():
            if m.get("kernels"):
                out.append(f"- {name}: " + ", ".join(f"`{short_kernel_name(k)}` {t:.3f}" for k, t in m["kernels"]))
    if option_rows:
        out += option_report(option_rows)
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    if args.smoke:  # before Triton is imported: the kernels run under its interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        args.heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 16, "fp32"
    elif not torch.cuda.is_available():
        sys.exit("bench_stack_attention needs a CUDA GPU (or --smoke)")
    from dtree.ops.stack_attention import triton_autograd as sat

    device = "cpu" if args.smoke else "cuda"
    sat.require_triton(device)
    torch.manual_seed(0)
    start = time.time()
    fns, absent = implementations(sat, args.smoke, args.impls)
    args.default_backward = sat.DEFAULT_BACKWARD
    rows, option_rows = [], []
    for case in cases([n for n in args.layouts.split(",") if n], 64 if args.smoke else 1):
        t0 = time.time()
        rows.append(run_case(case, args, fns, DTYPES[args.dtype], device))
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{case.name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        write(report(rows, option_rows, args, environment(device), absent, time.time() - start), args)
    for oc in option_cases([n for n in args.option_cases.split(",") if n], args.smoke, args.heads):
        t0 = time.time()
        option_rows.append(run_option_case(oc, args, sat, DTYPES[args.dtype], device))
        print(f"{oc.name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    text = report(rows, option_rows, args, environment(device), absent, time.time() - start)
    print(text)
    write(text, args)


def write(text: str, args) -> None:
    """The report, rewritten after every layout (a run cut short keeps what it measured)."""
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    gpu = "cpu_smoke" if args.smoke else re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_").lower()
    path = os.path.join(args.out, f"stack_attention_{gpu}{'_' + args.tag if args.tag else ''}.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
