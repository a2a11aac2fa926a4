#!/usr/bin/env bash
# Session AN on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# Two changes to the kernels of every dtree step: the projections' bias gradients summed by row splits as well as
# column blocks (dtree.ops.shared_input_linear.triton_kernels: 64 programs of 32 columns ran at ~400 GB/s, 18.8 ms
# of the default 64k step), and the lean MLP's down projection owning gate and up in a step's graph
# (dtree.ops.backward_once: its backward writes their gradients and the product in one pass, where it recomputed
# the product in a pass of its own, 22.6 ms of the same step). Do they hold on the GPU, and what do they give?
#
#   PART=check   the GPU tests (pytest -m gpu) of the touched ops, the lean layers, the fast launches and the memory
#                predictions; then one profiled 64k step by kernel (benchmarks/kernel_origins.py), the default and
#                memory=12.5, against session AL's origins/ (1,480 and 1,687 ms of kernels);
#   PART=steps   in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the
#                default (bench_cases.sh's vs_mask64k); then GRPO case 1: dtree, tree-mask:whole+ckpt, linearized.
#
#     PART=check bash benchmarks/session_an_gpu.sh             # reports in $OUT (default /tmp/dtree_session_an)
#     SMOKE=1 PART=steps bash benchmarks/session_an_gpu.sh     # tiny trees on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_an}
source benchmarks/bench_cases.sh  # gpu_tests, script, vs_mask64k, bench
TOUCHED="tests/test_swiglu.py tests/test_shared_input_linear.py tests/test_lean_layers.py tests/test_fast_launch.py
 tests/test_runtime_memory.py tests/test_memory_policy.py tests/test_baselines.py"

case "${PART:-check}" in
  check)
    gpu_tests gpu_tests.txt 300 "" $TOUCHED -rfE
    script kernel_origins 150 --workload agentic64k --tag default --top 40
    mv "$OUT/kernel_origins.log" "$OUT/kernel_origins_default.log"
    script kernel_origins 150 --workload agentic64k --opt memory=$AT_MASK --tag capped --top 40
    ;;
  steps)
    vs_mask64k
    bench case1 200 $CASE1 --steps ${CASE1_STEPS:-10} --configs "dtree,tree-mask:whole+ckpt,linearized"
    ;;
  *) echo "PART must be check or steps"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
