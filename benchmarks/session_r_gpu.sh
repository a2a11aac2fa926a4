#!/usr/bin/env bash
# Session R on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh; py-spy
# from a wheel carried in .whl/), in parts that each fit one device call:
#
#   PART=diag   where GRPO case 1 and the 64k tree at memory="low" leave the GPU idle
#               (benchmarks/gpu_gaps.py, CUDA activity only) and where case 1's host time goes
#               (benchmarks/host_sampling_gpu.sh's py-spy sampling);
#   PART=calls  memory="low" on the 64k tree at its 8k calls and at 12k and 16k calls, against
#               tree-mask:whole+ckpt (what fewer, larger calls would buy at low's settings);
#   PART=policy the memory policy's refit cost model (this checkout) against the one before it
#               (.oldm/: git archive <rev> dtree | tar -x -C .oldm) on the 64k tree at caps of 10, 12
#               and 20 GiB, each side in its own process; then this checkout's default, memory="low"
#               and tree-mask:whole+ckpt;
#   PART=confirm the landed cost model on the 64k tree (memory="low", also with 256-row LM-head
#               chunks, caps of 10 and 12 GiB, tree-mask:whole+ckpt), then the 256k tree at half the
#               mask's memory (memory=23.5) against tree-mask:whole+ckpt;
#   PART=final  the 64k tree (default, memory=14.5, 12 and 10, memory="low", tree-mask:whole+ckpt) and
#               GRPO case 1 (default, tree-mask:whole+ckpt, linearized with flash-attn-4), one process each;
#   PART=scale  the 256k tree at the default, at half the mask's memory (memory=23.5) and
#               memory="low", against tree-mask:whole+ckpt.
#
#     PART=diag bash benchmarks/session_r_gpu.sh            # reports in $OUT (default /tmp/dtree_session_r)
#     SMOKE=1 PART=final bash benchmarks/session_r_gpu.sh    # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_r}
PART=${PART:-diag}
source benchmarks/bench_cases.sh
CAP=14.5 HALF256K=23.5
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
[ "${SMOKE:-0}" = 1 ] && CAP=4 HALF256K=4 AGENTIC256K="$AGENTIC64K"

case "$PART" in
  diag)
    OUT=$OUT timeout 150 python benchmarks/gpu_gaps.py $SMOKE_FLAG --workload case1 --steps "${GAP_STEPS:-8}" 2>&1 \
      | grep -v USDT | sed -n 1,40p
    OUT=$OUT timeout 200 python benchmarks/gpu_gaps.py $SMOKE_FLAG --workload agentic64k --opt memory=low --steps 3 \
      --tag low 2>&1 | grep -v USDT | sed -n 1,40p
    [ "${SMOKE:-0}" = 1 ] || OUT=$OUT CASES=case1 bash benchmarks/host_sampling_gpu.sh 2>&1 | tail -20
    ;;
  calls)
    bench low_calls 400 $AGENTIC64K --steps "${STEPS}" \
      --configs "dtree:low,dtree:low+group_tokens=12288,dtree:low+group_tokens=16384,tree-mask:whole+ckpt"
    ;;
  policy)
    CAPS=${CAPS:-"10 12 20"}; [ "${SMOKE:-0}" = 1 ] && CAPS="3 4"
    configs=$(for c in $CAPS; do printf 'dtree:memory=%s,' "$c"; done)
    (cd .oldm && bench policy_old 300 $AGENTIC64K --steps "$STEPS" --configs "${configs%,}")
    bench policy_new 400 $AGENTIC64K --steps "$STEPS" --configs "${configs}dtree,dtree:low,tree-mask:whole+ckpt"
    ;;
  confirm)
    bench confirm64k 300 $AGENTIC64K --steps "$STEPS" \
      --configs "dtree:low,dtree:low+logprob_chunk=256,dtree:memory=10,dtree:memory=12,tree-mask:whole+ckpt"
    bench half256k 300 $AGENTIC256K --steps "${SCALE_STEPS:-3}" --configs "dtree:memory=$HALF256K,tree-mask:whole+ckpt"
    ;;
  final)
    bench final64k 400 $AGENTIC64K --steps "${FINAL_STEPS:-$STEPS}" \
      --configs "dtree,dtree:memory=$CAP,dtree:memory=12,dtree:memory=10,dtree:low,tree-mask:whole+ckpt"
    bench case1 120 $CASE1 --steps "${CASE1_STEPS:-10}" --configs "dtree,tree-mask:whole+ckpt,linearized"
    grep -hE "^\| \`linearized\` \|" "$OUT"/case1/*.md | cut -d'|' -f2,3,6,8,12
    ;;
  scale)
    bench agentic256k 300 $AGENTIC256K --steps "${SCALE_STEPS:-3}" \
      --configs "dtree,dtree:memory=$HALF256K,dtree:low,tree-mask:whole+ckpt"
    ;;
  *) echo "PART must be diag, calls, policy, confirm, final or scale"; exit 2 ;;
esac
