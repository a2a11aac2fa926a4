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
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dtree_house}
mkdir -p "$OUT"
TESTS_S=${TESTS_S:-300}
BENCH="python -m dtree bench --model qwen2.5-1.5b"
CASE1="--workload grpo --set num_prompts=1 --set prompt_len=2048 --set group_size=8 --set answer_len=512"
AGENTIC64K="--workload agentic --set num_trees=1 --set target_unique_tokens=65536"
STEPS=4
if [ "${SMOKE:-0}" = 1 ]; then
  BENCH="python -m dtree bench --model tiny --device cpu"
  CASE1="--workload grpo --set num_prompts=1 --set prompt_len=64 --set group_size=4 --set answer_len=16"
  AGENTIC64K="--workload agentic --set num_trees=1 --set system_prompt_len=64 --set trajectories=2 --set turn_len=4,40 --set target_unique_tokens=400"
  STEPS=2 TESTS_S=60
fi

echo "== GPU tests (pytest -m gpu, at most ${TESTS_S} s)"
timeout "$TESTS_S" python -m pytest -m gpu -q -p no:cacheprovider -rfE tests 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.txt"

echo "== 64k agentic: dtree, dtree memory=17.6 (the mask's peak), tree-mask:whole+ckpt"
timeout 200 $BENCH $AGENTIC64K --steps $STEPS --configs dtree,tree-mask:whole+ckpt,dtree:memory=17.6 \
  --time-budget 180 --tag house-64k --out "$OUT/agentic64k" 2>&1 | tail -15

echo "== GRPO case 1: dtree, tree-mask:whole+ckpt, linearized"
timeout 120 $BENCH $CASE1 --steps 5 --configs dtree,tree-mask:whole+ckpt,linearized \
  --time-budget 100 --tag house-case1 --out "$OUT/case1" 2>&1 | tail -15
