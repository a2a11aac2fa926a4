"""flash-attn-4's SM90 backward tile configurations on dtree's one-call stack attention.

    python benchmarks/flash4_bwd_tiles.py                       # every configuration, every layout
    python benchmarks/flash4_bwd_tiles.py --configs default,pds1 --out benchmarks/results/h200/session_aa

flash-attn-4 picks its Hopper backward tiles from C++ FA3's table (``_tile_size_bwd_sm90``:
for head dim 128 under block sparsity, 64 query rows x 128 keys, two stages of P/dS in
shared memory, S/dP computed transposed). Those were tuned on dense causal attention; a
stack-attention call runs the masked-call kernel (block sparsity and a two-table mask
function, grouped-query attention) on trees. This script times each candidate
configuration of ``--configs`` (overrides of the default one; ``CONFIGS``) on the masked
call of each layout, in one process: dtree's call with its launch replay off,
so each configuration compiles its own kernel and the GPU time of its kernels is what is
compared (torch.profiler, per backward). Every configuration's dq, dk, dv are checked
against the default configuration's (the largest difference relative to the largest
value; both are bf16 results of float32 accumulation in a different order, so they
agree to bf16 rounding, not bit for bit). Configurations the interface or the compiler
refuses are reported as such.

Layouts (one call each; q heads 12, kv heads 2, head dim 128 = qwen2.5-1.5b):
``grpo`` a 2048-token prompt in the stack under 8 answers of 512 (GRPO case 1's leaf
call); ``agentic16k`` 64 tool results of 256 tokens in 4 branches under a 8192-token task
prefix plus 2048 of the branch's own history; ``deep`` one 4096-token segment under a
24,576-token prefix (a 256k tree's deep calls).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stack_attention_cases import Case, environment, kernel_ms, relative_error, stack_inputs

from dtree.ops.stack_attention.call_mask import call_mask

# Overrides of flash-attn-4's own configuration (BwdConfig fields); feasible ones by the
# register and shared-memory counts of flash_attn/cute/sm90_config_search.py at 64 x 128.
CONFIGS = {
    "default": {},
    "pds1": {"num_stages_PdS": 1},
    "dq_swap": {"dQ_swapAB": True},
    "dq_swap_pds1": {"dQ_swapAB": True, "num_stages_PdS": 1},
    "sdp_plain": {"SdP_swapAB": False},
    "dkv_swap": {"dKV_swapAB": True, "AtomLayoutNdKV": 1},
    "dq_atom2": {"AtomLayoutMdQ": 2},
    "do1": {"num_stages_dO": 1, "num_stages_PdS": 1},
}


def layouts(names: list[str]) -> list[Case]:
    task, branch = 8192, 2048
    branches = [((0, task), (task + b * branch, task + (b + 1) * branch)) for b in range(4)]
    known = {
        "grpo": Case("grpo", 512, [((0, 2048),)] * 8, "prompt 2048, 8 answers x 512"),
        "agentic16k": Case("agentic16k", 256, [branches[i // 16] for i in range(64)],
                           f"64 x 256 tool results, 4 branches of prefix {task} + {branch}"),
        "deep": Case("deep", 4096, [((0, 24576),)], "1 segment x 4096 under a 24576 prefix"),
    }
    return [known[n] for n in names]


def patched(interface, overrides: dict):
    """``interface._tile_size_bwd_sm90`` returning its own choice with ``overrides``."""
    original = interface._tile_size_bwd_sm90

    def tiles(*args, **kwargs):
        return dataclasses.replace(original(*args, **kwargs), **overrides)

    return original, tiles


def masked_call_inputs(case: Case, hq: int, hkv: int, d: int):
    """q [T, Hq, D], the stack's K/V slots [0, base + T) (own K/V pushed), out, lse, dout of
    the flash-attn-4 masked call, and the call's mask."""
    from dtree.ops.stack_attention.flash4_masked_call import FLASH4_MASKED_CALL

    stack, q, _, _ = stack_inputs(case, hq, hkv, d, torch.bfloat16)
    mask = call_mask(case.layout)
    if mask is None:
        raise SystemExit(f"{case.name}: the call mask's tables cannot express this layout")
    k, v = stack.k[0, : mask.num_keys], stack.v[0, : mask.num_keys]
    scale = d**-0.5
    q = q.detach()
    out, lse = FLASH4_MASKED_CALL.forward(q, k, v, mask, case.layout, scale)
    dout = torch.randn_like(out)
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "scale": scale, "pairs": case.pairs(),
            "mask": mask, "layout": case.layout}


def backward_call(x: dict):
    """One masked-call backward: dtree's own flash-attn-4 call (``FLASH4_MASKED_CALL``), which
    goes through the interface on every call while its launch replay is off (:func:`run`)."""
    from dtree.ops.stack_attention.flash4_masked_call import FLASH4_MASKED_CALL

    def call():
        return FLASH4_MASKED_CALL.backward(x["q"], x["k"], x["v"], x["out"], x["dout"], x["lse"], x["mask"],
                                           x["layout"], x["scale"])

    return call


