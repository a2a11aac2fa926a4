#!/usr/bin/env bash
# Session P on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in
# parts that each fit one device call:
#
#   PART=calls  what a model call costs beyond its tokens now (the memory policy's call overhead,
#               CALL_FIXED_TOKENS, was fitted on an H100 with HF's eager layers in session B): the
#               64k agentic tree at the default and at fixed call sizes with nothing checkpointed,
#               and at memory=14.5 with the policy's plan and with plans of smaller calls and
#               fewer checkpointed layers, against tree-mask:whole+ckpt, all in one process;
#   PART=diag   where the extra time of small calls goes (2,048-token calls, nothing checkpointed):
#               benchmarks/gpu_idle.py (GPU idle time by the walk's phase) and
#               benchmarks/profile_step.py (kernels, against the default) on the 64k tree;
#   PART=origins which code launches each kernel of a step (benchmarks/kernel_origins.py): GRPO case 1
#               and the 64k tree at memory="low";
#   PART=ab     this session's commit against the one before it (.oldm/), processes alternating: GRPO
#               case 1 and (unless LOW=0) the 64k tree at memory="low"; case 1's kernels by origin after the change;
#   PART=final  after the change the calls part pointed to: the 64k tree (default, memory=14.5,
#               memory="low", the mask) and GRPO case 1 (default, the mask), in one process each.
#
#     PART=calls bash benchmarks/session_p_gpu.sh            # reports in $OUT (default /tmp/dtree_session_p)
#     ROUNDS=1 LOW=0 PART=ab bash benchmarks/session_p_gpu.sh; FINAL_STEPS=3 CASE1_STEPS=8 PART=final bash ...
#                                                            # what the session's last calls ran (device time)
#     SMOKE=1 PART=calls bash benchmarks/session_p_gpu.sh    # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_p}
PART=${PART:-calls}
source benchmarks/bench_cases.sh
CAP=14.5 SMALL=4096 MID=8192 TINY=2048
[ "${SMOKE:-0}" = 1 ] && CAP=4 SMALL=64 MID=128 TINY=32

case "$PART" in
  calls)
    bench calls64k 560 $AGENTIC64K --steps $STEPS --max-config-seconds 40 --configs "dtree,\
dtree:group_tokens=$MID+checkpoint_layers=0,dtree:group_tokens=$SMALL+checkpoint_layers=0,\
dtree:group_tokens=$TINY+checkpoint_layers=0,dtree:memory=$CAP,\
dtree:memory=$CAP+group_tokens=$SMALL+checkpoint_layers=0,dtree:memory=$CAP+group_tokens=$MID+checkpoint_layers=21,\
dtree:memory=$CAP+group_tokens=$MID+checkpoint_layers=14,tree-mask:whole+ckpt"
    grep -o '"checkpoint_layers": [0-9]*, "group_tokens": [0-9]*\|"path_checkpoint_layers": [^,]*\|"groups": [0-9]*\|"recomputed_tokens": [0-9]*' \
      "$OUT"/calls64k/*.md | head -40
    ;;
  diag)  # where the extra time of small calls goes: GPU idle by phase, and the kernels, at 2,048-token calls
    OUT=$OUT timeout 200 python benchmarks/gpu_idle.py $SMOKE_FLAG --opt group_tokens=$TINY --opt checkpoint_layers=0 \
      --tag calls$TINY 2>&1 | tail -30
    timeout 300 python benchmarks/profile_step.py $([ -n "$SMOKE_FLAG" ] && echo "--model tiny") $AGENTIC64K --top 25 \
      --configs "dtree,dtree:group_tokens=$TINY+checkpoint_layers=0" --out "$OUT/profile" 2>&1 | tail -120
    ;;
  origins)  # which code launches each kernel: GRPO case 1 and the 64k tree at memory="low"
    OUT=$OUT timeout 150 python benchmarks/kernel_origins.py $SMOKE_FLAG --workload case1 --top 90 2>&1 | grep -v USDT | tail -95
    OUT=$OUT timeout 300 python benchmarks/kernel_origins.py $SMOKE_FLAG --workload agentic64k --opt memory=low --tag low \
      --top 90 >/dev/null 2>&1; head -5 "$OUT/kernel_origins_agentic64k_low.md"
    ;;
  ab)  # the commit before this session's changes (.oldm/: git archive <rev> dtree | tar -x -C .oldm) against them,
      # processes alternating: GRPO case 1 in each of ROUNDS rounds (2), the 64k tree at memory="low" in the first (unless
      # LOW=0); then where case 1's kernels come from
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for side in old new; do
        dir=$PWD; [ $side = old ] && dir=$PWD/.oldm
        (cd "$dir" && bench "ab_${side}_case1_$round" 80 $CASE1 --steps 10 --configs dtree)
        [ $round = 1 ] && [ "${LOW:-1}" = 1 ] && (cd "$dir" && bench "ab_${side}_low" 90 $AGENTIC64K --steps $STEPS --configs dtree:low)
      done
    done
    OUT=$OUT timeout 150 python benchmarks/kernel_origins.py $SMOKE_FLAG --workload case1 --tag after --top 40 2>&1 \
      | grep -v USDT | sed -n 3,3p
    ;;
  final)
    bench final64k 300 $AGENTIC64K --steps "${FINAL_STEPS:-$STEPS}" --configs "dtree,dtree:memory=$CAP,dtree:low,tree-mask:whole+ckpt"
    bench case1 90 $CASE1 --steps "${CASE1_STEPS:-10}" --configs "dtree,tree-mask:whole+ckpt"
    ;;
  *) echo "PART must be calls, diag, origins, ab or final"; exit 2 ;;
esac
