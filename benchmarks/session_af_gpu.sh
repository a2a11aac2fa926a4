#!/usr/bin/env bash
# Session AF on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: the capped 256k step (memory=19.9, issue 17's half of the mask's memory) runs ~0.85 s more kernel
# time than the default step, of which the re-run's matmuls are ~0.6 s by count. What is the rest, kernel by kernel
# and by the code that launched it, with its GPU time?
#
#   PART=origins  benchmarks/kernel_origins.py (kernels and GPU time by kernel kind, launching op and autograd
#                 node) on the 256k tree under memory=19.9 and by default, and on the 64k tree under memory=12.5.
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
  *) echo "PART must be origins"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
