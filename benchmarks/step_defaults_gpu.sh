#!/usr/bin/env bash
# What two of dtree's step defaults cost, measured like a user on the H100 (one device call,
# ~6 minutes; no flash-attn needed), every configuration of a case in one process:
#
# * the allocator's cache: free_after_step=True empties it after every call (the next step
#   maps its memory again); =False keeps it cached (the KV stack is dropped either way). The
#   64k agentic tree and GRPO case 1, at the default memory and at the mask's (17.6 GiB),
#   against tree-mask:whole+ckpt;
# * dtree's lean layers during its steps (RuntimeConfig.lean_layers, default True) on a model
#   with HF's eager layers (--layers eager): GRPO case 1, lean_layers True against False.
#
#     bash benchmarks/step_defaults_gpu.sh          # reports in $OUT (default /tmp/dtree_defaults)
#
# SMOKE=1 runs the same on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_defaults}
source benchmarks/bench_cases.sh
CASE1_STEPS=$([ "${SMOKE:-0}" = 1 ] && echo 2 || echo 10)
KEEP=free_after_step=false
FREE=free_after_step=true

echo "== 64k agentic: the allocator's cache kept or emptied after every step, against the mask"
timeout 290 $BENCH $AGENTIC64K --steps $STEPS --time-budget 270 --tag defaults-64k --out "$OUT/agentic64k" \
  --configs "dtree:$FREE,dtree:$KEEP,tree-mask:whole+ckpt,dtree:memory=$MASK_GIB+$FREE,dtree:memory=$MASK_GIB+$KEEP" 2>&1 | tail -14

echo "== GRPO case 1: the same"
timeout 120 $BENCH $CASE1 --steps $CASE1_STEPS --time-budget 100 --tag defaults-case1 --out "$OUT/case1" \
  --configs "dtree:$FREE,dtree:$KEEP,tree-mask:whole+ckpt" 2>&1 | tail -10

echo "== GRPO case 1 on HF's eager layers: dtree's lean layers during its steps, or not"
timeout 120 $BENCH $CASE1 --layers eager --steps $CASE1_STEPS --time-budget 100 --tag defaults-case1-eager \
  --out "$OUT/case1_eager" --configs "dtree:lean_layers=true,dtree:lean_layers=false,tree-mask:whole+ckpt" 2>&1 | tail -10
