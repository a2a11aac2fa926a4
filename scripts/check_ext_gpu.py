"""Check the KV-stack extension's CUDA kernels on a GPU, then time them.

    python scripts/check_ext_gpu.py                # build with CUDA, check, time
    python scripts/check_ext_gpu.py --no-timing
    python scripts/check_ext_gpu.py --no-large     # skip the >2^31-element buffers (~24 GB)
    pytest -m gpu tests/test_kv_stack_ext.py       # the same ops through the test suite

Builds ``dtree.kv_stack_ext`` with its CUDA kernels (an error if it cannot), compares
``push``, ``accumulate`` and ``zero_grad`` with the pure-torch references on CUDA
tensors (bf16/fp16/fp32/fp64, odd and vector-friendly shapes, non-contiguous and
misaligned rows, int32/int64 slots, repeated slots, a side stream, a CUDA graph,
offsets past 2^31 elements), then prints each op's time against the references.
Exit status 1 when a check fails. Run ``compute-sanitizer python
scripts/check_ext_gpu.py --no-timing --no-large`` to look for out-of-bounds accesses.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dtree import kv_stack_ext as ext  # noqa: E402

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# (layers, capacity, kv_heads, head_dim): odd sizes take the element-wise paths,
# multiples of 8 the 16-byte vector paths
SHAPES = [(2, 37, 3, 60), (3, 50, 2, 64), (1, 9, 1, 7), (4, 300, 8, 128), (2, 64, 5, 2)]
LAYOUTS = ["contiguous", "transposed", "strided", "misaligned"]
LARGE = (2, 2**20, 8, 128)  # 2^30 elements per layer: layer 1 starts past 2^31 elements of a buffer
DEV = "cuda"

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)
        print(f"FAIL {what}")


def close(a: torch.Tensor, b: torch.Tensor, rtol=1e-5, atol=1e-5) -> bool:
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol))


def rows(gen, n, heads, dim, dtype, layout):
    """[n, heads, dim] on the GPU: contiguous, the HF ``[B,H,T,D] -> [T,H,D]``
    transpose, stride 2 on head_dim, or one element into its storage."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)

    if layout == "contiguous":
        return rand(n, heads, dim)
    if layout == "transposed":
        return rand(heads, n, dim).transpose(0, 1)
    if layout == "strided":
        return rand(n, heads, 2 * dim)[..., ::2]
    return rand(n * heads * dim + 1)[1:].view(n, heads, dim)


def buffers(gen, shape, dtype):
    return tuple(torch.randn(shape, generator=gen).to(device=DEV, dtype=dtype) for _ in range(2))


def slots(gen, kind, n, capacity, start):
    if kind is None:
        return None
    dtype = torch.int32 if kind.endswith("32") else torch.int64
    if kind.startswith("perm"):
        s = torch.randperm(capacity - start, generator=gen)[:n]
    else:
        s = torch.randint(0, min(3, capacity - start), (n,), generator=gen)
    return s.to(device=DEV, dtype=dtype)


# ----------------------------------------------------------------------------- correctness


def check_push(gen) -> int:
    count = 0
    for shape in SHAPES:
        layers, capacity, heads, dim = shape
        for dtype in FLOATS:
            for layout in LAYOUTS:
                for kind in (None, "perm32", "perm64"):
                    n, start = min(capacity - 4, 23), 3
                    stack = buffers(gen, shape, dtype)
                    ref = tuple(b.clone() for b in stack)
                    k, v = rows(gen, n, heads, dim, dtype, layout), rows(gen, n, heads, dim, dtype, layout)
                    idx = slots(gen, kind, n, capacity, start)
                    torch.ops.dtree.kv_push.default(*stack, layers - 1, k, v, start, idx)
                    ext.push_reference(*ref, layers - 1, k, v, start, idx)
                    check(all(torch.equal(a, b) for a, b in zip(stack, ref)), f"push {shape} {dtype} {layout} {kind}")
                    count += 1
    stack = buffers(gen, (2, 40, 4, 64), torch.bfloat16)
    ref = tuple(b.clone() for b in stack)
    k, v = rows(gen, 17, 4, 64, torch.float32, "transposed"), rows(gen, 17, 4, 64, torch.float32, "contiguous")
    torch.ops.dtree.kv_push.default(*stack, 1, k, v, 5, None)
    ext.push_reference(*ref, 1, k, v, 5, None)
    check(all(torch.equal(a, b) for a, b in zip(stack, ref)), "push float32 rows into a bfloat16 stack")
    return count + 1


