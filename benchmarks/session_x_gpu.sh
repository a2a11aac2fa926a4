#!/usr/bin/env bash
# Session X on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# that each fit one device call.
#
#   PART=rerun   an A/B of a change against the package before it: the bf16 GPU tests of the SwiGLU and
#                the checkpointed runtime (and of the change's op where its test is there); `dtree bench`
#                on the 64k agentic tree (low, memory=$CAP, tree-mask:whole+ckpt) with this checkout and,
#                when BASE names a directory holding the package as it was before (`git archive e35e34c
#                dtree | tar -x -C $BASE`), the same configs with it, one process each, back to back.
#                Run with benchmarks/results/h200/session_x/1_rerun_mlp/rerun_mlp.patch applied (a
#                checkpointed layer's re-run of the SwiGLU MLP computed in its backward in column blocks:
#                measured slower, not landed);
#   PART=check   the GPU tests of the memory policy, checkpointing and the offload; the 64k tree under a
#                tight cap (memory=$TIGHT: with the bound on the KV stack the policy had, low's recipe did not
#                fit it; with the schedule's own slots it does), low, memory=$CAP and the mask; GRPO case 1
#                (the default, the mask); the 256k tree (memory=$HALF256K, the mask);
#   PART=final   after plans the time model cannot tell apart go to the leanest (plan_candidates.TIE): the 64k
#                tree (memory=$TIGHT, memory=12.5, memory=$CAP, low, the mask) and the 256k tree (memory=$HALF256K,
#                the mask);
#   PART=path    with the layer inputs on the host, a retained path keeps no checkpointed layers (it is
#                recomputed, as low's recipe does): the 64k tree under memory=$TIGHT, low and the mask;
#
#     PART=check bash benchmarks/session_x_gpu.sh           # reports in $OUT (default /tmp/dtree_session_x)
#     SMOKE=1 PART=check bash benchmarks/session_x_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_x}
PART=${PART:-check}
source benchmarks/bench_cases.sh  # CAP: 14.5 GiB, the mask's peak on the 64k tree (4 with SMOKE=1)
CAP=${CAPX:-$CAP}
HALF256K=${HALF256K:-19.9}
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
TIGHT=${TIGHT:-8}
[ -n "$SMOKE_FLAG" ] && HALF256K=4 AGENTIC256K="$AGENTIC64K" TIGHT=3.5
CONFIGS64K="dtree:low,dtree:memory=$CAP,tree-mask:whole+ckpt${EXTRA64K:-}"

case "$PART" in
  rerun)
    gpu_tests gpu_tests.txt 200 "rerun or swiglu or flash_rule or checkpoint" $(ls tests/test_rerun_mlp.py 2>/dev/null) \
      tests/test_swiglu.py tests/test_runtime_gpu.py
    bench new64k 260 $AGENTIC64K --steps "${STEPS}" --configs "$CONFIGS64K"
    if [ -n "${BASE:-}" ]; then  # the package before the change: python -m puts the working directory first
      here=$PWD
      (cd "$BASE" && PYTHONPATH=$BASE:${PYTHONPATH#$here:} && export PYTHONPATH &&
        python -c 'import dtree; print("base: dtree from", dtree.__file__)' && OUT=$OUT bench base64k 260 \
        $AGENTIC64K --steps "${STEPS}" --configs "$CONFIGS64K")
    fi
    rm -f "$OUT"/*/*.png
    ;;
  check)
    gpu_tests gpu_tests_check.txt 150 "memory or offload or checkpoint" tests/test_runtime_gpu.py tests/test_memory_policy.py
    bench check64k 200 $AGENTIC64K --steps "${STEPS}" --configs "dtree:memory=$TIGHT,$CONFIGS64K"
    bench case1 120 $CASE1 --steps 6 --configs "dtree,tree-mask:whole+ckpt"
    bench check256k 300 $AGENTIC256K --steps "${SCALE_STEPS:-4}" --configs "dtree:memory=$HALF256K,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  final)
    bench tie64k 200 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree:memory=$TIGHT,dtree:memory=${AT_MASK:-12.5},dtree:memory=$CAP,dtree:low,tree-mask:whole+ckpt"
    bench tie256k 240 $AGENTIC256K --steps "${SCALE_STEPS:-4}" --configs "dtree:memory=$HALF256K,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  path)
    bench path64k 200 $AGENTIC64K --steps "${STEPS}" --configs "dtree:memory=$TIGHT,dtree:low,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  *) echo "PART must be rerun, check, final or path"; exit 2 ;;
esac
