#!/usr/bin/env bash
# Session AI on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: every model call's backward hands each weight's gradient to autograd's AccumulateGrad, which adds it
# into param.grad with a kernel of its own (1,696 adds, the most launched kernel of the capped 64k step, session AF).
# With the lean layers' projections adding into param.grad inside their matmuls (dtree/ops/weight_grads.py), how much
# of the step goes?
#
#   PART=ab     the GPU tests of the weight gradients and of whole steps through the flash-attn backend, then
#               benchmarks/options_ab.py on the 64k tree: memory=12.5 and the default, each with and without
#               weight_grads_in_matmul, interleaved on fresh forests, then one profiled step per arm (launches, busy);
#   PART=steps  in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the default;
#   PART=half256 the 256k tree: the mask with 32,768-row re-run chunks against memory=19.9 (STEPS256 steps, default 4).
#   PART=check  the GPU tests again on the final code (the weights' targets taken at the forward): the weight gradients,
#               the lean layers and whole steps by the flash-attention rule;
#   PART=attn   benchmarks/bench_stack_attention.py on issue 17's grpo and agentic layouts at qwen2.5-1.5b's heads
#               (12 q / 2 kv) and at the bench's default (32 / 8): the masked call with per-key bounds (session AH).
#
#     PART=ab bash benchmarks/session_ai_gpu.sh            # reports in $OUT (default /tmp/dtree_session_ai)
#     SMOKE=1 PART=ab bash benchmarks/session_ai_gpu.sh    # tiny trees on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ai}
PART=${PART:-ab}
source benchmarks/bench_cases.sh  # vs_mask64k, half256k, script, gpu_tests, SMOKE_FLAG, AT_MASK

case "$PART" in
  ab)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_ab.txt 150 "bf16 or flash" \
      tests/test_weight_grads.py tests/test_runtime_gpu.py
    script options_ab 380 --workload agentic64k --arm memory=$AT_MASK \
      --arm memory=$AT_MASK,weight_grads_in_matmul=false --arm memory=auto --arm memory=auto,weight_grads_in_matmul=false \
      --rounds ${ROUNDS:-5} --kernels --tag weight_grads
    ;;
  steps)
    vs_mask64k
    ;;
  check)
    gpu_tests gpu_tests_check.txt 400 "bf16 or flash" \
      tests/test_weight_grads.py tests/test_lean_layers.py tests/test_runtime_gpu.py tests/test_checkpoint_layers.py
    ;;
  half256)
    half256k
    ;;
  attn)
    mkdir -p "$OUT/attn"
    for heads in "12 2" "32 8"; do
      set -- $heads
      timeout 250 python benchmarks/bench_stack_attention.py $SMOKE_FLAG --heads $1 --kv-heads $2 \
        --layouts grpo,agentic --option-cases '' --out "$OUT/attn" --tag "${1}_$2" \
        >"$OUT/attn/log_${1}_$2.txt" 2>&1
      echo "bench_stack_attention $1/$2 heads: exit $?"
    done
    grep -h "^| flash-attn |\|^| fa4 dense\|^## " "$OUT"/attn/*.md | cut -c1-140
    ;;
  *) echo "PART must be ab, steps, check, half256 or attn"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