def forward_ms(x: dict) -> float:
    from dtree.ops.stack_attention.flash4_masked_call import FLASH4_MASKED_CALL

    def call():
        FLASH4_MASKED_CALL.forward(x["q"], x["k"], x["v"], x["mask"], x["layout"], x["scale"])

    return sum(kernel_ms(call).values())


def forget_compiled(interface) -> None:
    """Drop the compiled backward kernels: the main kernel's compile key holds the tile
    sizes but not the swaps, atom layouts or stages, so a configuration that differs only
    there would run the previous one's kernel."""
    for fn in (interface._flash_attn_bwd, interface._bwd_preprocess, interface._bwd_postprocess_convert):
        fn.compile_cache.clear()


def run(args) -> list[dict]:
    """Each configuration over every layout (one compile per configuration), the default first.
    dtree's launch replay is off: it would relaunch the first configuration's recorded kernels."""
    from flash_attn.cute import interface

    from dtree.ops.stack_attention.flash4_masked_call import _launcher

    _launcher().enabled = False
    inputs = []
    for case in layouts(args.layouts.split(",")):
        x = masked_call_inputs(case, args.heads, args.kv_heads, args.head_dim)
        inputs.append((case, x, forward_ms(x)))
    reference: dict[str, list[torch.Tensor]] = {}
    rows = []
    for name in args.configs.split(","):
        original, tiles = patched(interface, CONFIGS[name])
        interface._tile_size_bwd_sm90 = tiles
        forget_compiled(interface)
        try:
            for case, x, fwd in inputs:
                row = {"layout": case.name, "note": case.note, "config": name, "overrides": CONFIGS[name], "fwd_ms": fwd}
                try:
                    rows.append(_time_backward(x, row, reference, args))
                except Exception as e:  # noqa: BLE001 (a configuration the interface or compiler refuses: report it)
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    rows.append(row)
                print(_line(rows[-1]), flush=True)
        finally:
            interface._tile_size_bwd_sm90 = original
    return rows


def _time_backward(x: dict, row: dict, reference: dict, args) -> dict:
    call = backward_call(x)
    t0 = time.perf_counter()
    grads = [g.clone() for g in call()]
    torch.cuda.synchronize()
    row["compile_s"] = time.perf_counter() - t0
    row["bwd_ms"] = sum(kernel_ms(call).values())
    if row["config"] == "default":
        reference[row["layout"]] = grads
    if row["layout"] in reference:
        row["error"] = max(relative_error(g, r) for g, r in zip(grads, reference[row["layout"]]))
    flops = 4 * args.head_dim * args.heads * x["pairs"]
    row["tflops_fwd"] = flops / row["fwd_ms"] / 1e9
    row["tflops_bwd"] = 2.5 * flops / row["bwd_ms"] / 1e9
    return row


def _line(row: dict) -> str:
    if "failed" in row:
        return f"{row['layout']:>10} {row['config']:>13}: failed ({row['failed']})"
    err = f"{row['error']:.1e}" if "error" in row else "-"
    return (f"{row['layout']:>10} {row['config']:>13}: bwd {row['bwd_ms']:.3f} ms ({row['tflops_bwd']:.0f} TFLOP/s), "
            f"fwd {row['fwd_ms']:.3f} ms ({row['tflops_fwd']:.0f}), bwd/fwd {row['bwd_ms'] / row['fwd_ms']:.2f}, "
            f"vs default {err}, compile {row['compile_s']:.1f} s")


def report(rows: list[dict], env: dict) -> str:
    lines = ["# flash-attn-4's SM90 backward tiles on the masked stack-attention call", "",
             ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             ("GPU time of the kernels per call (torch.profiler, 10 calls); error: the largest |difference| of dq, dk, dv "
             "from the default configuration's, relative to the largest value."), "",
             "| layout | config | overrides | bwd ms | bwd TFLOP/s | fwd ms | bwd/fwd | vs default |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['layout']} | {r['config']} | {r['overrides']} | failed: {r['failed']} | | | | |")
            continue
        err = f"{r['error']:.1e}" if "error" in r else "-"
        lines.append(f"| {r['layout']} | {r['config']} | {r['overrides']} | {r['bwd_ms']:.3f} | {r['tflops_bwd']:.0f} | "
                     f"{r['fwd_ms']:.3f} | {r['bwd_ms'] / r['fwd_ms']:.2f} | {err} |")
    notes = {c.name: c.note for c in layouts(sorted({r['layout'] for r in rows}))}
    lines += ["", "Layouts: " + "; ".join(f"`{k}` {v}" for k, v in notes.items()), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--layouts", default="grpo,agentic16k,deep")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None, help="directory for flash4_bwd_tiles.md")
    args = p.parse_args()
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("flash4_bwd_tiles.py times flash-attn-4's SM90 backward: it needs a Hopper GPU")
    configs = args.configs.split(",")
    if "default" in configs:  # the reference of every other configuration's error: first
        args.configs = ",".join(["default"] + [c for c in configs if c != "default"])
    text = report(run(args), environment())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flash4_bwd_tiles.md"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
