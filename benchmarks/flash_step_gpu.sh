#!/usr/bin/env bash
# Whether the flash-attn stack-attention backend (flash-attn-4's kernels per region,
# merged by log-sum-exp) beats the Triton kernel in today's training step, on the H100
# (~5 minutes; after the two flash-attn-4 install calls of ../shared/tools/fa4_wheels.sh):
#
# * the GPU tests of kept attention outputs (both backends);
# * the 64k agentic tree, 6 fresh forests: dtree's default and memory=14.5, each with the
#   Triton kernel and with attention=flash-attn;
# * GRPO case 1, both backends.
#
#     bash benchmarks/flash_step_gpu.sh      # reports in $OUT (default /tmp/dtree_flash_step)
#
# SMOKE=1 runs the benches on CPU (the flash-attn configurations fail there: plumbing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_flash_step}
source benchmarks/bench_cases.sh
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${HOME:-/tmp}/fa4-jit-cache
LEAN_MASK_GIB=$([ "${SMOKE:-0}" = 1 ] && echo 3 || echo 14.5)
FLASH_STEPS=$([ "${SMOKE:-0}" = 1 ] && echo 2 || echo 6)
if [ "${SMOKE:-0}" != 1 ]; then
  echo "== GPU tests"
  timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_output_memo.py 2>&1 | tail -2
fi
echo "== 64k agentic"
timeout 330 $BENCH $AGENTIC64K --steps $FLASH_STEPS --time-budget 300 --tag flash-step-64k --out "$OUT/agentic64k" \
  --configs "dtree,dtree:attention=flash-attn,dtree:memory=$LEAN_MASK_GIB,dtree:attention=flash-attn+memory=$LEAN_MASK_GIB" \
  2>&1 | grep -v USDT | tail -8
echo "== GRPO case 1"
timeout 120 $BENCH $CASE1 --steps 10 --time-budget 100 --tag flash-step-case1 --out "$OUT/case1" \
  --configs "dtree,dtree:attention=flash-attn" 2>&1 | grep -v USDT | tail -5
