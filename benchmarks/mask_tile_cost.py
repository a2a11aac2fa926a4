"""What the masked stack-attention call's partially visible tiles cost, on calls of real step plans.

    python benchmarks/mask_tile_cost.py --out benchmarks/results/h200/session_ag/tiles

A call of the one-call path (:mod:`dtree.ops.stack_attention.flash4_masked_call`) runs flash-attn-4 under block
sparsity: fully visible 128 x 128 tiles unmasked, partially visible ones through the two-table mask function
(two loads and two compares per score). On the agentic trees a fifth of a call's tiles are partial (the
segments' diagonals and their subtree ends inside the call; ``call_mask`` counts them). This script takes calls
from the schedules a step would run (``--calls``: workload, call budget, the largest ``n`` calls) and times,
per call, flash-attn-4's forward and backward kernels (GPU time, torch.profiler) under:

* ``two_tables``   the mask from the two tables ``slot_row_lo``, ``slot_row_hi`` (the forward as dtree runs it);
* ``packed``       the same mask from one word per slot (``call_mask.packed_bounds``: ``lo + 65536 * last``,
                   decoded by floor division and modulo; the backward as dtree runs it);
* ``packed_width``, ``packed_swapped``, ``lo_last``, ``lo_last_mod``, ``packed_div``  other encodings of the same
                   mask (one word ``lo + 65536 * width``; ``last + 65536 * lo``; two tables ``lo`` and ``last``
                   compared with ``<=``, the same each taken ``% 65536``; ``packed`` decoded with one division);
* ``slot_two_tables``, ``slot_packed``  the two tables and the packed word, each key's bounds read once per thread
                   and tile (``flash4_slot_bounds``: no per-score load, index wrap or bound check; the tables padded
                   past the call, ``call_mask.kernel_tables``): the forward and the backward as dtree now runs them;
* ``last_only``, ``hi_only``, ``hi_mod``  one table, one compare (timing only: half the mask);
* ``arithmetic``   a compare of the two indices, no table (timing only);
* ``no_mask_fn``   the same tile lists, a mask function that reads nothing (timing only: wrong scores);
* ``all_full``     the partial tiles listed as full (no mask function runs; timing only).

Every correct encoding's forward is checked bitwise equal to ``two_tables``' and its dq, dk, dv against
``two_tables``' run-to-run spread (flash-attn-4's backward adds with atomics). ``two_tables`` - ``all_full`` is
what evaluating the mask costs. TFLOP/s count the visible (query, key) pairs (forward 4 D Hq per pair,
backward 2.5x that), as ``bench_stack_attention.py`` does. qwen2.5-1.5b's attention shape (12 q heads, 2 kv
heads, head dim 128), bf16.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stack_attention_cases import environment, kernel_ms, relative_error, table

from dtree.engine.walk import _group_layout
from dtree.ops.stack_attention.call_mask import (
    BLOCK,
    BlockLists,
    CallMask,
    call_mask,
    inclusive_bounds,
    kernel_tables,
)
from dtree.plan.schedule import build_schedule
from dtree.workloads import make_workload

HQ, HKV, D = 12, 2, 128
VARIANTS = ("two_tables", "packed", "slot_two_tables", "slot_packed", "packed_width", "packed_swapped", "lo_last",
            "lo_last_mod", "packed_div", "hi_mod", "last_only", "hi_only", "arithmetic", "all_full")
CHECKED = ("packed", "slot_two_tables", "slot_packed", "packed_width", "packed_swapped", "lo_last", "lo_last_mod",
           "packed_div")  # checked against two_tables
WORKLOADS = {"agentic256k": 262144, "agentic64k": 65536}


def real_calls(spec: str, smoke: bool) -> list[tuple[str, object]]:
    """``workload:budget:n[:seed]`` -> the ``n`` largest calls (name, layout) of that schedule."""
    name, budget, n, *seed = spec.split(":")
    target, budget = WORKLOADS[name], int(budget)
    if smoke:
        target, budget = 4096, 1024
    forest = make_workload("agentic", seed=int(seed[0]) if seed else 0, vocab_size=151936, num_trees=1,
                           target_unique_tokens=target)
    sched = build_schedule(forest, 256, budget)
    order = sorted(range(len(sched.groups)), key=lambda g: -sched.groups[g].num_tokens)[: int(n)]
    return [(f"{name}/{budget}/g{g}", _group_layout(sched, g)) for g in sorted(order)]


def _plain(text: str) -> str:
    """``text`` without terminal colour codes, on one line."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text).replace("\n", " ").replace("|", "/")