def check_accumulate(gen) -> int:
    count = 0
    for shape in SHAPES:
        layers, capacity, heads, dim = shape
        for dtype in FLOATS:
            for layout in LAYOUTS:
                for kind in (None, "repeat32", "repeat64", "perm64"):
                    start = 2
                    n = 61 if kind and kind.startswith("repeat") else min(capacity - start, 29)
                    grads = buffers(gen, shape, torch.float32)
                    ref = tuple(b.clone() for b in grads)
                    dk, dv = rows(gen, n, heads, dim, dtype, layout), rows(gen, n, heads, dim, dtype, layout)
                    idx = slots(gen, kind, n, capacity, start)
                    torch.ops.dtree.kv_accumulate.default(*grads, layers - 1, dk, dv, start, idx)
                    ext.accumulate_reference(*ref, layers - 1, dk, dv, start, idx)
                    # repeats are summed in no fixed order (atomics), in the reference too
                    same = torch.equal if kind in (None, "perm64") else close
                    check(all(same(a, b) for a, b in zip(grads, ref)), f"accumulate {shape} {dtype} {layout} {kind}")
                    count += 1
    # thousands of rows into three slots, against a float64 sum
    for dtype in (torch.bfloat16, torch.float32):
        grads = tuple(torch.zeros(2, 8, 4, 128, device=DEV) for _ in range(2))
        dk, dv = rows(gen, 8192, 4, 128, dtype, "contiguous"), rows(gen, 8192, 4, 128, dtype, "transposed")
        idx = torch.randint(5, 8, (8192,), generator=gen).to(DEV)
        torch.ops.dtree.kv_accumulate.default(*grads, 1, dk, dv, 0, idx)
        for g, d in zip(grads, (dk, dv)):
            want = torch.zeros(8, 4, 128, dtype=torch.float64, device=DEV).index_add_(0, idx, d.double())
            check(
                close(g[1].double(), want, rtol=1e-5, atol=1e-3) and not g[0].any(), f"accumulate 8192 repeats {dtype}"
            )
        count += 1
    return count


def check_zero(gen) -> int:
    count = 0
    for shape in SHAPES:
        capacity = shape[1]
        for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.uint8):
            for lo, hi in ((0, capacity), (1, capacity - 2), (5, 5), (3, 4)):
                grads = tuple(torch.randint(1, 100, shape, generator=gen).to(device=DEV, dtype=dtype) for _ in range(2))
                ref = tuple(b.clone() for b in grads)
                torch.ops.dtree.kv_zero_grad.default(*grads, lo, hi)
                ext.zero_grad_reference(*ref, lo, hi)
                check(all(torch.equal(a, b) for a, b in zip(grads, ref)), f"zero_grad {shape} {dtype} [{lo}, {hi})")
                count += 1
    return count


