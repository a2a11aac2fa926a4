#!/usr/bin/env bash
# Issue 17, host time, second look (one device call, ~6 minutes; no flash-attn needed):
# 1. the GPU tests of the Triton kernels fast_launch launches and of the runtime on the GPU
#    (--durations: which ones take the call's time);
# 2. benchmarks/gpu_idle.py: where the GPU has no kernel to run in a step and what the host was
#    doing then, and every device synchronization of a step: the 64k tree in 4,096-token calls
#    (host-bound in session F), the default 64k plan, and GRPO case 1;
# 3. benchmarks/plan_profile.py: the plan's host time (before the step's first kernel) and its parts.
#
#     bash benchmarks/gpu_idle_gpu.sh      # reports in $OUT (default /tmp/dtree_gpu_idle)
#
# SMOKE=1 runs part 2 on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_gpu_idle}
source benchmarks/bench_cases.sh

if [ "${SMOKE:-0}" != 1 ]; then
  echo "== 1. GPU tests"
  timeout 330 python -m pytest -q -p no:cacheprovider -m gpu --durations=12 tests/test_fast_launch.py \
    tests/test_rms_norm.py tests/test_swiglu.py tests/test_stack_ops_triton.py tests/test_logprobs_triton.py \
    tests/test_runtime_gpu.py tests/test_lean_layers.py tests/test_stack_attention_triton.py 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -18
fi

echo "== 2. where the GPU waits"
timeout 120 python benchmarks/gpu_idle.py $SMOKE_FLAG --opt group_tokens=4096 --opt checkpoint_layers=0 --tag 4096_calls 2>&1 | tail -30
timeout 90 python benchmarks/gpu_idle.py $SMOKE_FLAG --tag default 2>&1 | tail -22
timeout 60 python benchmarks/gpu_idle.py $SMOKE_FLAG --workload case1 2>&1 | tail -22

echo "== 3. the plan's host time"
for w in case1 agentic64k; do
  timeout 120 python benchmarks/plan_profile.py $SMOKE_FLAG --workload $w 2>&1 | sed -n 1,24p
done
ls "$OUT"
