"""flash-attn as a backend for dtree's stack attention, against the fused Triton kernel and SDPA.

    python benchmarks/bench_flash_backend.py --out benchmarks/results     # GPU, ~1-2 minutes
    python benchmarks/bench_flash_backend.py --smoke                      # CPU, tiny, no timing of kernels

Backends of ``stack_attention`` (one call of one layer, all segments packed):

* ``triton``: ``dtree.ops.stack_attention.triton_autograd``, ancestors read from the stack in place;
* ``flash_attn``: ``dtree.baselines.kernels.varlen_attention_flash.stack_attention_flash_attn``, every
  segment's ancestors gathered in front of its own K/V (a copy per call), one
  ``flash_attn_varlen_func`` (causal, bottom-right), prefix gradients added into the
  stack; skipped (and said so) when flash-attn does not import;
* ``sdpa``: ``stack_attention_sdpa``, one SDPA call per segment (dtree's portable path).

Layouts, qwen2.5-1.5b heads by default (12 q / 2 kv of 128): ``grpo`` a 2048-token prompt
shared by 8 answers of 512; ``agentic`` 32 tool results of 256 tokens in 4 branches, each
under a shared 4096-token task prefix plus its branch's own 1024-token history (two
ranges per prefix). Then the linearized baseline's packed varlen (``grpo`` as 8
sequences of 2560) through flash-attn's ``flash_attn_varlen_func``, torch's
``varlen_attn`` (FlashAttention-2 inside torch) and per-sequence SDPA.

First each backend is checked against ``stack_attention_reference`` (float32 math):
output, dq, dk, dv and the stack gradients, max errors listed, with a coarse bf16 gate
(2e-2 / 5e-2 of the largest reference value; the flash-attention rule itself is in
``tests/test_varlen_attention_flash.py`` and ``tests/test_stack_attention_triton.py``);
then median ``triton.testing.do_bench`` times, forward and forward+backward,
TFLOP/s over the visible (query, key) pairs (forward 4 D Hq per pair, backward 2.5x).
A short table is printed last; ``--out DIR`` writes ``DIR/flash_backend_<gpu>.md``.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dtree.baselines.kernels import varlen_attention_flash as vf  # noqa: E402
from dtree.baselines.kernels.varlen_attention import VarlenLayout  # noqa: E402
from dtree.baselines.kernels.varlen_interface import varlen_attention  # noqa: E402
from dtree.ops.stack_attention import (  # noqa: E402
    AttentionOptions,
    SegmentLayout,
    StackSlots,
    stack_attention_reference,
    stack_attention_sdpa,
)
from dtree.ops.stack_ops.kv_stack import KVStack  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", default="grpo,agentic")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny layouts, correctness of the portable backends only")
    p.add_argument("--out", default=None, help="directory for the Markdown report")
    return p.parse_args()


# --------------------------------------------------------------------------- layouts
def layout_of(lens, prefixes, used):
    """(SegmentLayout, tokens, stack slots in use) for segments ``lens`` whose own slots
    follow ``used`` ancestor slots."""
    q_off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return SegmentLayout(q_off, used + q_off[:-1], [tuple(p) for p in prefixes]), int(q_off[-1]), used


def layouts(names, smoke: bool) -> dict:
    k = 16 if smoke else 1  # the smoke run divides every length by 16
    prompt, answer = 2048 // k, 512 // k
    task, branch, tool = 4096 // k, 1024 // k, 256 // k
    branches = [((0, task), (task + b * branch, task + (b + 1) * branch)) for b in range(4)]
    all_layouts = {
        "grpo": (layout_of([answer] * 8, [((0, prompt),)] * 8, prompt), f"prompt {prompt}, 8 answers x {answer}"),
        "agentic": (
            layout_of([tool] * 32, [branches[i // 8] for i in range(32)], task + 4 * branch),
            f"32 x {tool} tool results, 4 branches of prefix {task} + {branch}",
        ),
    }
    return {n: all_layouts[n] for n in names}


def visible_pairs(layout: SegmentLayout) -> float:
    total = 0.0
    for i in range(layout.num_segments):
        n = int(layout.q_offsets[i + 1] - layout.q_offsets[i])
        p = sum(hi - lo for lo, hi in layout.prefix_ranges[i])
        total += n * p + n * (n + 1) / 2
    return total


def problem(layout, t, used, hq, hkv, d, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    stack = KVStack(1, used + t, hkv, d, dtype=dtype, device=device)
    stack.k[0, :used] = torch.randn(used, hkv, d, generator=gen).to(device, dtype)
    stack.v[0, :used] = torch.randn(used, hkv, d, generator=gen).to(device, dtype)
    stack.grad_k.zero_()
    stack.grad_v.zero_()
    q, k, v = (torch.randn(t, h, d, generator=gen).to(device, dtype).requires_grad_() for h in (hq, hkv, hkv))
    stack.k[0, used:] = k.detach()
    stack.v[0, used:] = v.detach()
    return stack, q, k, v


# --------------------------------------------------------------------------- backends
def backends(device) -> tuple[dict, dict]:
    """name -> stack attention fn, and name -> why it is absent."""
    fns, absent = {}, {}
    if device.type == "cuda":
        try:
            from dtree.ops.stack_attention.triton_autograd import stack_attention_triton

            fns["triton"] = stack_attention_triton
        except ImportError as e:
            absent["triton"] = str(e)
        if vf.flash_attn_impl() is not None:
            fns["flash_attn"] = vf.stack_attention_flash_attn
        else:
            absent["flash_attn"] = "flash-attn is not importable here"
    else:
        absent["triton"] = absent["flash_attn"] = "CUDA only"
    fns["sdpa"] = stack_attention_sdpa
    return fns, absent


def outputs(fn, layout, t, used, hq, hkv, d, dtype, device, go):
    stack, q, k, v = problem(layout, t, used, hq, hkv, d, dtype, device)
    out = fn(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=d**-0.5))
    grads = torch.autograd.grad(out, (q, k, v), go.to(dtype))
    return [out, *grads, stack.grad_k[0, :used].clone(), stack.grad_v[0, :used].clone()]


def check(name, fn, layout, t, used, hq, hkv, d, device, dtype) -> str:
    """Max errors vs the float32 reference, against the reference's own at ``dtype``."""
    go = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(1)).to(device)
    exact = outputs(stack_attention_reference, layout, t, used, hq, hkv, d, torch.float32, device, go)
    got = outputs(fn, layout, t, used, hq, hkv, d, dtype, device, go)
    cells, ok = [], True
    for i, (g, e) in enumerate(zip(got, exact)):
        err = (g.float() - e).abs().max().item()
        bound = (2e-2 if i == 0 else 5e-2) * max(1.0, e.abs().max().item())  # bf16 scale: a coarse gate
        ok &= err <= bound
        cells.append(f"{err:.1e}")
    return " / ".join(cells) + ("" if ok else " FAIL")


