#!/usr/bin/env bash
# Session S on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# that each fit one device call:
#
#   PART=diag    what is alive at the peak of memory="low" and memory=10 on the 64k agentic tree, and
#                what the step was doing then (benchmarks/profile_memory.py: the allocator's trace
#                replayed to the peak), next to what the memory policy predicted;
#   PART=check   after the change the diagnosis pointed to (a re-run's SwiGLU backward writes its
#                gradients over gate and up, in row chunks): the bf16 GPU tests it touches, the memory
#                profile of memory="low" and tree-mask:whole+ckpt again;
#   PART=confirm the 64k tree (default,
#                memory=14.5, 12 and 10, memory="low", tree-mask:whole+ckpt) in one process, the same
#                tree at memory="low" and the mask with the commit before the change (.oldm/:
#                git archive <rev> dtree | tar -x -C .oldm), and GRPO case 1 against the mask.
#   PART=final   the final kernels' GPU tests (the SwiGLU kernels, their PTX), the 64k tree (default,
#                memory=14.5, 12.5 (the mask's peak now), 12 and 10, memory="low", tree-mask:whole+ckpt) and GRPO case 1 against
#                the mask, one process each (reports without their plots: a device call returns few files);
#   PART=scale   the 256k tree: the default and half the mask's memory (memory=19.9) against
#                tree-mask:whole+ckpt.
#
#     PART=diag bash benchmarks/session_s_gpu.sh            # reports in $OUT (default /tmp/dtree_session_s)
#     SMOKE=1 PART=confirm bash benchmarks/session_s_gpu.sh # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_s}
PART=${PART:-diag}
source benchmarks/bench_cases.sh
CAP=14.5 AT_MASK=12.5 HALF256K=19.9
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
MEMORY_SET="--set num_trees=1 --set target_unique_tokens=65536"
if [ "${SMOKE:-0}" = 1 ]; then
  CAP=4 AT_MASK=3.5 HALF256K=4 AGENTIC256K="$AGENTIC64K"
  MEMORY_SET="--set num_trees=1 --set target_unique_tokens=400 --set system_prompt_len=64 --set trajectories=2 --set turn_len=4,40"
fi

profile() {  # profile DIR CONFIGS: the memory profile of each configuration, its summary printed
  mkdir -p "$OUT/$1"
  timeout 200 python benchmarks/profile_memory.py --configs "$2" $MEMORY_SET --out "$OUT/$1" \
    >"$OUT/$1.log" 2>&1
  grep -A4 "^| config" "$OUT/$1.log"
  grep -hA12 "reached the peak" "$OUT/$1"/*.md 2>/dev/null | head -30 || true
}

case "$PART" in
  diag)
    profile memory_diag "dtree:low,dtree:memory=10"
    ;;
  check)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_swiglu.py tests/test_runtime_gpu.py \
        tests/test_checkpointing.py tests/test_lean_layers.py tests/test_output_memo.py 2>&1 \
        | tee "$OUT/gpu_tests.txt" | tail -3
    fi
    profile memory_after "dtree:low,tree-mask:whole+ckpt"
    ;;
  confirm)
    bench final64k 400 $AGENTIC64K --steps "${STEPS}" \
      --configs "dtree,dtree:memory=$CAP,dtree:memory=12,dtree:memory=10,dtree:low,tree-mask:whole+ckpt"
    [ -d .oldm/dtree ] && (cd .oldm && bench before64k 200 $AGENTIC64K --steps "${STEPS}" \
      --configs "dtree:low,tree-mask:whole+ckpt")
    bench case1 120 $CASE1 --steps "${CASE1_STEPS:-10}" --configs "dtree,tree-mask:whole+ckpt"
    ;;
  final)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 120 python -m pytest -q -p no:cacheprovider tests/test_swiglu.py tests/test_kernel_vectorization.py 2>&1 \
        | tee "$OUT/gpu_tests.txt" | tail -1
    fi
    bench final64k 300 $AGENTIC64K --steps "${STEPS}" \
      --configs "dtree,dtree:memory=$CAP,dtree:memory=$AT_MASK,dtree:memory=12,dtree:memory=10,dtree:low,tree-mask:whole+ckpt"
    bench case1 120 $CASE1 --steps "${CASE1_STEPS:-10}" --configs "dtree,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  scale)
    bench agentic256k 400 $AGENTIC256K --steps "${SCALE_STEPS:-3}" \
      --configs "dtree,dtree:memory=$HALF256K,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  *) echo "PART must be diag, check, confirm, final or scale"; exit 2 ;;
esac
