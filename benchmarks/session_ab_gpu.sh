#!/usr/bin/env bash
# Session AB on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: where does the capped step (the 256k tree at half the mask's memory) wait on the host, and
# which of its kernels does the re-run add; then, after the changes, the capped steps against the mask again.
#
#   PART=diag    the 256k tree under memory=19.9: the GPU's idle time charged to the step's phases
#                (benchmarks/gpu_idle.py), the plan's host time (benchmarks/plan_profile.py); the 64k tree
#                under memory=14.5: which code launches each kernel (benchmarks/kernel_origins.py);
#   PART=plans   the memory policy's candidates faster than the plan it runs (benchmarks/plan_candidates.py):
#                the 256k tree under memory=19.9, the 64k tree under memory=12.5 (the mask's memory) and low;
#   PART=lowpeak what makes up `low`'s peak on the 64k tree with 12k- and 16k-token calls (profile_memory.py);
#   PART=low8    the 64k tree: the mask, then low, 8 fresh forests each in one process (the order of PART=final reversed);
#   PART=final   the GPU tests of the SwiGLU op and the re-run (not with SKIP_TESTS=1); the re-run's SwiGLU
#                backward with its chunk sum in the matmul and after it (benchmarks/bench_swiglu_rerun.py); the
#                256k tree: memory=19.9 and the mask in one process; the 64k tree: low and the mask likewise.
#
#     PART=diag bash benchmarks/session_ab_gpu.sh           # reports in $OUT (default /tmp/dtree_session_ab)
#     SMOKE=1 PART=diag bash benchmarks/session_ab_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ab}
PART=${PART:-diag}
source benchmarks/bench_cases.sh  # AGENTIC64K, bench, script, gpu_tests, SMOKE_FLAG
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
AT_HALF=${AT_HALF:-19.9}
if [ -n "$SMOKE_FLAG" ]; then
  AGENTIC256K=$AGENTIC64K AT_HALF=4
fi

case "$PART" in
  diag)
    script gpu_idle 240 --workload agentic256k --opt memory=$AT_HALF --tag capped
    script plan_profile 240 --workload agentic256k --opt memory=$AT_HALF --steps 2
    script kernel_origins 200 --workload agentic64k --opt memory=14.5 --tag capped
    ;;
  plans)
    script plan_candidates 300 --workload agentic256k --opt memory=$AT_HALF
    mv "$OUT/plan_candidates.log" "$OUT/plan_candidates_256k.log"
    script plan_candidates 200 --workload agentic64k --opt memory=12.5
    mv "$OUT/plan_candidates_agentic64k.md" "$OUT/plan_candidates_agentic64k_at_mask.md"
    script plan_candidates 200 --workload agentic64k --opt memory=low
    mv "$OUT/plan_candidates_agentic64k.md" "$OUT/plan_candidates_agentic64k_low.md"
    ;;
  lowpeak)
    memory_profile lowpeak 400 "dtree:low,dtree:memory=low+group_tokens=16384" 80
    ;;
  low8)
    bench low64k_rotated 360 $AGENTIC64K --steps 8 --configs "tree-mask:whole+ckpt,dtree:low"
    ;;
  final)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_final.txt 240 "swiglu or sum_chunk or recompute or checkpoint or memory" \
      tests/test_swiglu.py tests/test_layer_recompute.py tests/test_checkpoint_layers.py tests/test_runtime_gpu.py
    script bench_swiglu_rerun 120
    bench half256k 420 $AGENTIC256K --steps 3 --configs "dtree:memory=$AT_HALF,tree-mask:whole+ckpt"
    bench low64k 300 $AGENTIC64K --steps 5 --configs "dtree:low,tree-mask:whole+ckpt"
    ;;
  *) echo "PART must be diag, plans, lowpeak, low8 or final"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