def bench_ms(fn, grads=None) -> float:
    from triton.testing import do_bench

    return do_bench(fn, grad_to_none=grads, return_mode="median")


def time_backend(fn, layout, t, used, hq, hkv, d, dtype, device) -> tuple[float, float]:
    stack, q, k, v = problem(layout, t, used, hq, hkv, d, dtype, device)
    go = torch.randn_like(q)
    slots, options = StackSlots(stack, 0, layout), AttentionOptions(scale=d**-0.5)
    call = lambda q, k, v: fn(q, k, v, slots, options)  # noqa: E731

    def fwd():
        with torch.no_grad():
            call(q, k, v)

    def fwd_bwd():
        call(q, k, v).backward(go)

    return bench_ms(fwd), bench_ms(fwd_bwd, grads=[q, k, v])


def linearized(lengths, hq, hkv, d, dtype, device) -> dict[str, tuple[float, float]]:
    """The linearized baseline's varlen attention: flash-attn vs torch's varlen_attn vs SDPA."""
    layout = VarlenLayout.from_lengths(lengths)
    t = layout.num_tokens
    q, k, v = (torch.randn(t, h, d, device=device, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    go = torch.randn_like(q)
    fns = {"sdpa": functools.partial(varlen_attention, backend="sdpa"),
           "torch varlen_attn": functools.partial(varlen_attention, backend="flash")}
    if vf.flash_attn_impl() is not None:
        fns["flash_attn"] = vf.varlen_attention_flash_attn
    out = {}
    for name, fn in fns.items():
        def fwd(fn=fn):
            with torch.no_grad():
                fn(q, k, v, layout, d**-0.5)

        def fwd_bwd(fn=fn):
            fn(q, k, v, layout, d**-0.5).backward(go)

        try:
            out[name] = (bench_ms(fwd), bench_ms(fwd_bwd, grads=[q, k, v]))
        except (RuntimeError, ValueError) as e:
            out[name] = (float("nan"), float("nan"))
            print(f"linearized {name}: {e}")
    return out


def table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def main() -> int:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d = (args.heads, args.kv_heads, args.head_dim) if not args.smoke else (4, 2, 16)
    started = time.time()
    fns, absent = backends(device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    import triton

    head = (f"{gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}, Triton {triton.__version__}, "
            f"Python {platform.python_version()}; flash-attn: {vf.flash_attn_impl() or 'not importable'}; "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    print(head)
    for name, why in absent.items():
        print(f"skipped {name}: {why}")

    check_rows, time_rows = [], []
    for name, ((layout, t, used), note) in layouts(args.layouts.split(","), args.smoke).items():
        for backend, fn in fns.items():
            check_rows.append([name, backend, check(backend, fn, layout, t, used, hq, hkv, d, device, dtype)])
            print(check_rows[-1])
        if device.type != "cuda":
            continue
        flops = 4 * d * hq * visible_pairs(layout)
        times = {b: time_backend(fn, layout, t, used, hq, hkv, d, dtype, device) for b, fn in fns.items()}
        for backend, (f_ms, fb_ms) in times.items():
            time_rows.append([name, note, backend, f"{f_ms:.3f}", f"{flops / f_ms / 1e9:.0f}", f"{fb_ms:.3f}",
                              f"{3.5 * flops / fb_ms / 1e9:.0f}", f"{times['triton'][1] / fb_ms:.2f}x" if "triton" in times else "-"])
            print(time_rows[-1])
        torch.cuda.empty_cache()

    lin_rows = []
    if device.type == "cuda":
        for name, (f_ms, fb_ms) in linearized([2560] * 8, hq, hkv, d, dtype, device).items():
            lin_rows.append(["8 x 2560", name, f"{f_ms:.3f}", f"{fb_ms:.3f}"])

    check_header = ["layout", "backend", "max error vs float32 reference: out / dq / dk / dv / stack dk / stack dv"]
    time_header = ["layout", "", "backend", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "speed vs triton"]
    lines = [
        "# flash-attn as a stack-attention backend",
        "",
        head + f"; {hq} q / {hkv} kv heads of {d}, {str(dtype).replace('torch.', '')}; {time.time() - started:.0f} s.",
        "",
        *(f"- skipped {n}: {w}" for n, w in absent.items()),
        "",
        "## Correctness (one call, against stack_attention_reference in float32)",
        "",
        *table(check_header, check_rows),
    ]
    if time_rows:
        lines += ["", "## Stack attention, one layer, one call", "", *table(time_header, time_rows)]
    if lin_rows:
        lines += ["", "## Linearized varlen attention (grpo: 8 sequences of 2560)", "",
                  *table(["batch", "backend", "fwd ms", "fwd+bwd ms"], lin_rows)]
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"flash_backend_{re.sub(r'[^A-Za-z0-9]+', '_', gpu).strip('_').lower()}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    print()
    print("\n".join(table(time_header, time_rows) if time_rows else table(check_header, check_rows)))
    if lin_rows:
        print("\n".join(table(["batch", "backend", "fwd ms", "fwd+bwd ms"], lin_rows)))
    return 1 if any("FAIL" in r[-1] for r in check_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
