#!/usr/bin/env bash
# Session O on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in
# parts that each fit one device call:
#
#   PART=diag   what holds memory at `memory="low"`'s peak on the 64k agentic tree
#               (benchmarks/profile_memory.py: the allocator's trace replayed to the peak, the
#               blocks alive then by owner) and where the GPU waits in GRPO case 1 and in the 64k
#               `low` step (benchmarks/gpu_idle.py: idle time by the walk's phase);
#   PART=memory after the change the diagnosis pointed to (each call's backward with the LM head's
#               part first, dtree.engine.head_first): the runtime's bf16 GPU tests, then the
#               memory profile again, `memory="low"` and tree-mask:whole+ckpt, after the change
#               and (where .oldm/ holds the commit before it: `git archive <rev> dtree | tar -x -C
#               .oldm`) before it, same forest;
#   PART=ab     GRPO case 1 and the 64k tree at `memory="low"`, this session's commit against the one
#               before it (.oldm/), in processes that alternate, twice;
#   PART=final  the 64k agentic tree (dtree default, memory=14.5, memory="low",
#               tree-mask:whole+ckpt in one process) and GRPO case 1 against the mask; the memory
#               profile of `memory="low"` once more (its head chunks now the recipe's).
#
#     PART=diag bash benchmarks/session_o_gpu.sh            # reports in $OUT (default /tmp/dtree_session_o)
#     SMOKE=1 PART=diag bash benchmarks/session_o_gpu.sh    # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_o}
PART=${PART:-diag}
source benchmarks/bench_cases.sh
MEMORY_SET="--set num_trees=1 --set target_unique_tokens=65536"
[ "${SMOKE:-0}" = 1 ] && MEMORY_SET="--set num_trees=1 --set target_unique_tokens=400 --set system_prompt_len=64 --set trajectories=2 --set turn_len=4,40"

case "$PART" in
  diag)
    timeout 150 python benchmarks/profile_memory.py --configs "dtree:low,dtree:memory=14.5" $MEMORY_SET \
      --out "$OUT" >"$OUT/profile_memory.log" 2>&1; tail -40 "$OUT/profile_memory.log"
    OUT=$OUT timeout 90 python benchmarks/gpu_idle.py $SMOKE_FLAG --workload case1 2>&1 | tail -24
    OUT=$OUT timeout 120 python benchmarks/gpu_idle.py $SMOKE_FLAG --opt memory=low --tag low 2>&1 | tail -24
    ;;
  memory)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.txt" | tail -3
    fi
    timeout 200 python benchmarks/profile_memory.py --configs "dtree:low,tree-mask:whole+ckpt" $MEMORY_SET \
      --out "$OUT" >"$OUT/profile_memory_after.log" 2>&1; grep -A4 "^| config" "$OUT/profile_memory_after.log"
    if [ -d .oldm/dtree ]; then
      mkdir -p .oldm/benchmarks "$OUT/before" && cp benchmarks/profile_memory.py .oldm/benchmarks/
      (cd .oldm && timeout 200 python benchmarks/profile_memory.py --configs "dtree:low,tree-mask:whole+ckpt" \
        $MEMORY_SET --out "$OUT/before" >"$OUT/profile_memory_before.log" 2>&1)
      grep -A4 "^| config" "$OUT/profile_memory_before.log"
    fi
    ;;
  final)
    bench final64k 260 $AGENTIC64K --steps $STEPS --configs "dtree,dtree:memory=14.5,dtree:low,tree-mask:whole+ckpt"
    bench case1 90 $CASE1 --steps 10 --configs "dtree,tree-mask:whole+ckpt"
    mkdir -p "$OUT/memory_final"
    timeout 150 python benchmarks/profile_memory.py --configs "dtree:low" $MEMORY_SET --out "$OUT/memory_final" \
      >"$OUT/profile_memory_final.log" 2>&1; grep -A3 "^| config" "$OUT/profile_memory_final.log"
    ;;
  ab)  # the commit before this session's changes (.oldm/, as for PART=memory) against them, processes alternating
    for round in 1 2; do
      for side in old new; do
        dir=$PWD; [ $side = old ] && dir=$PWD/.oldm
        (cd "$dir" && bench "ab_${side}_case1_$round" 80 $CASE1 --steps 10 --configs dtree)
        (cd "$dir" && bench "ab_${side}_low_$round" 90 $AGENTIC64K --steps $STEPS --configs dtree:low)
      done
    done
    ;;
  *) echo "PART must be diag, memory, final or ab"; exit 2 ;;
esac
