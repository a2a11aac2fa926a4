#!/usr/bin/env bash
# The fused stack-attention backward adding dq through the TMA unit (a bulk reduce per
# row tile, DQ_TMA) against float atomics (DTREE_DQ_TMA=0), on the H100 (~6 minutes):
#
# * the GPU tests of the Triton kernels by the flash-attention rule, the runtime on
#   CUDA and the kept attention outputs (both ways of adding dq pass through them);
# * bench_stack_attention.py, grpo and agentic, 12/2 and 32/8 heads, the fused kernel
#   only: each way in its own process (one machine: the kernel times compare);
# * the 64k agentic step (dtree's default plan, 4 fresh forests), each way.
#
#     bash benchmarks/dq_tma_gpu.sh      # reports in $OUT (default /tmp/dtree_dq_tma)
#
# SMOKE=1 runs the benches on CPU (the interpreter: atomics only; plumbing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_dq_tma}
source benchmarks/bench_cases.sh
SMOKE_BENCH=""
[ "${SMOKE:-0}" = 1 ] && SMOKE_BENCH="--smoke"
if [ "${SMOKE:-0}" != 1 ]; then
  echo "== GPU tests"
  timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_stack_attention_triton.py \
    tests/test_output_memo.py tests/test_runtime_gpu.py 2>&1 | tail -4
fi
for way in 0 1; do
  for heads in "12 2" "32 8"; do
    set -- $heads
    echo "== stack attention, ${1}/${2} heads, DTREE_DQ_TMA=$way"
    DTREE_DQ_TMA=$way timeout 120 python benchmarks/bench_stack_attention.py $SMOKE_BENCH --layouts grpo,agentic \
      --option-cases "" --impls "triton fused" --heads $1 --kv-heads $2 --tag "${1}x${2}_dq_tma$way" --out "$OUT" \
      2>&1 | grep -E "^## |^\| triton fused" | head -6
  done
done
for way in 0 1; do
  echo "== 64k agentic step, DTREE_DQ_TMA=$way"
  DTREE_DQ_TMA=$way timeout 150 $BENCH $AGENTIC64K --steps $STEPS --time-budget 130 --tag "dq-tma$way" \
    --out "$OUT/agentic64k_dq_tma$way" --configs dtree 2>&1 | tail -3 | head -1
done
