#!/usr/bin/env bash
# Session AF on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: the capped 256k step (memory=19.9, issue 17's half of the mask's memory) runs ~0.85 s more kernel
# time than the default step, of which the re-run's matmuls are ~0.6 s by count. What is the rest, kernel by kernel
# and by the code that launched it, with its GPU time?
#
#   PART=origins  benchmarks/kernel_origins.py (kernels and GPU time by kernel kind, launching op and autograd
#                 node) on the 256k tree under memory=19.9 and by default, and on the 64k tree under memory=12.5;
#   PART=swiglu   (ran at d76b8b0, where options_ab's arm key swiglu_rows set the op's chunk rows; results in
#                 swiglu/) a checkpointed layer's SwiGLU backward in fewer, larger row chunks;
#   PART=rows     the re-run's chunk rows as the plan now sets them (rerun_chunk_rows: each call in one chunk, but
#                 `low` in 4,096-row chunks): the GPU tests of the SwiGLU op and of checkpointed layers; on the 64k
#                 tree interleaved (options_ab) memory=12.5 and low each with the other rows; then in one process
#                 (dtree bench) tree-mask:whole+ckpt with its 4,096-row chunks and with 32,768-row ones against
#                 memory=12.5 and low (PART=rows256: the same on the 256k tree against memory=19.9);
#   PART=warm     the 64k A/B of PART=rows again with options_ab warming every arm on each forest.
#
#     PART=origins bash benchmarks/session_af_gpu.sh           # reports in $OUT (default /tmp/dtree_session_af)
#     SMOKE=1 PART=origins bash benchmarks/session_af_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_af}
PART=${PART:-origins}
source benchmarks/bench_cases.sh  # AGENTIC64K, AGENTIC256K, AT_MASK, HALF, bench, script, gpu_tests, SMOKE_FLAG

case "$PART" in
  origins)
    script kernel_origins 200 --workload agentic256k --opt memory=$HALF --tag capped --top 80
    script kernel_origins 200 --workload agentic256k --tag default --top 80
    script kernel_origins 120 --workload agentic64k --opt memory=$AT_MASK --tag at_mask --top 80
    ;;
  rows)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_rows.txt 200 "swiglu or rerun or chunk" \
      tests/test_swiglu.py tests/test_checkpoint_layers.py tests/test_baselines.py
    script options_ab 240 --workload agentic64k --arm memory=$AT_MASK --arm memory=$AT_MASK,rerun_chunk_rows=4096 \
      --arm memory=low --arm memory=low,rerun_chunk_rows=0 --rounds 4 --warmup 1 --tag rows64
    bench at_mask64k 300 $AGENTIC64K --steps 5 --configs \
      "tree-mask:whole+ckpt,tree-mask:whole+ckpt+rerun_chunk_rows=32768,dtree:memory=$AT_MASK,dtree:low"
    ;;
  rows256)
    bench half256k 560 $AGENTIC256K --steps 4 --configs \
      "tree-mask:whole+ckpt,tree-mask:whole+ckpt+rerun_chunk_rows=32768,dtree:memory=$HALF"
    ;;
  warm)
    script options_ab 280 --workload agentic64k --arm memory=$AT_MASK --arm memory=$AT_MASK,rerun_chunk_rows=4096 \
      --arm memory=low --arm memory=low,rerun_chunk_rows=0 --rounds 5 --warmup 1 --tag warm64
    ;;
  *) echo "PART must be origins, rows, rows256 or warm"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
