#!/usr/bin/env bash
# Session AJ on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: after session AI's matmul weights, the capped 64k step still handed ~850 gradients a step to autograd's
# AccumulateGrad (the RMSNorm weights and the q/k/v biases: 57 + 84 per model call), each added into param.grad by a
# kernel of its own. With the reductions' kernels adding into param.grad themselves (dtree/ops/weight_grads.py's
# grad_output), what goes?
#
#   PART=ab     the GPU tests of the weight gradients, the RMSNorm, the shared-input projections and whole steps through
#               the flash-attn backend, then benchmarks/options_ab.py on the 64k tree: memory=12.5 with and without
#               weight_grads_in_matmul (now the matmuls and the reductions), interleaved on fresh forests, then one
#               profiled step per arm (launches, busy);
#   PART=steps  in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the default;
#   PART=half256 the 256k tree: the mask with 32,768-row re-run chunks against memory=19.9 (STEPS256 steps, default 4),
#               that the half-memory target still holds with the reductions' in-place gradients;
#   PART=gaps   where the capped 64k step (memory=12.5) waits: its kernels run within the 1.6x line (1.63 s against
#               1.68), its wall does not (1.76 s). benchmarks/gpu_gaps.py (CUDA activity only) on fresh forests, with
#               the caching allocator's device allocations and frees per step; then benchmarks/queue_depth.py on the
#               same setting: how far the host runs ahead at each group's phases, and the step's device syncs;
#   PART=sample the capped 64k step's host time sampled (py-spy from a wheel in .whl/: benchmarks/host_sampling_gpu.sh):
#               which host work outlasts the forwards' kernels in the groups where the queue drains;
#   PART=check  the GPU tests again on the committed code: the weight gradients, the RMSNorm, the shared-input
#               projections, the lean layers, checkpointed layers and whole steps by the flash-attention rule.
#
#     PART=ab bash benchmarks/session_aj_gpu.sh            # reports in $OUT (default /tmp/dtree_session_aj)
#     SMOKE=1 PART=ab bash benchmarks/session_aj_gpu.sh    # tiny trees on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_aj}
PART=${PART:-ab}
source benchmarks/bench_cases.sh  # vs_mask64k, half256k, script, gpu_tests, AT_MASK

case "$PART" in
  ab)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_ab.txt 200 "bf16 or flash" \
      tests/test_weight_grads.py tests/test_rms_norm.py tests/test_shared_input_linear.py tests/test_runtime_gpu.py
    script options_ab 360 --workload agentic64k --arm memory=$AT_MASK \
      --arm memory=$AT_MASK,weight_grads_in_matmul=false --rounds ${ROUNDS:-6} --kernels --tag reduction_grads
    ;;
  steps)
    vs_mask64k
    ;;
  half256)
    half256k
    ;;
  gaps)
    script gpu_gaps 300 --workload agentic64k --opt memory=$AT_MASK --steps 5 --top 30 --tag at_mask
    grep -E "^\| [0-9] \|" "$OUT/gpu_gaps.log" | cut -c1-200
    script queue_depth 200 --workload agentic64k --opt memory=$AT_MASK --tag at_mask
    ;;
  sample)
    OUT="$OUT" CASES=agentic64k_at_mask bash benchmarks/host_sampling_gpu.sh
    ;;
  check)
    gpu_tests gpu_tests_check.txt 400 "bf16 or flash" tests/test_weight_grads.py tests/test_rms_norm.py \
      tests/test_shared_input_linear.py tests/test_lean_layers.py tests/test_checkpoint_layers.py tests/test_runtime_gpu.py
    ;;
  *) echo "PART must be ab, steps, half256, gaps, sample or check"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