def tile_counts(mask: CallMask) -> dict:
    pairs = int((mask.slot_row_hi.astype(np.int64) - mask.slot_row_lo).clip(min=0).sum())
    full, partial = int(mask.by_row_tile.full_cnt.sum()), int(mask.by_row_tile.partial_cnt.sum())
    return {"rows": mask.num_rows, "base": mask.base, "pairs": pairs, "full": full, "partial": partial,
            "tile_efficiency": pairs / ((full + partial) * BLOCK * BLOCK)}


def merged(b: BlockLists) -> BlockLists:
    """Every listed tile as full (ascending, as flash-attn-4 takes them)."""
    n = len(b.full_cnt)
    rows = [np.sort(np.concatenate([b.full_idx[i, : b.full_cnt[i]], b.partial_idx[i, : b.partial_cnt[i]]]))
            for i in range(n)]
    width = max(1, max(len(r) for r in rows))
    idx = np.zeros((n, width), dtype=np.int32)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = r
    cnt = np.array([len(r) for r in rows], dtype=np.int32)
    return BlockLists(np.zeros(n, np.int32), np.zeros((n, 1), np.int32), cnt, idx)


@functools.cache
def mask_functions() -> dict:
    import cutlass
    from cutlass import cute
    from flash_attn.cute import utils

    @cute.jit
    def packed_width(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        word = utils.scalar_to_ssa(aux_tensors[1][n_idx[0]], cutlass.Int32)
        d = m_idx - word % 65536
        return (d >= 0) & (d < word // 65536)

    @cute.jit
    def packed_swapped(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        word = utils.scalar_to_ssa(aux_tensors[2][n_idx[0]], cutlass.Int32)
        return (word // 65536 <= m_idx) & (m_idx <= word % 65536)

    @cute.jit
    def lo_last(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        lo = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
        last = utils.scalar_to_ssa(aux_tensors[3][n_idx[0]], cutlass.Int32)
        return (lo <= m_idx) & (m_idx <= last)

    @cute.jit
    def lo_last_mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        lo = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
        last = utils.scalar_to_ssa(aux_tensors[3][n_idx[0]], cutlass.Int32)
        return (lo % 65536 <= m_idx) & (m_idx <= last % 65536)

    @cute.jit
    def packed_div(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        word = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
        last = word // 65536
        return (word - last * 65536 <= m_idx) & (m_idx <= last)

    @cute.jit
    def hi_mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return m_idx < utils.scalar_to_ssa(aux_tensors[1][n_idx[0]], cutlass.Int32) % 65536

    @cute.jit
    def last_only(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return m_idx <= utils.scalar_to_ssa(aux_tensors[3][n_idx[0]], cutlass.Int32)

    @cute.jit
    def hi_only(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return m_idx < utils.scalar_to_ssa(aux_tensors[1][n_idx[0]], cutlass.Int32)

    @cute.jit
    def arithmetic(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return (n_idx - m_idx) < 1 << 20

    @cute.jit
    def no_mask_fn(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return m_idx >= 0

    from dtree.ops.stack_attention.flash4_masked_call import _mask_function, _packed_mask_function
    from dtree.ops.stack_attention.flash4_slot_bounds import install, slot_bounds_mask

    if not install():
        raise SystemExit("flash4_slot_bounds is not installed (flash-attn-4 version, or DTREE_FLASH4_SLOT_BOUNDS=0)")
    two_tables = _mask_function()
    return {"two_tables": two_tables, "packed": _packed_mask_function(), "packed_width": packed_width,
            "slot_two_tables": slot_bounds_mask("two_tables"), "slot_packed": slot_bounds_mask("packed"),
            "packed_swapped": packed_swapped,
            "lo_last": lo_last, "lo_last_mod": lo_last_mod, "packed_div": packed_div, "hi_mod": hi_mod,
            "last_only": last_only, "hi_only": hi_only,
            "arithmetic": arithmetic, "no_mask_fn": no_mask_fn, "all_full": two_tables}


def sparse(b: BlockLists, device):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    n = len(b.full_cnt)

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int32, device=device)

    return BlockSparseTensorsTorch(
        mask_block_cnt=t(b.partial_cnt).view(1, 1, n), mask_block_idx=t(b.partial_idx).view(1, 1, n, -1),
        full_block_cnt=t(b.full_cnt).view(1, 1, n), full_block_idx=t(b.full_idx).view(1, 1, n, -1),
        block_size=(BLOCK, BLOCK))


def run_call(name: str, layout, device, variants=VARIANTS) -> dict:

    mask = call_mask(layout)
    if mask is None:
        raise SystemExit(f"{name}: not expressible as one masked call")
    row = {"call": name, **tile_counts(mask)}
    t, keys = mask.num_rows, mask.num_keys
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, t, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, keys, HKV, D, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    # the tables the calls run (padded past the call's keys; a per-score mask function never reads the padding)
    lo, hi, word = (torch.as_tensor(x, device=device) for x in kernel_tables(mask))
    lo1, last = inclusive_bounds(mask)
    extra = [torch.as_tensor(x.astype(np.int32), device=device)
             for x in (lo1 + 65536 * (last + 1 - lo1).clip(min=0), last + 65536 * lo1, last)]
    aux = {name_: [lo, hi] for name_ in VARIANTS} | {"packed": [word], "packed_div": [word], "slot_packed": [word]}
    for name_ in ("packed_width", "packed_swapped", "lo_last", "lo_last_mod", "last_only"):
        aux[name_] = [torch.as_tensor(lo1.astype(np.int32), device=device), *extra]
    lists = {"fwd": (mask.by_row_tile, merged(mask.by_row_tile)), "bwd": (mask.by_slot_tile, merged(mask.by_slot_tile))}
    scale = D**-0.5
    flops_fwd = 4 * D * HQ * row["pairs"]
    dout = torch.randn_like(q)
    results = {}
    for variant in variants:
        which = 1 if variant == "all_full" else 0
        t0 = time.time()
        try:
            results[variant] = time_variant(variant, (q, k, v, dout), aux[variant],
                                            [sparse(lists[p][which], device) for p in ("fwd", "bwd")], scale)
        except Exception as exc:  # noqa: BLE001 (a variant the compiler refuses is reported, the rest still run)
            results[variant] = {"error": f"{type(exc).__name__}: {_plain(str(exc))[-300:]}"}
            print(f"{name} {variant}: failed {results[variant]['error']}", flush=True)
            continue
        m = results[variant]
        m.update(fwd_tflops=flops_fwd / m["fwd_ms"] / 1e9, bwd_tflops=2.5 * flops_fwd / m["bwd_ms"] / 1e9,
                 bwd_over_fwd=m["bwd_ms"] / m["fwd_ms"])
        print(f"{name} {variant}: fwd {m['fwd_ms']:.3f} ms ({m['fwd_tflops']:.0f} TFLOP/s), bwd {m['bwd_ms']:.3f} ms "
              f"({m['bwd_tflops']:.0f}), {time.time() - t0:.1f} s", flush=True)
    ref = results.get("two_tables", {}).get("outputs")
    if ref is not None:
        again = time_variant("two_tables", (q, k, v, dout), aux["two_tables"],
                             [sparse(lists[p][0], device) for p in ("fwd", "bwd")], scale)["outputs"]
        row["repeat_grad_error"] = max(relative_error(a, b) for a, b in zip(again[2:], ref[2:]))
        for variant in CHECKED:
            alt = results.get(variant, {}).get("outputs")
            if alt is not None:
                results[variant]["forward_equal"] = all(torch.equal(a, b) for a, b in zip(ref[:2], alt[:2]))
                results[variant]["grad_error"] = max(relative_error(a, b) for a, b in zip(alt[2:], ref[2:]))
    for r in results.values():
        r.pop("outputs", None)
    row["variants"] = results
    return row


def time_variant(variant: str, tensors, aux: list, sparse_lists: list, scale: float) -> dict:
    """GPU ms of one forward and one backward of ``variant``, and their outputs (out, lse, dq, dk, dv)."""
    from flash_attn.cute import interface

    q, k, v, dout = tensors
    fn = mask_functions()[variant]
    out = torch.empty_like(q)
    lse = torch.empty(1, q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    fwd = functools.partial(interface._flash_attn_fwd, q, k, v, softmax_scale=scale, causal=False, mask_mod=fn,
                            aux_tensors=aux, block_sparse_tensors=sparse_lists[0], return_lse=True, out=out, lse=lse)
    bwd = functools.partial(interface._flash_attn_bwd, q, k, v, out, dout, lse, softmax_scale=scale, causal=False,
                            mask_mod=fn, aux_tensors=aux, block_sparse_tensors=sparse_lists[1],
                            dq=grads[0], dk=grads[1], dv=grads[2])
    f_ms = sum(kernel_ms(fwd).values())
    b_ms = sum(kernel_ms(bwd).values())
    return {"fwd_ms": f_ms, "bwd_ms": b_ms, "outputs": [x.clone() for x in (out, lse, *grads)]}


def per_tile(row: dict) -> dict:
    """Partial tiles' cost relative to full ones, from two_tables and all_full (same tile count)."""
    v = row["variants"]
    if "error" in v.get("two_tables", {"error": 1}) or "error" in v.get("all_full", {"error": 1}):
        return {}
    share = row["partial"] / (row["full"] + row["partial"])
    out = {}
    for p in ("fwd", "bwd"):
        masked, unmasked = v["two_tables"][f"{p}_ms"], v["all_full"][f"{p}_ms"]
        # masked = unmasked * ((1 - share) + share * ratio)  ->  ratio of a partial tile to a full one
        out[p] = 1 + (masked / unmasked - 1) / share if share else float("nan")
    return out


def report(rows: list[dict], env: dict) -> str:
    lines = ["# The masked stack-attention call's partial tiles on real step calls", "",
             ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             (f"q heads {HQ}, kv heads {HKV}, head dim {D}, bf16. GPU time of flash-attn-4's kernels per call "
              "(torch.profiler, 10 calls; the backward's pre- and post-processing kernels included). TFLOP/s over "
              "the visible pairs. `partial cost`: a partial tile's time over a full one's, from `two_tables` "
              "against `all_full`."), ""]
    head = ["call", "rows", "below", "tiles full / partial", "tile efficiency", "variant", "fwd ms (TFLOP/s)",
            "bwd ms (TFLOP/s)", "bwd/fwd"]
    body = []
    for r in rows:
        for name, m in r["variants"].items():
            cells = [r["call"], str(r["rows"]), str(r["base"]), f"{r['full']} / {r['partial']}",
                     f"{r['tile_efficiency']:.3f}", name]
            if "error" in m:
                body.append(cells + [m["error"], "", ""])
            else:
                fwd, bwd = f"{m['fwd_ms']:.3f} ({m['fwd_tflops']:.0f})", f"{m['bwd_ms']:.3f} ({m['bwd_tflops']:.0f})"
                body.append(cells + [fwd, bwd, f"{m['bwd_over_fwd']:.2f}"])
    lines += table(head, body) + [""]
    for r in rows:
        cost = per_tile(r)
        if cost:
            checks = "; ".join(
                f"{v}: forward bitwise equal {m.get('forward_equal')}, dq/dk/dv within {m['grad_error']:.1e}"
                for v, m in r["variants"].items() if "grad_error" in m)
            lines.append(f"- {r['call']}: partial cost fwd {cost['fwd']:.2f}x, bwd {cost['bwd']:.2f}x a full tile. "
                         f"Against two_tables: {checks} (two_tables against its own repeat: "
                         f"{r.get('repeat_grad_error', float('nan')):.1e}; the backward's atomics vary run to run)")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", default="agentic256k:32768:2,agentic64k:16384:2",
                   help="comma-separated workload:call budget:largest n[:seed]")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/dtree_mask_tile_cost"))
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--smoke", action="store_true", help="tiny trees: the plumbing (needs a GPU with flash-attn-4)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        calls = [c for spec in args.calls.split(",") for c in real_calls(spec, True)]
        rows = [{"call": n, **tile_counts(call_mask(lay))} for n, lay in calls]
        print(json.dumps(rows, indent=1))
        print("no GPU: tile counts only")
        return
    env = environment()
    rows = []
    for spec in args.calls.split(","):
        for name, layout in real_calls(spec, args.smoke):
            rows.append(run_call(name, layout, torch.device("cuda"), args.variants.split(",")))
    text = report(rows, env)
    with open(os.path.join(args.out, "mask_tile_cost.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
