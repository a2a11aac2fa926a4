#!/usr/bin/env bash
# Session AE on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The questions: cuBLAS issues a CUDA memset before many of its GEMMs (~3.2k of the capped 64k step's 18.5k launches,
# session AB's kernel_origins): does cuBLASLt, torch's other BLAS library, run the step's GEMMs without them, and
# faster? What does the plan cost on the host now that each call budget is packed once? Where do the capped
# targets of issue 17 stand?
#
#   PART=blas   on the 64k tree, interleaved on fresh forests (benchmarks/options_ab.py): the default and memory=12.5
#               (the mask's memory), each with cuBLAS and with cuBLASLt; then one profiled step per arm (launches,
#               memsets, busy time);
#   PART=plan   the plan's host time (benchmarks/plan_profile.py) on the 256k tree under memory=19.9 and on GRPO
#               case 1, and the GPU tests of the runtime's memory plans;
#   PART=mask   tree-mask:whole+ckpt against dtree in one process (dtree bench): the 64k tree at memory=12.5 (the
#               mask's memory) and 10, the 256k tree at memory=19.9 (half the mask's memory).
#
#     PART=blas bash benchmarks/session_ae_gpu.sh           # reports in $OUT (default /tmp/dtree_session_ae)
#     SMOKE=1 PART=blas bash benchmarks/session_ae_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ae}
PART=${PART:-blas}
source benchmarks/bench_cases.sh  # AGENTIC64K, bench, script, gpu_tests, SMOKE_FLAG
AT_MASK=${AT_MASK:-12.5} HALF=${HALF:-19.9} ROUNDS=${ROUNDS:-4}
[ -n "$SMOKE_FLAG" ] && AT_MASK=4 HALF=4 ROUNDS=1
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
[ -n "$SMOKE_FLAG" ] && AGENTIC256K=$AGENTIC64K

case "$PART" in
  blas)
    script options_ab 300 --workload agentic64k --arm memory=auto --arm memory=auto,blas=cublaslt \
      --arm memory=$AT_MASK --arm memory=$AT_MASK,blas=cublaslt --rounds $ROUNDS --warmup 1 --kernels --tag blas
    ;;
  plan)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_plan.txt 200 "memory or plan or capped or offload" \
      tests/test_runtime_gpu.py tests/test_host_checkpoints.py
    script plan_profile 240 --workload agentic256k --opt memory=$HALF --steps 3
    mkdir -p "$OUT/case1" && OUT="$OUT/case1" script plan_profile 120 --workload case1 --steps 5
    ;;
  mask)
    bench at_mask64k 240 $AGENTIC64K --steps 5 --configs "tree-mask:whole+ckpt,dtree:memory=$AT_MASK,dtree:memory=10"
    bench half256k 330 $AGENTIC256K --steps 4 --configs "tree-mask:whole+ckpt,dtree:memory=$HALF"
    ;;
  *) echo "PART must be blas, plan or mask"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