def check_streams_and_graphs(gen) -> int:
    """Kernels run on the current stream, so they work on a side stream and inside
    a CUDA graph capture."""
    shape = (3, 64, 4, 64)
    k, v = rows(gen, 16, 4, 64, torch.bfloat16, "transposed"), rows(gen, 16, 4, 64, torch.bfloat16, "contiguous")
    idx = torch.randint(0, 8, (16,), generator=gen).to(DEV)

    def session(stack, grads, push, accumulate, zero_grad):
        zero_grad(*grads, 10, 40)
        push(*stack, 2, k, v, 20, None)
        accumulate(*grads, 1, k, v, 0, idx)
        accumulate(*grads, 0, k, v, 30, None)

    def fresh():
        return buffers(torch.Generator().manual_seed(7), shape, torch.bfloat16), buffers(
            torch.Generator().manual_seed(8), shape, torch.float32
        )

    ops = (torch.ops.dtree.kv_push.default, torch.ops.dtree.kv_accumulate.default, torch.ops.dtree.kv_zero_grad.default)
    refs = (ext.push_reference, ext.accumulate_reference, ext.zero_grad_reference)
    want_stack, want_grads = fresh()
    session(want_stack, want_grads, *refs)

    stack, grads = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        session(stack, grads, *ops)
    torch.cuda.current_stream().wait_stream(side)
    ok = all(torch.equal(a, b) for a, b in zip(stack, want_stack))
    check(ok and all(close(a, b) for a, b in zip(grads, want_grads)), "ops on a side stream")

    stack, grads = fresh()
    saved = [t.clone() for t in (*stack, *grads)]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as CUDA graphs ask
        session(stack, grads, *ops)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        session(stack, grads, *ops)
    for t, s in zip((*stack, *grads), saved):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    ok = all(torch.equal(a, b) for a, b in zip(stack, want_stack))
    check(ok and all(close(a, b) for a, b in zip(grads, want_grads)), "ops replayed from a CUDA graph")
    return 2


