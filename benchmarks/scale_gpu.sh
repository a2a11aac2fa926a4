#!/usr/bin/env bash
# Issue 17's larger cases with today's defaults, on the H100 (one device call, ~8 minutes):
#
# * the memory left after a step (the KV stack's buffers now released before the cache is
#   emptied): the 64k tree with free_after_step false and true;
# * the 256k agentic tree: dtree's default, at half the mask's memory (memory=23.8: session C
#   measured the mask at 47.7 GiB), and memory="low", against tree-mask:whole+ckpt;
# * qwen2.5-7b on one ~32k agentic tree: dtree's default (MFU).
#
#     bash benchmarks/scale_gpu.sh      # reports in $OUT (default /tmp/dtree_scale)
#
# SMOKE=1 runs the same on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_scale}
source benchmarks/bench_cases.sh
T256K=262144 HALF_MASK_GIB=23.8 MODEL7B=qwen2.5-7b T7B=32768
[ "${SMOKE:-0}" = 1 ] && T256K=600 HALF_MASK_GIB=3 MODEL7B=tiny T7B=400

echo "== 64k agentic: what a step leaves allocated"
timeout 100 $BENCH $AGENTIC64K --steps $STEPS --time-budget 85 --tag release-64k --out "$OUT/release" \
  --configs "dtree,dtree:free_after_step=true" 2>&1 | tail -6

echo "== 256k agentic"
timeout 300 $BENCH $AGENTIC64K --set target_unique_tokens=$T256K --steps $STEPS --time-budget 280 --tag scale-256k \
  --out "$OUT/agentic256k" --configs "dtree,tree-mask:whole+ckpt,dtree:memory=$HALF_MASK_GIB,dtree:low" 2>&1 | tail -9

echo "== qwen2.5-7b, one ~32k agentic tree"
timeout 120 ${BENCH/qwen2.5-1.5b/$MODEL7B} $AGENTIC64K --set target_unique_tokens=$T7B --steps $STEPS \
  --time-budget 100 --configs dtree --tag scale-7b --out "$OUT/qwen7b" 2>&1 | tail -5
