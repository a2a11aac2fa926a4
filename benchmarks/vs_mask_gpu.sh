#!/usr/bin/env bash
# Issue 17's headline comparisons with today's defaults, measured like a user on the H100
# (~6 minutes; run after the two flash-attn-4 install calls of ../shared/tools/fa4_wheels.sh so
# that the linearized baseline runs flash-attn-4, as verl and OpenRLHF run flash-attn):
#
# * GRPO case 1: dtree's default against tree-mask:whole+ckpt and linearized;
# * the 64k agentic tree: dtree's default (and with attention=triton), at the mask's memory (memory=14.5: its peak with these
#   layers in session F; memory=17.6: its peak with HF's eager layers) and memory="low", against
#   tree-mask:whole+ckpt, and in 4,096-token calls with nothing checkpointed (what a call costs).
#
# Every method runs dtree's lean layers (--layers auto), a fresh forest every step.
#
#     bash benchmarks/vs_mask_gpu.sh      # reports in $OUT (default /tmp/dtree_vs_mask)
#
# SMOKE=1 runs the same on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_vs_mask}
source benchmarks/bench_cases.sh
CASE1_STEPS=$([ "${SMOKE:-0}" = 1 ] && echo 2 || echo 10)
LEAN_MASK_GIB=$([ "${SMOKE:-0}" = 1 ] && echo 3 || echo 14.5)
SMALL_CALL=$([ "${SMOKE:-0}" = 1 ] && echo 128 || echo 4096)
TRITON_ROW=$([ "${SMOKE:-0}" = 1 ] || echo ",dtree:attention=triton")  # the Triton kernel needs a GPU

python -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" 2>/dev/null \
  || echo "flash-attn-4 not installed: the linearized baseline runs SDPA"

echo "== GRPO case 1"
timeout 150 $BENCH $CASE1 --steps $CASE1_STEPS --time-budget 130 --tag vs-mask-case1 --out "$OUT/case1" \
  --configs "dtree,tree-mask:whole+ckpt,linearized" 2>&1 | tail -12

echo "== 64k agentic"
timeout 330 $BENCH $AGENTIC64K --steps $STEPS --time-budget 300 --tag vs-mask-64k --out "$OUT/agentic64k" \
  --configs "dtree,tree-mask:whole+ckpt,dtree:memory=$LEAN_MASK_GIB,dtree:memory=$MASK_GIB,dtree:low$TRITON_ROW,dtree:checkpoint_layers=false+group_tokens=$SMALL_CALL" 2>&1 | tail -15
