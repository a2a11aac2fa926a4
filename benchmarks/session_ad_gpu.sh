#!/usr/bin/env bash
# Session AD on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: the memory policy now scores a call budget on what its schedule packs (the largest call, the groups
# with children: dtree.plan.plan_candidates.packed) and, so scored, predicts calls over 32k tokens 7-9% faster under
# a cap with the layer inputs on the host (fewer calls: less of each call's fixed cost). Are they?
#
#   PART=calls64   the GPU tests of the offload's one-buffer fetch and of capped steps; on the 64k tree, interleaved on
#                  fresh forests (benchmarks/options_ab.py): memory=12.5 (the mask's memory) as the policy plans it,
#                  with 64k- and 128k-token calls and the inputs on the host; `low`, and `low` with 128k-token calls;
#   PART=calls256  the 256k tree the same way under memory=19.9 (half the mask's memory);
#   PART=choices   where the new scoring and OFFLOAD_COST=0.02 change the plan, the new plan against the old knobs:
#                  the 64k tree under memory=10 (now offloaded) and 14.5 (32k-token calls), the 256k tree under 30;
#   PART=chunk     the 64k tree under memory=12.5: the new plan's 4096-row LM-head chunks against the 2048 it ran before;
#   PART=mask      ARM64 (default memory=10) and ARM256 (memory=30), dtree bench configurations, against
#                  tree-mask:whole+ckpt in one process, with the caps at the mask's memory and half of it.
#
#     PART=calls64 bash benchmarks/session_ad_gpu.sh           # reports in $OUT (default /tmp/dtree_session_ad)
#     SMOKE=1 PART=calls64 bash benchmarks/session_ad_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ad}
PART=${PART:-calls64}
source benchmarks/bench_cases.sh  # AGENTIC64K, bench, script, gpu_tests, SMOKE_FLAG
AT_MASK=${AT_MASK:-12.5} HALF=${HALF:-19.9} BIG=65536 BIGGER=131072 ROUNDS=${ROUNDS:-4}
[ -n "$SMOKE_FLAG" ] && AT_MASK=4 HALF=4 BIG=256 BIGGER=512 ROUNDS=1
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
[ -n "$SMOKE_FLAG" ] && AGENTIC256K=$AGENTIC64K

case "$PART" in
  calls64)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_calls.txt 150 "unit or offload or flash_rule" \
      tests/test_host_checkpoints.py tests/test_runtime_gpu.py
    script options_ab 280 --workload agentic64k --arm memory=$AT_MASK \
      --arm memory=$AT_MASK,group_tokens=$BIG,offload_checkpoints=true \
      --arm memory=$AT_MASK,group_tokens=$BIGGER,offload_checkpoints=true \
      --arm memory=low --arm memory=low,group_tokens=$BIGGER --rounds $ROUNDS --warmup 1 --tag calls
    ;;
  calls256)
    script options_ab 420 --workload agentic256k --arm memory=$HALF \
      --arm memory=$HALF,group_tokens=$BIG,offload_checkpoints=true \
      --arm memory=$HALF,group_tokens=$BIGGER,offload_checkpoints=true --rounds $((ROUNDS - 1 > 0 ? ROUNDS - 1 : 1)) \
      --warmup 1 --tag calls
    ;;
  mask)
    ARM64=${ARM64:-memory=10}
    ARM256=${ARM256:-memory=30}
    bench at_mask64k 240 $AGENTIC64K --steps 5 --configs "tree-mask:whole+ckpt,dtree:$ARM64,dtree:memory=$AT_MASK"
    bench half256k 330 $AGENTIC256K --steps 4 --configs "tree-mask:whole+ckpt,dtree:$ARM256,dtree:memory=$HALF"
    ;;
  choices)
    script options_ab 240 --workload agentic64k --arm memory=10 --arm memory=10,offload_checkpoints=false \
      --arm memory=14.5 --arm memory=14.5,group_tokens=16384,logprob_chunk=4096 --rounds $ROUNDS --warmup 1 --tag choices
    script options_ab 240 --workload agentic256k --arm memory=30 --arm memory=30,group_tokens=32768,checkpoint_layers=true \
      --rounds $((ROUNDS - 1 > 0 ? ROUNDS - 1 : 1)) --warmup 1 --tag choices
    ;;
  chunk)
    script options_ab 200 --workload agentic64k --arm memory=$AT_MASK --arm memory=$AT_MASK,logprob_chunk=2048 \
      --rounds 5 --warmup 1 --tag chunk
    ;;
  *) echo "PART must be calls64, calls256, choices, chunk or mask"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
