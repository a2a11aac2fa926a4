#!/usr/bin/env bash
# Session AT on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call.
# Session AS found cuBLAS making the host wait for the device at GEMM row counts a process had not met (the fused LM
# head's products, 16 of 40 fresh counts, ~120 ms each), which empties the launch queue the capped 64k step relies on.
#
#   PART=marks benchmarks/queue_depth.py --backward-marks on the capped 64k step (memory=12.5): STEPS_AT (default 4)
#              fresh forests after three warm-up ones, then two forests each run twice (--repeat): where the host
#              waits inside each call's backward, and whether a second run over the same forest still waits.
#   PART=blas  benchmarks/host_blocking_ops.py's fresh-row-count table (the head's products and a decoder layer's) as
#              torch runs it by default, with cuBLASLt preferred, with larger cuBLAS/cuBLASLt workspaces, and with every
#              module loaded eagerly: which setting, if any, keeps cuBLAS from waiting for the device at new shapes.
#   PART=host  the per-call host work before a step's first kernel (the model's walk, checks and lean-layer swap) before
#              and after this session's change to it, where .oldm/ holds the commit before it (`git archive <rev> dtree
#              $(git ls-files 'benchmarks/*.py' 'benchmarks/*.sh') | tar -x -C .oldm`): GRPO case 1 in `dtree bench`
#              (10 steps, processes alternating new/old, twice) and benchmarks/queue_depth.py (when the first kernel
#              starts); then the GPU tests of the lean layers, compiled layers and dropout.
#
#     PART=marks bash benchmarks/session_at_gpu.sh           # reports in $OUT (default /tmp/dtree_session_at)
#     SMOKE=1 PART=marks bash benchmarks/session_at_gpu.sh   # the tiny model on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_at}
source benchmarks/bench_cases.sh  # script, bench, gpu_tests, AT_MASK, CASE1, SMOKE_FLAG

case "${PART:-marks}" in
  marks)
    script queue_depth 240 --workload agentic64k --opt memory=$AT_MASK --steps ${STEPS_AT:-4} --backward-marks \
      --tag at_mask_marks
    mv "$OUT/queue_depth.log" "$OUT/queue_depth_fresh.log"
    script queue_depth 200 --workload agentic64k --opt memory=$AT_MASK --steps 2 --repeat --backward-marks \
      --tag at_mask_marks_repeat
    ;;
  blas)
    fresh="--only-fresh --fresh ${FRESH:-24} --reps 1"
    script host_blocking_ops 200 $fresh --tag _default
    script host_blocking_ops 200 $fresh --blas cublaslt --tag _cublaslt
    CUBLAS_WORKSPACE_CONFIG=:65536:8 TORCH_CUBLASLT_WORKSPACE_SIZE=262144 script host_blocking_ops 200 $fresh \
      --tag _workspace
    CUDA_MODULE_LOADING=EAGER script host_blocking_ops 300 $fresh --tag _eager
    ;;
  host)
    for round in 1 2; do
      for side in new old; do
        dir=$PWD; [ $side = old ] && dir=$PWD/.oldm
        [ -d "$dir/dtree" ] || continue
        (cd "$dir" && bench "ab_${side}_case1_$round" 90 $CASE1 --steps ${CASE1_STEPS:-10} --configs dtree)
      done
    done
    script queue_depth 120 --workload case1 --steps 3 --tag case1_new
    if [ -d .oldm/dtree ]; then
      (cd .oldm && script queue_depth 120 --workload case1 --steps 3 --tag case1_old)
    fi
    gpu_tests gpu_tests.txt 300 "gpu" tests/test_lean_layers.py tests/test_compiled_model.py tests/test_dropout.py -rfE
    ;;
  *) echo "PART must be marks, blas or host"; exit 2 ;;
esac
