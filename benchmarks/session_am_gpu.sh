#!/usr/bin/env bash
# Session AM on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The questions: do the bf16 GPU tests still pass on today's code as a whole (sessions AA-AL ran the files they
# touched), and does the tree-mask baseline, whose FlexAttention calls now raise dynamo's recompile limit for
# themselves and refuse to run uncompiled past it (dtree.baselines.kernels.tree_mask_attention.compiled_call),
# keep its speed against dtree on the 64k tree?
#
#   PART=tests_a  the GPU tests (pytest -m gpu) of the Triton stack attention, the stack ops and the fused log-probs;
#   PART=tests_b  every other GPU test (whole steps, the flash-attn backend, the baselines, hybrids, memory);
#   PART=steps    in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the
#                 default (bench_cases.sh's vs_mask64k, as session AL ran it).
#
#     PART=tests_a bash benchmarks/session_am_gpu.sh           # reports in $OUT (default /tmp/dtree_session_am)
#     SMOKE=1 PART=steps bash benchmarks/session_am_gpu.sh     # tiny trees on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_am}
source benchmarks/bench_cases.sh  # gpu_tests, vs_mask64k
KERNEL_TESTS="tests/test_stack_attention_triton.py tests/test_stack_ops.py tests/test_logprobs_triton.py"

case "${PART:-tests_a}" in
  tests_a)
    gpu_tests gpu_tests_a.txt 540 "" $KERNEL_TESTS -rfE
    ;;
  tests_b)
    others=$(ls tests/test_*.py | grep -v -F -x -f <(tr ' ' '\n' <<<"$KERNEL_TESTS"))
    gpu_tests gpu_tests_b.txt 540 "" $others -rfE
    ;;
  steps)
    vs_mask64k
    ;;
  *) echo "PART must be tests_a, tests_b or steps"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