def check_large(gen) -> int:
    """Offsets past 2^31 elements (int64 index math) at the top of layer 1 of LARGE."""
    shape = LARGE
    free = torch.cuda.mem_get_info()[0]
    need = 2 * torch.Size(shape).numel() * 4  # the fp32 grads; the bf16 values are freed before
    if free < need * 1.1:
        print(f"skip large-offset checks: {free / 2**30:.0f} GiB free, {need / 2**30:.0f} GiB needed")
        return 0
    count = 0
    stack = tuple(torch.zeros(shape, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    k, v = rows(gen, 33, 8, 128, torch.bfloat16, "transposed"), rows(gen, 33, 8, 128, torch.bfloat16, "contiguous")
    top = shape[1] - 40
    torch.ops.dtree.kv_push.default(*stack, 1, k, v, top, None)
    check(torch.equal(stack[0][1, top : top + 33], k) and torch.equal(stack[1][1, top : top + 33], v), "large push")
    del stack
    grads = tuple(torch.ones(shape, device=DEV) for _ in range(2))
    idx = torch.tensor([5, 5, 7] * 11, device=DEV)
    torch.ops.dtree.kv_accumulate.default(*grads, 1, k, v, top, idx)
    want = torch.ones(3, 8, 128, device=DEV).index_add_(0, idx - 5, k.float())
    check(close(grads[0][1, top + 5 : top + 8], want), "large accumulate")
    torch.ops.dtree.kv_zero_grad.default(*grads, top, shape[1])
    g = grads[1]
    check(
        not g[:, top:].any() and bool((g[:, top - 1] == 1).all()) and bool((g[0, :top] == 1).all()), "large zero_grad"
    )
    count += 3
    return count


def check_compile(gen) -> int:
    """KVStack's ops through torch.compile (Inductor) on CUDA, against eager."""
    from dtree.kv_stack import KVStack

    k, v = rows(gen, 12, 4, 64, torch.bfloat16, "transposed"), rows(gen, 12, 4, 64, torch.bfloat16, "contiguous")

    def session(stack, lo):
        stack.zero_grad(lo, lo + 12)
        stack.write(1, lo, k, v)
        stack.accumulate(0, slice(lo, lo + 12), k, v)
        stack.accumulate(1, torch.tensor([0, 0, 3], device=DEV), k[:3], v[:3])

    stacks = [KVStack(2, 64, 4, 64, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    for s in stacks:
        for t in (s.k, s.v, s.grad_k, s.grad_v):
            t.zero_()
    compiled = torch.compile(session, fullgraph=True, dynamic=True)
    try:
        for lo in (5, 20):
            compiled(stacks[0], lo)
            session(stacks[1], lo)
    except Exception as e:  # report and go on with the other checks
        check(False, f"torch.compile (inductor): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return 1
    for name in ("k", "v", "grad_k", "grad_v"):
        a, b = getattr(stacks[0], name), getattr(stacks[1], name)
        check(torch.equal(a, b) if name in ("k", "v") else close(a, b), f"torch.compile (inductor) {name}")
    return 1


# ----------------------------------------------------------------------------- timing


def gpu_time_us(fn, iters=200) -> float:
    """Mean time per call in µs (CUDA events over ``iters`` back-to-back calls, so
    launch overhead counts when it dominates)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def timing() -> None:
    # a Qwen2.5-7B-like stack: 28 layers, 4 KV heads of 128, bf16 values
    layers, capacity, heads, dim = 28, 16384, 4, 128
    gen = torch.Generator().manual_seed(0)
    stack = tuple(torch.zeros(layers, capacity, heads, dim, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    grads = tuple(torch.zeros(layers, capacity, heads, dim, device=DEV) for _ in range(2))

    def kv(n, layout):
        return rows(gen, n, heads, dim, torch.bfloat16, layout), rows(gen, n, heads, dim, torch.bfloat16, layout)

    # (op, case, args of both implementations, bytes moved)
    cases = []
    for n in (40, 512, 4096):  # read + write of K and V rows
        cases.append(("push", f"T={n} range", (*stack, 3, *kv(n, "transposed"), 100), 2 * 2 * n * heads * dim * 2))
    perm = torch.randperm(capacity, generator=gen)[:4096].to(DEV)
    cases.append(
        ("push", "T=4096 slots", (*stack, 3, *kv(4096, "transposed"), 0, perm), 2 * 2 * 4096 * heads * dim * 2)
    )
    for n in (40, 4096):  # read dK/dV, read + write the float32 slots
        cases.append(("accumulate", f"n={n} range", (*grads, 3, *kv(n, "contiguous"), 100), 2 * n * heads * dim * 10))
    # a GRPO-like prefix: 8 sibling segments add into the same 512 prefix slots
    idx = torch.arange(512, device=DEV).repeat(8)
    cases.append(
        ("accumulate", "n=4096 8x repeats", (*grads, 3, *kv(4096, "contiguous"), 0, idx), 2 * 4096 * heads * dim * 10)
    )
    for span in (40, 4096):  # write the float32 slots of every layer
        cases.append(
            (
                "zero_grad",
                f"{layers} layers x {span} slots",
                (*grads, 100, 100 + span),
                2 * layers * span * heads * dim * 4,
            )
        )

    print(f"\n{layers} layers, capacity {capacity}, {heads} KV heads x {dim}, bf16 values, fp32 grads")
    print(f"{'op':<11} {'case':<24} {'ext µs':>9} {'torch µs':>9} {'speedup':>8} {'ext GB/s':>9}")
    for op, case, args, nbytes in cases:
        fast = gpu_time_us(functools.partial(getattr(ext, op), *args))
        slow = gpu_time_us(functools.partial(getattr(ext, f"{op}_reference"), *args))
        print(f"{op:<11} {case:<24} {fast:9.1f} {slow:9.1f} {slow / fast:7.2f}x {nbytes / fast / 1e3:9.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-large", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    os.environ.pop("DTREE_NO_EXT", None)
    t0 = time.perf_counter()
    ext.load(require=True)
    status = ext.status()
    print(f"extension loaded in {time.perf_counter() - t0:.1f} s (build dir {status['build_dir']})")
    if not status["cuda"]:
        print(f"FAIL the extension has no CUDA kernels: {status['reason']}")
        return 1
    gen = torch.Generator().manual_seed(0)
    counts = {
        "push": check_push(gen),
        "accumulate": check_accumulate(gen),
        "zero_grad": check_zero(gen),
        "streams/graphs": check_streams_and_graphs(gen),
        "torch.compile": check_compile(gen),
    }
    if not args.no_large:
        counts["large offsets"] = check_large(gen)
    torch.cuda.synchronize()
    print("checked " + ", ".join(f"{k}: {v} cases" for k, v in counts.items()))
    if failures:
        print(f"{len(failures)} FAILED")
        return 1
    print("all checks passed")
    if not args.no_timing:
        timing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
