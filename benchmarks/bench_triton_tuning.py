"""Tuning sweep of the Triton stack-attention kernels: each kernel's GPU time per config,
per layout and head configuration.

    python benchmarks/bench_triton_tuning.py --out benchmarks/results     # GPU, ~2 minutes
    python benchmarks/bench_triton_tuning.py --smoke                      # CPU, interpreter, plumbing only

For each head configuration (``--head-configs``, ``Hq/Hkv``, head dim 128, bf16) and layout
(``stack_attention_cases.py``): the time of ``_fwd_kernel``, ``_dq_kernel`` and
``_dkdv_kernel`` of the split backward and the fused backward's ``_dkdv_kernel`` (which
also adds dq: "fused") (torch.profiler, one forward+backward) with each candidate
``(inner tile, num_warps, num_stages)`` forced (``configs=``; a config that does not fit
shared memory is reported as such; the first is the fixed default for plain calls),
then the split dK/dV kernel's time by ``prefix_item_rows`` (query rows per prefix work
item; ``auto``: chosen per call) with float atomics and in deterministic mode (ordered
adds). Writes ``triton_tuning_<gpu>.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stack_attention_cases import bind, cases, environment, kernel_ms, stack_inputs, table, variant  # noqa: E402

# (inner tile, num_warps, num_stages) per kernel; the first is the fixed default
CANDIDATES = {
    "fwd": [(128, 8, 3), (64, 8, 3), (64, 4, 3), (128, 8, 2)],
    "dq": [(128, 8, 2), (64, 8, 3), (64, 8, 2), (32, 8, 3)],
    "dkdv": [(64, 8, 2), (32, 8, 2), (32, 8, 3), (16, 8, 2)],
    "fused": [(64, 8, 2), (32, 8, 2), (64, 8, 1), (32, 8, 3)],
}
KERNEL_NAMES = {"fwd": "_fwd_kernel", "dq": "_dq_kernel", "dkdv": "_dkdv_kernel", "fused": "_dkdv_kernel"}
# the backward that launches each kernel ("fused": the dK/dV kernel that also adds dq)
BACKWARD = {"fwd": None, "dq": "split", "dkdv": "split", "fused": "fused"}
ITEM_ROWS = [128, 256, 512, 1024, 4096, None]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-configs", default="32/8,12/2")
    p.add_argument("--layouts", default="grpo,agentic")
    p.add_argument("--kernels", default="fwd,dq,dkdv,fused")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args()


def kernel_time(sat, case, stack, q, k, v, go, kernel: str, **kw) -> float | str:
    """GPU ms of ``kernel`` in one forward+backward of the Triton kernel with ``kw``."""
    fn = bind(variant(sat.stack_attention_triton_tuned, **kw), stack, case.layout, q.shape[-1] ** -0.5)

    def step():
        fn(q, k, v).backward(go)

    try:
        times = kernel_ms(step, iters=5)
    except Exception as e:  # noqa: BLE001 (OutOfResources and compile errors: report, go on)
        return f"{type(e).__name__}"
    if not times:  # CPU
        step()
        return float("nan")
    return sum(t for n, t in times.items() if KERNEL_NAMES[kernel] in n)


def sweep_case(sat, case, hq: int, hkv: int, kernels: list[str], device: str) -> dict:
    d = 16 if device == "cpu" else 128
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    stack, q, k, v = stack_inputs(case, hq, hkv, d, dtype, device)
    go = torch.randn(q.shape[0], hq, d, device=device, dtype=dtype)
    row = {"configs": {}, "item_rows": {}}
    for kernel in kernels:
        for config in CANDIDATES[kernel][: 2 if device == "cpu" else None]:
            row["configs"][(kernel, config)] = kernel_time(sat, case, stack, q, k, v, go, kernel,
                                                           configs=((kernel, config),), backward=BACKWARD[kernel])
    for rows in ITEM_ROWS:
        for det in (False, True):
            row["item_rows"][(rows, det)] = kernel_time(sat, case, stack, q, k, v, go, "dkdv", prefix_item_rows=rows,
                                                        deterministic=det, backward="split")
    return row


def cell(x) -> str:
    return x if isinstance(x, str) else f"{x:.3f}"


def report(results: dict, env: dict, kernels: list[str], seconds: float) -> str:
    out = [
        "# Triton stack-attention kernels: tuning sweep",
        "",
        f"{env['gpu']}, CUDA {env['cuda']}, torch {env['torch']}, Triton {env['triton']}, Python {env['python']}; "
        f"{env['date']}; bf16, head dim 128; {seconds:.0f} s.",
        "",
        "GPU ms of each kernel in one forward+backward (torch.profiler), by config (inner tile, num_warps, "
        "num_stages); the first config is the fixed default.",
    ]
    for kernel in kernels:
        out += ["", f"## {kernel}", ""]
        header = ["heads", "layout"] + [str(c) for c in CANDIDATES[kernel]]
        lines = [[h, layout] + [cell(r["configs"].get((kernel, c), "-")) for c in CANDIDATES[kernel]]
                 for (h, layout), r in results.items()]
        out += table(header, lines)
    out += ["", "## dK/dV kernel (split backward) by prefix_item_rows (atomic / deterministic ms)", ""]
    header = ["heads", "layout"] + ["auto" if n is None else str(n) for n in ITEM_ROWS]
    lines = [[h, layout] + [f"{cell(r['item_rows'][(n, False)])} / {cell(r['item_rows'][(n, True)])}"
                            for n in ITEM_ROWS] for (h, layout), r in results.items()]
    out += table(header, lines)
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.head_configs, args.layouts = "4/2", "grpo"
    elif not torch.cuda.is_available():
        sys.exit("bench_triton_tuning needs a CUDA GPU (or --smoke)")
    from dtree.ops.stack_attention import triton_autograd as sat

    device = "cpu" if args.smoke else "cuda"
    kernels = args.kernels.split(",")
    start, results = time.time(), {}
    for heads in args.head_configs.split(","):
        hq, hkv = map(int, heads.split("/"))
        for case in cases(args.layouts.split(","), 64 if args.smoke else 1):
            t0 = time.time()
            results[(heads, case.name)] = sweep_case(sat, case, hq, hkv, kernels, device)
            print(f"{heads} {case.name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            text = report(results, environment(device), kernels, time.time() - start)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                name = "cpu smoke" if args.smoke else torch.cuda.get_device_name()
                gpu = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()
                with open(os.path.join(args.out, f"triton_tuning_{gpu}.md"), "w") as f:
                    f.write(text)
    print(report(results, environment(device), kernels, time.time() - start))


if __name__ == "__main__":
    main()
