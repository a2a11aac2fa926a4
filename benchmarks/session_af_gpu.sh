#!/usr/bin/env bash
# Session AF on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: the capped 256k step (memory=19.9, issue 17's half of the mask's memory) runs ~0.85 s more kernel
# time than the default step, of which the re-run's matmuls are ~0.6 s by count. What is the rest, kernel by kernel
# and by the code that launched it, with its GPU time?
#
#   PART=origins  benchmarks/kernel_origins.py (kernels and GPU time by kernel kind, launching op and autograd
#                 node) on the 256k tree under memory=19.9 and by default, and on the 64k tree under memory=12.5;
#   PART=swiglu   a checkpointed layer's SwiGLU backward in fewer, larger row chunks (4,096 rows now: ~5.7 chunks a
#                 layer on the 256k tree's calls, each a dp matmul, a SiLU kernel, a weight-gradient matmul and
#                 cuBLAS' memsets), interleaved on fresh forests (benchmarks/options_ab.py, arm key swiglu_rows):
#                 the 256k tree under memory=19.9, the 64k tree under memory=12.5 and low; then session AE's cuBLAS
#                 against cuBLASLt comparison again, its arms each naming their library (AE's arms without one
#                 inherited the arm before's).
#
#     PART=origins bash benchmarks/session_af_gpu.sh           # reports in $OUT (default /tmp/dtree_session_af)
#     SMOKE=1 PART=origins bash benchmarks/session_af_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_af}
PART=${PART:-origins}
source benchmarks/bench_cases.sh  # script, SMOKE_FLAG
AT_MASK=${AT_MASK:-12.5} HALF=${HALF:-19.9}
[ -n "$SMOKE_FLAG" ] && AT_MASK=4 HALF=4

case "$PART" in
  origins)
    script kernel_origins 200 --workload agentic256k --opt memory=$HALF --tag capped --top 80
    script kernel_origins 200 --workload agentic256k --tag default --top 80
    script kernel_origins 120 --workload agentic64k --opt memory=$AT_MASK --tag at_mask --top 80
    ;;
  swiglu)
    BIG=16384 BIGGER=32768
    [ -n "$SMOKE_FLAG" ] && BIG=64 BIGGER=128
    script options_ab 330 --workload agentic256k --arm memory=$HALF --arm memory=$HALF,swiglu_rows=$BIG \
      --arm memory=$HALF,swiglu_rows=$BIGGER --rounds 3 --warmup 1 --tag swiglu256
    script options_ab 240 --workload agentic64k --arm memory=$AT_MASK --arm memory=$AT_MASK,swiglu_rows=$BIG \
      --arm memory=low --arm memory=low,swiglu_rows=$BIG --rounds 4 --warmup 1 --tag swiglu64
    script options_ab 240 --workload agentic64k --arm memory=$AT_MASK,blas=cublas --arm memory=$AT_MASK,blas=cublaslt \
      --rounds 4 --warmup 1 --kernels --tag blas
    ;;
  *) echo "PART must be origins or swiglu"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
