#!/usr/bin/env bash
# Session K on one H100 (~8 minutes, flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh):
# 1. the runtime's GPU tests (the bf16 step against HF per path under the flash-attention rule,
#    the one-call path's replay);
# 2. GRPO case 1: dtree against tree-mask:whole+ckpt;
# 3. the 64k agentic tree: default, the mask, dtree at the mask's memory, memory="low";
# 4. benchmarks/gc_pauses.py on the 64k tree with memory="low" (pause_gc off/on interleaved).
#
#     bash benchmarks/session_k_gpu.sh      # reports in $OUT (default /tmp/dtree_session_k)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_k}
source benchmarks/bench_cases.sh
if [ "${SMOKE:-0}" != 1 ]; then
  echo "== 1. GPU tests"
  timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py tests/test_masked_call.py \
    -x 2>&1 | tee "$OUT/gpu_tests.txt" | tail -3
fi
echo "== 2. case 1"
mkdir -p "$OUT/case1" "$OUT/agentic64k"
timeout 110 $BENCH $CASE1 --steps 10 --configs "dtree,tree-mask:whole+ckpt" --out "$OUT/case1" >/dev/null 2>&1
grep -hE "^\| \`(dtree|tree-mask)" "$OUT"/case1/*.md | head -3
echo "== 3. the 64k tree"
timeout 300 $BENCH $AGENTIC64K --steps $STEPS --configs "dtree,tree-mask:whole+ckpt,dtree:memory=14.5,dtree:low" \
  --out "$OUT/agentic64k" >/dev/null 2>&1
grep -hE "^\| \`(dtree|tree-mask)" "$OUT"/agentic64k/*.md | head -5
echo "== 4. the collector, memory=low"
timeout 110 python benchmarks/gc_pauses.py $SMOKE_FLAG --workload agentic64k --opt memory=low --steps 2 2>&1 | tail -5
