"""LM-head log-probs (+ entropy), forward and forward+backward: fused kernel vs the chunked torch op.

    python benchmarks/bench_logprobs.py --out benchmarks/results            # H100/H200, ~3 minutes
    python benchmarks/bench_logprobs.py --smoke                             # CPU, Triton interpreter, tiny

Implementations, all chunked over rows (``--chunk``), bf16 model dtype:

* ``reference``: ``dtree.ops.logprobs.token_logprobs``, the chunked torch op the kernel
  must match (float32 logits per chunk, backward recomputed). With the ``OutputHead``
  API it also gives a differentiable entropy; the older API has log-probs only, and the
  entropy cases are then left out for it.
* ``torch``: ``token_logprobs_triton(impl="torch")``, the same chunks, matmuls and float32
  ``dW`` accumulation as the fused op, with its elementwise stages in torch: what the
  Triton kernels alone buy.
* ``triton``: ``token_logprobs_triton`` (the fused op).

First a correctness check at vocab 151,936 (N = 1000, H = 1536) by the flash-attention
rule against the float32 full-logits reference (``token_logprobs_dense``): every output and
gradient of ``triton`` and ``torch`` must be within 2x (outputs) / 3x (gradients) the bf16
full-logits error, plus a floor; the reference op's errors are shown too. Then median
CUDA-event times over ``--reps`` (after one warm-up) for each (hidden, rows) shape, with
and without entropy (gradients arrive on both outputs when it is on), TFLOP/s counted as
2NHV forward and 8NHV forward+backward, and the peak memory above the inputs. Then the
CUDA time per kernel class (matmul / Triton / other) of one forward+backward, to check
the byte count of ``benchmarks/PERF_NOTES.md``, and each fused kernel alone on one
``[4096, V]`` chunk over a few launch shapes (ms, GB/s), to set ``_FWD`` / ``_BWD`` in
``dtree/ops/logprobs/triton_kernels.py``. A short table is printed last; ``--out``
writes ``DIR/logprobs_<gpu>.md``. Exits 1 when the correctness check fails (after the
report).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

VOCAB = 151936


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", default="1536,3584", help="comma-separated hidden sizes")
    p.add_argument("--rows", default="8192,16384,32768", help="comma-separated row counts N")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--chunk", type=int, default=4096, help="rows per chunk, every implementation")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--impls", default="reference,torch,triton")
    p.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter, tiny shapes")
    p.add_argument("--out", default=None, help="directory for the Markdown report")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.rows, args.vocab, args.chunk, args.reps = "24", "40", 500, 16, 1
    return args


# --------------------------------------------------------------------------- implementations
def implementations(lt):
    """name -> fn(hidden, weight, labels, with_entropy, chunk) -> (logp, entropy | None),
    or a string saying why it is absent."""
    from dtree.ops import logprobs as ref_mod
    from dtree.ops.logprobs import fused_head as fh  # the op beside its kernels (lt)

    if hasattr(ref_mod, "OutputHead"):  # the one LM-head op: (hidden, head, labels, chunk, *, ...)

        def reference(hidden, weight, labels, with_entropy, chunk):
            head = ref_mod.OutputHead(weight=weight, bias=None)
            return ref_mod.token_logprobs(hidden, head, labels, chunk, with_entropy=with_entropy)

        ref_entropy = True
    else:  # the older op: log-probs only

        def reference(hidden, weight, labels, with_entropy, chunk):
            if with_entropy:
                raise NotImplementedError("this dtree.ops.logprobs has no differentiable entropy")
            return ref_mod.token_logprobs(hidden, weight, labels, None, chunk), None

        ref_entropy = False

    def torch_stages(hidden, weight, labels, with_entropy, chunk):
        return fh.token_logprobs_triton(hidden, weight, labels, with_entropy=with_entropy, chunk_size=chunk, impl="torch")

    def fused(hidden, weight, labels, with_entropy, chunk):
        return fh.token_logprobs_triton(hidden, weight, labels, with_entropy=with_entropy, chunk_size=chunk, impl="triton")

    return {"reference": reference, "torch": torch_stages, "triton": fused}, ref_entropy


def inputs(n, h, v, device, dtype=torch.bfloat16, seed=0):
    """hidden [n, h] and weight [v, h] (leaves) with logits of std ~3, labels [n]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=gen) * (3.0 / h**0.5)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    return hidden, weight, labels


