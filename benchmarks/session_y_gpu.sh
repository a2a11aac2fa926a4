#!/usr/bin/env bash
# Session Y on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# that each fit one device call. The change: leaf calls of steps with every layer checkpointed run in a
# one-layer KV window (dtree/ops/stack_ops/kv_window.py), the stack holds the groups with children.
#
#   PART=check   the GPU tests of the window, the memory policy, checkpointing and the offload (not with
#                SKIP_TESTS=1); the 64k agentic tree (memory=$TIGHT, low, memory=12.5, memory=$CAP, the mask);
#                GRPO case 1 (the default, the mask);
#   PART=ab      with BASE a directory holding the package before the change (`git archive 5dc44a0 dtree |
#                tar -x -C $BASE`): the 64k tree's low and the mask with this checkout and with it, one
#                process each, back to back;
#   PART=scale   the 256k tree (memory=$HALF256K, the mask).
#
#     PART=check bash benchmarks/session_y_gpu.sh           # reports in $OUT (default /tmp/dtree_session_y)
#     SMOKE=1 PART=check bash benchmarks/session_y_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_y}
PART=${PART:-check}
source benchmarks/bench_cases.sh  # CAP: 14.5 GiB, the mask's peak on the 64k tree (4 with SMOKE=1)
HALF256K=${HALF256K:-19.9}
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
TIGHT=${TIGHT:-8}
AT_MASK=${AT_MASK:-12.5}
[ -n "$SMOKE_FLAG" ] && HALF256K=4 AGENTIC256K="$AGENTIC64K" TIGHT=3.5 AT_MASK=3.8

case "$PART" in
  check)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_check.txt 200 "window or memory or offload or checkpoint" tests/test_kv_window.py \
      tests/test_runtime_gpu.py tests/test_memory_policy.py
    bench check64k 260 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree:memory=$TIGHT,dtree:low,dtree:memory=$AT_MASK,dtree:memory=$CAP,tree-mask:whole+ckpt"
    bench case1 120 $CASE1 --steps 6 --configs "dtree,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  ab)
    bench new64k 150 $AGENTIC64K --steps "${STEPS}" --configs "dtree:low,tree-mask:whole+ckpt"
    here=$PWD
    (cd "${BASE:?BASE must name the package before the change}" && PYTHONPATH=$BASE:${PYTHONPATH#$here:} &&
      export PYTHONPATH && python -c 'import dtree; print("base: dtree from", dtree.__file__)' &&
      OUT=$OUT bench base64k 150 $AGENTIC64K --steps "${STEPS}" --configs "dtree:low,tree-mask:whole+ckpt")
    rm -f "$OUT"/*/*.png
    ;;
  scale)
    bench scale256k 300 $AGENTIC256K --steps "${SCALE_STEPS:-4}" --configs "dtree:memory=$HALF256K,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  *) echo "PART must be check, ab or scale"; exit 2 ;;
esac
