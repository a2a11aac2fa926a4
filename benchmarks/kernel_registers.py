"""Registers, spills and shared memory of the stack-attention kernels, without a GPU.

    python benchmarks/kernel_registers.py                 # default configs, every option set
    python benchmarks/kernel_registers.py --all-candidates

Compiles each kernel of ``dtree.ops.stack_attention.triton_autograd`` (``fused``: the dK/dV kernel
with the fused backward's dq) for sm_90 through
``triton.compile`` (the PTX, then ``ptxas -v`` from Triton's bundled CUDA tools), with
the argument attributes the JIT gives real calls (16-byte aligned pointers, strides
divisible by 16), for bf16 head dims 64 and 128, the MLA shape 192/128, and fp32 64,
each plain and with options. The kernels' config comments quote its output.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from dtree.ops.stack_attention import triton_autograd as sat  # noqa: E402
from dtree.ops.stack_attention import triton_launch as launch  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
INT_POINTERS = {"QBLOCKS", "RANGE_LO", "RANGE_HI", "SEG_START", "SEG_END", "ITEMS", "TICKETS"}
FP32_POINTERS = {"LSE", "DELTA", "GK", "GV", "SINK_LOGITS", "ALIBI_SLOPES"}
FLOATS = {"qk_scale", "cap_in", "cap_out", "sm_scale"}
OPTION_SETS = {
    "plain": {},
    "deterministic": {"DETERMINISTIC": True},
    "window": {"HAS_WINDOW": True},
    "softcap+sinks": {"HAS_SOFTCAP": True, "HAS_SINKS": True},
    "all": {"HAS_SOFTCAP": True, "HAS_SINKS": True, "HAS_ALIBI": True, "HAS_WINDOW": True},
}
SHAPES = [("bf16", 64, 64), ("bf16", 128, 128), ("bf16", 192, 128), ("fp32", 64, 64)]  # dtype, Dk, Dv


def compile_kernel(kernel: str, dtype: str, constexprs: dict, warps: int, stages: int) -> dict:
    """Compile one specialization for sm_90; its ptxas registers, spill bytes and shared memory."""
    fn = launch._KERNELS[kernel]
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in FP32_POINTERS or (name == "DQ" and kernel in ("dkdv", "fused")):  # the fused dq accumulator
            signature[name] = "*fp32"
        elif name in FLOATS:
            signature[name] = "fp32"
        elif name.startswith("stride") or name in ("T", "window"):
            signature[name] = "i32"
        else:
            signature[name] = "*" + dtype
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if signature[n].startswith("*") or n.startswith("stride")}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    return {
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
        "shared_kb": compiled.metadata.shared / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all-candidates", action="store_true", help="every autotuning candidate, not only the default")
    p.add_argument("--shapes", default="", help="comma-separated subset of dtype/Dk/Dv, e.g. bf16/128/128")
    p.add_argument("--options", default="", help="comma-separated subset of the option sets")
    p.add_argument("--kernels", default="fwd,dq,dkdv,fused")
    args = p.parse_args()
    shapes = [s for s in SHAPES if not args.shapes or f"{s[0]}/{s[1]}/{s[2]}" in args.shapes.split(",")]
    option_sets = {n: f for n, f in OPTION_SETS.items() if not args.options or n in args.options.split(",")}
    print("| dtype | Dk/Dv | tile | options | kernel | config (inner, warps, stages) | registers | spill bytes | shared KB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, dk, dv in shapes:
        torch_dtype = getattr(__import__("torch"), {"bf16": "bfloat16", "fp32": "float32"}[dtype])
        for options, flags in option_sets.items():
            for kernel in args.kernels.split(","):
                table = 64 if dtype == "fp32" or max(dk, dv) > 128 else 128
                transform = flags.get("HAS_SOFTCAP", False) or flags.get("HAS_ALIBI", False)
                candidates = launch._fixed_candidates(kernel, table, torch_dtype, transform)
                for inner, warps, stages in candidates if args.all_candidates else candidates[:1]:
                    constexprs = {
                        "GROUP": 4, "HEAD_DIM": dk, "BLOCK_D": triton.next_power_of_2(dk), "V_DIM": dv,
                        "BLOCK_DV": triton.next_power_of_2(dv), "DOT_PREC": "ieee" if dtype == "fp32" else "tf32",
                        launch._TABLE_NAME[kernel]: table, launch._INNER_NAME[kernel]: inner,
                        **{f: flags.get(f, False) for f in launch._FLAGS[kernel]},
                        **({"DETERMINISTIC": flags.get("DETERMINISTIC", False), "FUSED_DQ": kernel == "fused",
                            "STACK_GRAD": True} if kernel in ("dkdv", "fused") else {}),
                    }
                    r = compile_kernel(kernel, dtype, constexprs, warps, stages)
                    print(f"| {dtype} | {dk}/{dv} | {table} | {options} | {kernel} | {inner}, {warps}, {stages} | "
                          f"{r['registers']} | {r['spill']} | {r['shared_kb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