def step(fn, hidden, weight, labels, with_entropy, chunk, g, ge, backward=True):
    logp, ent = fn(hidden, weight, labels, with_entropy, chunk)
    if not backward:
        return None
    outs, seeds = [logp], [g]
    if with_entropy:
        outs.append(ent)
        seeds.append(ge)
    return torch.autograd.grad(outs, (hidden, weight), seeds)


# --------------------------------------------------------------------------- correctness
def correctness(impls, lt, device, v, smoke) -> tuple[list[list[str]], bool]:
    """Flash-rule check of every implementation at vocab ``v``; rows of the table and
    whether the fused and torch-stage ops passed."""
    from dtree.ops.logprobs import fused_head as fh  # the op beside its kernels (lt)

    n, h, chunk = (37, 24, 16) if smoke else (1000, 1536, 256)
    dtype = torch.float16 if smoke else torch.bfloat16  # the interpreter truncates bf16 stores
    hidden, weight, labels = inputs(n, h, v, device, dtype, seed=1)
    gen = torch.Generator(device=device).manual_seed(2)
    g, ge = torch.randn(n, device=device, generator=gen), torch.randn(n, device=device, generator=gen)
    kw = {"logit_scale": 1.0}

    def dense(precision, with_entropy):
        hd, wd = (x.detach().to(precision).requires_grad_() for x in (hidden, weight))
        fn = lambda hh, ww, yy, e, c: fh.token_logprobs_dense(hh, ww, yy, with_entropy=e, **kw)  # noqa: E731
        lp, ent = fn(hd, wd, labels, with_entropy, chunk)
        return [lp, ent, *step(fn, hd, wd, labels, with_entropy, chunk, g, ge)]

    rows, ok = [], True
    for with_entropy in (False, True):
        exact, same = dense(torch.float32, with_entropy), dense(dtype, with_entropy)
        for name, fn in impls.items():
            try:
                lp, ent = fn(hidden, weight, labels, with_entropy, chunk)
                got = [lp, ent, *step(fn, hidden, weight, labels, with_entropy, chunk, g, ge)]
            except NotImplementedError as e:
                rows.append([name, "yes" if with_entropy else "no", "-", "-", "-", "-", str(e)])
                continue
            cells, passed = [], True
            for i, (x, e, p) in enumerate(zip(got, exact, same)):
                if e is None:
                    cells.append("-")
                    continue
                err = (x.float() - e).abs().max().item()
                base = (p.float() - e).abs().max().item()
                factor, floor = (2, 1e-5) if i < 2 else (3, 1e-4)
                passed &= err <= factor * base + floor * max(1.0, e.abs().max().item())
                cells.append(f"{err:.2e} / {base:.2e}")
            if name != "reference":
                ok &= passed
            rows.append([name, "yes" if with_entropy else "no", *cells, "pass" if passed else "FAIL"])
    return rows, ok


# --------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, reps) -> float:
    from dtree.bench.measure import median_ms

    fn()  # warm-up (compiles the kernels on the first shape)
    sync(device)
    return median_ms(fn, device, reps)


