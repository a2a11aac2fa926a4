"""How many kernels the ``flash-attn`` backend makes flash-attn-4 compile over fresh
forests, counted on the CPU from the call plans alone (no GPU, no flash-attn-4).

    python benchmarks/flash4_compile_keys.py --out benchmarks/results

For each workload (``agentic``: one 64k-unique tree per forest, the H100 step's; ``grpo``:
the default batch) and each of ``--forests`` fresh forests (seeds 0..N-1): the
schedule's calls (``--group-tokens`` per call; the memory policy picked 16384 for the
64k agentic step on an H100), each call's regions (dtree/ops/stack_attention/region_plan.py) and, per
region, the parts of flash-attn-4 4.0.0b36's compile keys on Hopper that differ between
the calls of one model (read off ``flash_attn/cute/interface.py``; the rest is fixed by
the model: dtype, heads, head dims):

* forward: causal (own region) or not (levels), ragged (``seqused``: levels), whether
  ``max_seqlen_q`` x q heads per kv head fits one 128-row tile (a single-block
  variant), more than 256 sequences (scheduler tables);
* backward: causal, ragged, deterministic, whether ``max_seqlen_q`` fits one row tile
  (64 rows causal / 80 not, at head dim 128) and ``max_seqlen_k`` one 128-key tile,
  more than 256 sequences; its preprocess and postprocess kernels: the tile, ragged,
  more than 256 sequences.

And the Triton kernel that merges the regions (dtree/ops/stack_attention/lse_merge_triton.py): before,
its region count was a constexpr and the stride between regions' log-sum-exps (q heads x
rows) was specialized on divisibility by 16; now both are runtime arguments.

"before": the true max lengths, the merge's old keys; "after": ``bucket_len``, the
runtime region count.
Reported: the distinct keys of each kernel over all forests, and the keys each forest
adds to those of the forests before it (each is a compile of seconds inside that step).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stack_attention_cases import table  # noqa: E402

from dtree.ops.stack_attention.flash4_replay import bucket_len  # noqa: E402
from dtree.ops.stack_attention.region_plan import region_plan  # noqa: E402
from dtree.ops.stack_attention.regions import level_seqs, own_seqs  # noqa: E402
from dtree.ops.stack_attention.segment_layout import SegmentLayout  # noqa: E402
from dtree.plan.schedule import build_schedule  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402

WORKLOADS = {"agentic": dict(num_trees=1, target_unique_tokens=65536), "grpo": {}}


def bwd_tiles(head_dim: int, causal: bool) -> tuple[int, int]:
    """flash-attn-4's SM90 backward (row, key) tile (``_tile_size_bwd_sm90``)."""
    if head_dim <= 64:
        return 128, 128
    if head_dim <= 96:
        return 64, 128
    if head_dim <= 128:
        return (64 if causal else 80), 128
    return 64, (96 if head_dim <= 192 else 48)


def region_keys(seqs, causal: bool, group: int, head_dim: int, deterministic: bool, bucket: bool) -> set:
    """The compile keys one region call (forward and backward) needs."""
    max_q, max_k = (bucket_len(seqs.max_q), bucket_len(seqs.max_k)) if bucket else (seqs.max_q, seqs.max_k)
    ragged, many = seqs.ragged, len(seqs.q_start) > 256
    m, n = bwd_tiles(head_dim, causal)
    keys = {
        ("fwd", causal, ragged, max_q * (group if group > 1 else 1) <= 128, many),
        ("bwd", causal, ragged, deterministic, -(-max_q // m) == 1, -(-max_k // n) == 1, many),
        ("bwd preprocess", m, ragged, many),
        ("bwd postprocess", m, ragged, many),
    }
    if group > 1:
        keys.add(("bwd postprocess", n, ragged, many))
    if many:
        keys.add(("tile cumsum",))
    return keys


def call_layouts(name: str, seed: int, group_tokens: int):
    """The SegmentLayouts of one fresh forest's calls (as dtree.engine.walk builds them)."""
    sched = build_schedule(make_workload(name, seed=seed, **WORKLOADS[name]), 2048, group_tokens)
    for plan in sched.groups:
        yield SegmentLayout(plan.seg_q_offsets, plan.stack_start + plan.seg_q_offsets[:-1], plan.seg_prefix_ranges)


def count(name: str, forests: int, group_tokens: int, group: int, heads_kv: int, head_dim: int,
          deterministic: bool) -> dict:
    out = {}
    for bucket in (False, True):
        seen: set = set()
        new_per_forest, regions = [], 0
        for seed in range(forests):
            keys = set()
            for layout in call_layouts(name, seed, group_tokens):
                plan = region_plan(layout)
                if plan.levels:  # merged by the Triton kernel
                    rows_by_heads = int(layout.q_offsets[-1]) * group * heads_kv
                    keys.add(("lse merge",) if bucket else ("lse merge", len(plan.levels) + 1, rows_by_heads % 16 == 0))
                keys |= region_keys(own_seqs(plan), True, group, head_dim, deterministic, bucket)
                for i in range(len(plan.levels)):
                    keys |= region_keys(level_seqs(plan, i), False, group, head_dim, deterministic, bucket)
                regions += 1 + len(plan.levels)
            new_per_forest.append(len(keys - seen))
            seen |= keys
        out["after" if bucket else "before"] = {"keys": seen, "new": new_per_forest, "regions": regions}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="agentic,grpo")
    p.add_argument("--forests", type=int, default=6)
    p.add_argument("--group-tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group = args.heads // args.kv_heads
    lines, detail = [], []
    for name in args.workloads.split(","):
        r = count(name, args.forests, args.group_tokens, group, args.kv_heads, args.head_dim, args.deterministic)
        for when in ("before", "after"):
            keys = r[when]["keys"]
            kinds = sorted({k[0] for k in keys})
            lines.append([name, when, str(r[when]["regions"]), str(len(keys)),
                          ", ".join(f"{kind} {sum(k[0] == kind for k in keys)}" for kind in kinds),
                          " / ".join(map(str, r[when]["new"]))])
            detail += [f"- {name}, {when}: " + "; ".join(map(str, sorted(keys, key=str)))]
    text = "\n".join([
        "# flash-attn-4 compile keys of the flash-attn backend over fresh forests (CPU, from the plans)",
        "",
        f"{args.forests} forests per workload, {args.group_tokens} tokens per call, {args.heads} q / {args.kv_heads} kv "
        f"heads of {args.head_dim}, deterministic {args.deterministic}. 'before': the true max lengths and the LSE "
        "merge's region count as a constexpr; 'after': bucket_len (the next power of two, at least 256) and a "
        "runtime count. 'new per forest': keys a forest adds to the forests before it (each one compiles inside "
        "that forest's step). A region call is one flash-attn-4 forward and backward per layer.",
        "",
        *table(["workload", "max lengths", "region calls", "distinct keys", "by kernel", "new per forest"], lines),
        "",
        "Keys (kernel, then the parts that vary; see the module docstring):",
        "",
        *detail,
    ]) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flash4_compile_keys.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
