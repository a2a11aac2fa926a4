#!/usr/bin/env bash
# The flash-attn backend's one-call path (dtree/ops/stack_attention/flash4_masked_call.py: a call as
# one flash-attn-4 attention over the stack under its tree mask) against the region path and
# the Triton kernel, on the H100 (~6 minutes; after the two flash-attn-4 install calls of
# ../shared/tools/fa4_wheels.sh):
#
# * the GPU tests of the flash-attn backend;
# * bench_stack_attention on the grpo and agentic layouts at 12/2 and 32/8 heads: errors
#   against float32, TFLOP/s, kernels;
# * the 64k agentic tree (4 fresh forests) and GRPO case 1: dtree:attention=triton against
#   dtree (auto: flash-attn where flash-attn-4 runs), in one process each.
#
#     bash benchmarks/masked_call_gpu.sh      # reports in $OUT (default /tmp/dtree_masked_call)
#
# SMOKE=1 runs the kernel bench on CPU (interpreter; the flash-attn rows are absent there).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_masked_call}
source benchmarks/bench_cases.sh
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${HOME:-/tmp}/fa4-jit-cache
if [ "${SMOKE:-0}" != 1 ]; then
  echo "== GPU tests"
  timeout 170 python -m pytest -q -p no:cacheprovider -p no:warnings -m gpu tests/test_stack_attention_regions.py \
    tests/test_output_memo.py tests/test_masked_call.py -k "flash" 2>&1 | tail -4
fi
echo "== kernels"
for heads in "12 2" "32 8"; do
  set -- $heads
  timeout 200 python benchmarks/bench_stack_attention.py $SMOKE_FLAG --layouts grpo,agentic --option-cases "" \
    --heads $1 --kv-heads $2 --impls "triton fused,flash-attn,flash-attn regions" --out "$OUT" --tag "_masked_call_$1_$2" \
    2>&1 | grep -E "TFLOP|Error|error" | tail -8
done
[ "${SMOKE:-0}" = 1 ] && exit 0
echo "== 64k agentic"
timeout 240 $BENCH $AGENTIC64K --steps 4 --time-budget 220 --tag flash-tree-64k --out "$OUT/agentic64k" \
  --configs "dtree:attention=triton,dtree" 2>&1 | grep -v USDT | tail -6
echo "== GRPO case 1"
timeout 100 $BENCH $CASE1 --steps 8 --time-budget 80 --tag flash-tree-case1 --out "$OUT/case1" \
  --configs "dtree:attention=triton,dtree" 2>&1 | grep -v USDT | tail -5
