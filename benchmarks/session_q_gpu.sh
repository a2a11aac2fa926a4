#!/usr/bin/env bash
# Session Q on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in
# parts that each fit one device call:
#
#   PART=check  the GPU tests of what changed (the shared-input projections' bf16 flash rule, the lean
#               layers end to end, the runtime's GPU tests, the RMSNorm), then where GRPO case 1's
#               kernels come from (benchmarks/kernel_origins.py) and this session's commit against the one
#               before it (.oldm/: git archive <rev> dtree | tar -x -C .oldm) on case 1, processes
#               alternating, ROUNDS rounds (2);
#   PART=ab     the same A/B on the 64k agentic tree at memory="low" and memory=14.5 (AB_CASES: any of low,
#               cap, case1; ROUNDS rounds, default 1);
#   PART=final  the 64k tree (default, memory=14.5, memory="low", tree-mask:whole+ckpt) and GRPO case 1
#               (default, tree-mask:whole+ckpt, linearized with flash-attn-4), in one process each;
#   PART=scale  the 256k agentic tree (default, memory="low", tree-mask:whole+ckpt) and qwen2.5-7b on one
#               ~32k agentic tree (default), as session N measured them.
#
#     PART=check bash benchmarks/session_q_gpu.sh            # reports in $OUT (default /tmp/dtree_session_q)
#     SMOKE=1 PART=final bash benchmarks/session_q_gpu.sh    # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_q}
PART=${PART:-check}
source benchmarks/bench_cases.sh
CAP=14.5
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
AGENTIC32K="--workload agentic --set num_trees=1 --set target_unique_tokens=32768" MODEL7B=qwen2.5-7b
[ "${SMOKE:-0}" = 1 ] && CAP=4 AGENTIC256K="$AGENTIC64K" AGENTIC32K="$AGENTIC64K" MODEL7B=tiny

ab() {  # ab NAME TIMEOUT ARGS...: the bench in .oldm/ then in this checkout, each in its own process
  local name=$1 limit=$2
  shift 2
  for side in old new; do
    dir=$PWD; [ $side = old ] && dir=$PWD/.oldm
    (cd "$dir" && bench "ab_${side}_$name" "$limit" "$@")
  done
}

case "$PART" in
  check)
    [ "${SMOKE:-0}" = 1 ] || timeout 240 python -m pytest -q -m gpu tests/test_shared_input_linear.py \
      tests/test_lean_layers.py tests/test_runtime_gpu.py tests/test_rms_norm.py 2>&1 | tail -6
    OUT=$OUT timeout 150 python benchmarks/kernel_origins.py $SMOKE_FLAG --workload case1 --tag after --top 40 2>&1 \
      | grep -v USDT | tail -42
    for round in $(seq 1 "${ROUNDS:-2}"); do
      ab "case1_$round" 80 $CASE1 --steps 10 --configs dtree
    done
    ;;
  ab)  # AB_CASES (default "low cap"), each in ROUNDS rounds (default 1)
    for round in $(seq 1 "${ROUNDS:-1}"); do
      for c in ${AB_CASES:-low cap}; do
        case "$c" in
          low) ab "low_$round" 100 $AGENTIC64K --steps $STEPS --configs dtree:low ;;
          cap) ab "cap_$round" 100 $AGENTIC64K --steps $STEPS --configs dtree:memory=$CAP ;;
          case1) ab "case1_$round" 80 $CASE1 --steps 10 --configs dtree ;;
        esac
      done
    done
    ;;
  final)
    bench final64k 300 $AGENTIC64K --steps "${FINAL_STEPS:-$STEPS}" --configs "dtree,dtree:memory=$CAP,dtree:low,tree-mask:whole+ckpt"
    bench case1 120 $CASE1 --steps "${CASE1_STEPS:-10}" --configs "dtree,tree-mask:whole+ckpt,linearized"
    grep -hE "^\| \`linearized\` \|" "$OUT"/case1/*.md | cut -d'|' -f2,3,6,8,12
    ;;
  scale)
    bench agentic256k 240 $AGENTIC256K --steps "${SCALE_STEPS:-3}" --configs "dtree,dtree:low,tree-mask:whole+ckpt"
    BENCH=${BENCH/qwen2.5-1.5b/$MODEL7B} bench qwen7b 120 $AGENTIC32K --steps "${SCALE_STEPS:-3}" --configs dtree
    ;;
  *) echo "PART must be check, ab, final or scale"; exit 2 ;;
esac
