#!/usr/bin/env bash
# After a refactor that must not change behaviour (issue 20, the house): every GPU test, then
# the two benchmark cases of the last session (64k agentic tree, GRPO case 1) in one process
# each, so their figures can be held against benchmarks/results/h100/session_c/.
# One device call, about 8 minutes on an H100, flash-attn-4 on the path (../shared/tools/fa4_wheels.sh):
#
#     bash .fa4b/install.sh && export PYTHONPATH=$HOME/fa4-site:$HOME/fa4-site/nvidia_cutlass_dsl/dsl_packages \
#       && bash benchmarks/house_gpu_check.sh            # reports in $OUT
#
# SMOKE=1 runs the same on CPU with the tiny model (the GPU tests then skip).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_house}
TESTS_S=${TESTS_S:-300}
source benchmarks/bench_cases.sh
[ "${SMOKE:-0}" = 1 ] && TESTS_S=60

echo "== GPU tests (pytest -m gpu, at most ${TESTS_S} s)"
timeout "$TESTS_S" python -m pytest -m gpu -q -p no:cacheprovider -rfE tests 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.txt"

echo "== 64k agentic: dtree, dtree memory=$MASK_GIB (the mask's peak), tree-mask:whole+ckpt"
timeout 200 $BENCH $AGENTIC64K --steps $STEPS --configs dtree,tree-mask:whole+ckpt,dtree:memory=$MASK_GIB \
  --time-budget 180 --tag house-64k --out "$OUT/agentic64k" 2>&1 | tail -15

echo "== GRPO case 1: dtree, tree-mask:whole+ckpt, linearized"
timeout 120 $BENCH $CASE1 --steps 5 --configs dtree,tree-mask:whole+ckpt,linearized \
  --time-budget 100 --tag house-case1 --out "$OUT/case1" 2>&1 | tail -15
