#!/usr/bin/env bash
# Where a step's GPU time goes today, per kernel, for dtree and the mask with the same
# layers (~4 minutes on an H100): the 64k agentic tree at dtree's default, at the mask's
# memory (memory=14.5) and tree-mask:whole+ckpt; GRPO case 1, dtree and the mask.
# One profiled step each after two warm-up steps on the same forest (profile_step.py).
#
#     bash benchmarks/profile_gpu.sh      # reports in $OUT (default /tmp/dtree_profile)
#
# SMOKE=1 runs the same on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_profile}
source benchmarks/bench_cases.sh
MODEL=qwen2.5-1.5b LEAN_MASK_GIB=14.5
[ "${SMOKE:-0}" = 1 ] && MODEL=tiny LEAN_MASK_GIB=3

echo "== 64k agentic"
timeout 300 python benchmarks/profile_step.py --model $MODEL $AGENTIC64K --top 30 --name _64k --out "$OUT" \
  --configs "dtree,dtree:memory=$LEAN_MASK_GIB,tree-mask:whole+ckpt" | grep -E "^## |^wall|^layers"
echo "== GRPO case 1"
timeout 120 python benchmarks/profile_step.py --model $MODEL $CASE1 --top 30 --name _case1 --out "$OUT" \
  --configs "dtree,tree-mask:whole+ckpt" | grep -E "^## |^wall|^layers"
