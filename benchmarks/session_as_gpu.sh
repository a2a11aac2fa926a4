#!/usr/bin/env bash
# Session AS on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call.
# Where the capped 64k step's ~85 ms of wall time over its kernels goes, measured without a profiler: session AQ's
# profiled step charged 51 ms of idle GPU time to the backward's ~6 us launch gaps, 28 ms to the plan, 27 ms to the
# forwards and 19 ms to the step's code between phases (134.6 ms in a 1.788 s profiled step, 1.736 s unprofiled), and
# a profiler makes every launch dearer on the host. Then the GPU tests of the changed plan code (the step whose plan
# keeps its calls' head logits).
#
#   PART=depth  benchmarks/queue_depth.py on the 64k tree at the mask's memory (memory=12.5) and in the default plan:
#               how far the host runs ahead of the GPU at each call's forward, loss and backward, and at every 4th
#               decoder layer (the re-runs' in the backward included); then the GPU tests of test_runtime_gpu.py's
#               fused-head steps and of test_head_keep.py.
#   PART=marks  the capped step again with marks inside each call's backward (--backward-marks): the LM head's part, the
#               fused head's backward, every checkpointed layer's backward, the decoder's part queued.
#   PART=loading the same with CUDA_MODULE_LOADING=EAGER (every kernel of the process loaded when CUDA starts, none
#               on its first launch inside a step) and, apart, without expandable segments (no memory mapped inside a
#               step): which of the two makes the host wait inside the fused head's backward.
#   PART=first  benchmarks/host_blocking_ops.py (cuBLAS products at row counts never used before, then again) and
#               benchmarks/first_encounter.py on the capped 64k step: each fresh forest run twice, the second run meeting
#               only shapes the first met.
#   PART=prewarm first_encounter.py again with the LM head's forward and backward run once at every 64th row count from
#               256 to 16,640 before the timed runs (--prewarm-head): how much of the first run's extra time the head's
#               new shapes are.
#
#     PART=depth bash benchmarks/session_as_gpu.sh             # reports in $OUT (default /tmp/dtree_session_as)
#     SMOKE=1 PART=depth bash benchmarks/session_as_gpu.sh     # the tiny model on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_as}
source benchmarks/bench_cases.sh  # script, gpu_tests, AT_MASK, SMOKE_FLAG

case "${PART:-depth}" in
  depth)
    script queue_depth 240 --workload agentic64k --opt memory=$AT_MASK --steps 2 --layer-every 4 --tag at_mask
    script queue_depth 200 --workload agentic64k --steps 1 --layer-every 4 --tag default
    gpu_tests gpu_tests.txt 200 "fused_head or head" tests/test_runtime_gpu.py tests/test_head_keep.py -rfE
    ;;
  marks)
    script queue_depth 240 --workload agentic64k --opt memory=$AT_MASK --steps 2 --backward-marks --tag at_mask_marks
    ;;
  loading)
    CUDA_MODULE_LOADING=EAGER script queue_depth 300 --workload agentic64k --opt memory=$AT_MASK --steps 2 \
      --backward-marks --tag at_mask_eager
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False script queue_depth 240 --workload agentic64k --opt memory=$AT_MASK --steps 2 \
      --backward-marks --tag at_mask_no_expandable
    ;;
  first)
    script host_blocking_ops 200 --only-fresh --fresh 40 --reps 1
    script first_encounter 420 --workload agentic64k --opt memory=$AT_MASK --forests 4 --no-profile
    ;;
  prewarm)
    script first_encounter 420 --workload agentic64k --opt memory=$AT_MASK --forests 4 --no-profile \
      --prewarm-head ${PREWARM:-256:16641:64}
    ;;
  *) echo "PART must be depth, marks, loading, first or prewarm"; exit 2 ;;
esac
