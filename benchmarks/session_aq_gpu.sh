#!/usr/bin/env bash
# Session AQ on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The change: after the schedule is known, the step plan gives the calls whose backward follows their forward at once
# (leaf calls, recomputed groups' re-runs) one LM-head chunk of all their loss rows, logits kept for the backward, up
# to the largest row count whose simulated peak still fits the plan's budget (dtree/plan/head_keep.py). Session AP
# measured it by hand on the 64k tree's default plan: kernels 1.422 against 1.451 s for +3.8 GiB. An explicit
# logprob_chunk keeps the old behaviour (the user's chunk for every call), which is the A/B's other arm.
#
#   PART=check  the GPU tests (pytest -m gpu) of the head op and of whole steps (exact against HF, peaks within their
#               predictions); then benchmarks/options_ab.py on the 64k tree: the default against logprob_chunk=4096
#               (4 fresh forests);
#   PART=capped the same for memory=12.5 against memory=12.5,logprob_chunk=4096 (3 forests);
#   PART=caps   memory=12.5 against 12.85 (the mask's 12.51 GiB over the cap's 3% margin: a peak still under the mask's)
#               and memory=12.5,logprob_chunk=4096, interleaved on 5 fresh forests;
#   PART=idle   where the capped step (memory=12.5) leaves the GPU idle, by the step's phase (benchmarks/gpu_idle.py), and
#               the plan's host time (benchmarks/plan_profile.py);
#   PART=steps  in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the
#               default (bench_cases.sh's vs_mask64k); then GRPO case 1: dtree, tree-mask:whole+ckpt, linearized.
#
#     PART=check bash benchmarks/session_aq_gpu.sh             # reports in $OUT (default /tmp/dtree_session_aq)
#     SMOKE=1 PART=check bash benchmarks/session_aq_gpu.sh     # the tiny model on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_aq}
source benchmarks/bench_cases.sh  # script, bench, gpu_tests, ab, vs_mask64k, CASE1, SMOKE_FLAG
TOUCHED="tests/test_logprobs_triton.py tests/test_runtime_gpu.py tests/test_determinism.py"
AB_LIMIT=330

case "${PART:-check}" in
  check)
    gpu_tests gpu_tests.txt 200 "" $TOUCHED -rfE
    ab agentic64k 4 agentic64k head=keep logprob_chunk=4096
    ;;
  capped)
    ab agentic64k 3 agentic64k_12.5GiB memory=12.5 memory=12.5,logprob_chunk=4096
    ;;
  idle)
    script gpu_idle 240 --workload agentic64k --opt memory=$AT_MASK --tag at_mask
    script plan_profile 150 --workload agentic64k --opt memory=$AT_MASK
    ;;
  caps)
    ab agentic64k 5 agentic64k_caps memory=12.5 memory=12.85 memory=12.5,logprob_chunk=4096
    ;;
  steps)
    vs_mask64k
    bench case1 200 $CASE1 --steps ${CASE1_STEPS:-10} --configs "dtree,tree-mask:whole+ckpt,linearized"
    ;;
  *) echo "PART must be check, capped, caps, idle or steps"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