def peak_gib(fn, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def kernel_classes(fn, device) -> dict[str, float]:
    """CUDA ms of one call by kernel class: matmul (cuBLAS), Triton (ours), other
    (torch elementwise/reductions/copies)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {"matmul": 0.0, "triton": 0.0, "other": 0.0}
    events = list(prof.key_averages())
    # kernels only: a CPU op's device time is its kernels' again
    kernels = [e for e in events if "CUDA" in str(getattr(e, "device_type", ""))] or events
    for event in kernels:
        total = (getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)) / 1e3
        key = event.key
        if key.startswith(("_row_stats_kernel", "_dlogits_kernel")):
            out["triton"] += total
        elif re.search(r"gemm|nvjet|cutlass|xmma|ampere_|Kernel2", key):
            out["matmul"] += total
        else:
            out["other"] += total
    return out


def kernel_configs(lt, device, v, rows=4096) -> list[list[str]]:
    """Time each fused kernel alone on a [rows, v] bf16 chunk over a few launch shapes
    (the defaults are ``_FWD`` / ``_BWD`` in the op's module): ms and effective GB/s
    (forward reads 2 B per logit, backward reads and writes 2 B each)."""
    from dtree.ops.logprobs import fused_head as fh  # the op beside its kernels (lt)

    if device.type != "cuda":
        return []
    gen = torch.Generator(device=device).manual_seed(3)
    logits = (torch.randn(rows, v, device=device, generator=gen) * 3).bfloat16()
    labels = torch.randint(0, v, (rows,), device=device, generator=gen)
    tf = lt.LogitTransform()
    _, norm, ent = fh._row_stats_torch(logits, labels, tf, True)
    g, ge = torch.randn(rows, device=device), torch.randn(rows, device=device)
    saved_fwd, saved_bwd = dict(lt._FWD), dict(lt._BWD)
    out = []
    try:
        for block_v in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                lt._FWD.clear()
                lt._FWD.update(BLOCK_V=block_v, num_warps=warps)
                ms = time_ms(lambda: lt._row_stats_triton(logits, labels, tf, True), device, 10)
                out.append(["row stats (fwd)", f"BLOCK_V={block_v}, warps={warps}", f"{ms:.3f}",
                            f"{2 * logits.numel() / ms / 1e6:.0f}"])
        lt._FWD.clear()
        lt._FWD.update(saved_fwd)
        for block_m, block_v in ((1, 2048), (4, 1024), (8, 1024), (16, 512), (8, 2048)):
            for warps in (4, 8):
                lt._BWD.clear()
                lt._BWD.update(BLOCK_M=block_m, BLOCK_V=block_v, num_warps=warps)
                buf = logits.clone()
                ms = time_ms(lambda buf=buf: lt._dlogits_triton(buf, labels, norm, ent, g, ge, tf), device, 10)
                out.append(["dlogits (bwd)", f"BLOCK_M={block_m}, BLOCK_V={block_v}, warps={warps}", f"{ms:.3f}",
                            f"{4 * logits.numel() / ms / 1e6:.0f}"])
    finally:
        lt._FWD.clear()
        lt._FWD.update(saved_fwd)
        lt._BWD.clear()
        lt._BWD.update(saved_bwd)
    return out


def environment() -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return {
        "gpu": gpu,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def table(header, lines) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in lines]


def main() -> int:
    args = parse_args()
    if args.smoke or not torch.cuda.is_available():
        if not args.smoke:
            print("no CUDA device: run with --smoke for the CPU check")
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from interpreter_worker import patch_interpreter

        patch_interpreter()
    from dtree.ops.logprobs import fused_head as fh
    from dtree.ops.logprobs import triton_kernels as lt

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    started = time.time()
    env = environment()
    all_impls, ref_entropy = implementations(lt)
    impls = {k: all_impls[k] for k in args.impls.split(",")}
    print(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}")
    print(f"fp32-out addmm in place: {fh._fp32_out_mm_works(device)}")

    check_rows, ok = correctness(impls, lt, device, args.vocab, args.smoke)
    check_header = ["impl", "entropy", "logp", "entropy", "d hidden", "d weight", "rule"]
    print("\n".join(table(check_header, check_rows)))

    rows, classes = [], {}
    for h in map(int, args.hidden.split(",")):
        for n in map(int, args.rows.split(",")):
            hidden, weight, labels = inputs(n, h, args.vocab, device)
            g, ge = torch.randn(n, device=device), torch.randn(n, device=device)
            flops = 2.0 * n * h * args.vocab
            for with_entropy in (False, True):
                base = {}
                for name, fn in impls.items():
                    if with_entropy and name == "reference" and not ref_entropy:
                        continue

                    def fwd(fn=fn):
                        with torch.no_grad():
                            fn(hidden, weight, labels, with_entropy, args.chunk)

                    def fwd_bwd(fn=fn):
                        step(fn, hidden, weight, labels, with_entropy, args.chunk, g, ge)

                    f_ms, fb_ms = time_ms(fwd, device, args.reps), time_ms(fwd_bwd, device, args.reps)
                    mem = peak_gib(fwd_bwd, device)
                    base.setdefault("name", name)
                    base.setdefault("ms", fb_ms)
                    rows.append({
                        "h": h, "n": n, "entropy": with_entropy, "impl": name, "fwd": f_ms, "fwd_bwd": fb_ms,
                        "tflops": 4 * flops / fb_ms / 1e9, "mem": mem, "speedup": base["ms"] / fb_ms,
                        "base": base["name"],
                    })
                    print(f"H {h} N {n} entropy {with_entropy} {name}: fwd {f_ms:.2f} ms, fwd+bwd {fb_ms:.2f} ms, "
                          f"{4 * flops / fb_ms / 1e9:.0f} TFLOP/s, +{mem:.2f} GiB")
                    if (h, n) == (1536, 16384) or args.smoke:
                        classes[(h, n, with_entropy, name)] = kernel_classes(fwd_bwd, device)
            del hidden, weight
            if device.type == "cuda":
                torch.cuda.empty_cache()

    config_rows = kernel_configs(lt, device, args.vocab)
    seconds = time.time() - started
    lines = [
        "# LM-head log-probs: fused kernel vs chunked torch",
        "",
        f"{env['gpu']}; torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}, Python {env['python']}; "
        f"{env['date']}; `python benchmarks/bench_logprobs.py {' '.join(sys.argv[1:])}` ({seconds:.0f} s).",
        f"Vocab {args.vocab}, bf16, chunks of {args.chunk} rows, median of {args.reps} after one warm-up. "
        f"fp32-out addmm in place: {fh._fp32_out_mm_works(device)}.",
        "",
        "## Correctness (flash-attention rule, vocab as timed; error vs float32 full logits / bf16 full logits' error)",
        "",
        *table(check_header, check_rows),
        "",
        "## Times (forward+backward speed-up against the first implementation of the same shape)",
        "",
    ]
    header = ["H", "N", "entropy", "impl", "fwd ms", "fwd+bwd ms", "TFLOP/s (8NHV)", "peak GiB", "speed-up"]
    body = [[str(r["h"]), str(r["n"]), "yes" if r["entropy"] else "no", r["impl"], f"{r['fwd']:.2f}",
             f"{r['fwd_bwd']:.2f}", f"{r['tflops']:.0f}", f"{r['mem']:.2f}", f"{r['speedup']:.2f}x vs {r['base']}"]
            for r in rows]
    lines += table(header, body)
    if classes:
        lines += ["", "## CUDA ms of one forward+backward by kernel class", ""]
        lines += table(
            ["H", "N", "entropy", "impl", "matmul", "triton", "other"],
            [[str(h), str(n), "yes" if e else "no", name, *(f"{c.get(k, 0.0):.2f}" for k in ("matmul", "triton", "other"))]
             for (h, n, e, name), c in classes.items()],
        )
    if config_rows:
        lines += ["", f"## Fused kernels alone on a [4096, {args.vocab}] bf16 chunk, by launch shape "
                  f"(defaults: forward {lt._FWD}, backward {lt._BWD})", ""]
        lines += table(["kernel", "launch", "ms", "GB/s"], config_rows)
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = re.sub(r"[^A-Za-z0-9]+", "_", env["gpu"]).strip("_").lower()
        path = os.path.join(args.out, f"logprobs_{gpu}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    print()
    print("\n".join(table(header, body)))
    print("correctness:", "pass" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
