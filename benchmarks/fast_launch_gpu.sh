#!/usr/bin/env bash
# Issue 17, host time: dtree's Triton launches through fast_launch (dtree/ops/fast_launch.py)
# on the H100, in one device call (~6 minutes; no flash-attn needed):
#
# 1. the GPU tests of every Triton kernel fast_launch now launches, and of the runtime and the
#    lean layers that run them in a step (bitwise against kernel[grid]; exact against HF);
# 2. benchmarks/fast_launch_gpu.py: host us per launch both ways; case 1, the 64k tree and the
#    64k tree in 4,096-token calls with fast_launch on and off, interleaved on fresh forests;
# 3. benchmarks/host_profile.py with the backward on the calling thread (so cProfile sees the
#    backward's host time too): the 64k tree in 4,096-token calls and case 1.
#
#     bash benchmarks/fast_launch_gpu.sh      # reports in $OUT (default /tmp/dtree_fast_launch)
#
# SMOKE=1 runs parts 2 and 3 on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_fast_launch}
source benchmarks/bench_cases.sh
SMOKE_FLAG=$([ "${SMOKE:-0}" = 1 ] && echo --smoke || echo)

if [ "${SMOKE:-0}" != 1 ]; then
  echo "== 1. GPU tests"
  timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_launch.py tests/test_rms_norm.py \
    tests/test_swiglu.py tests/test_stack_ops_triton.py tests/test_stack_attention_triton.py \
    tests/test_logprobs_triton.py tests/test_runtime_gpu.py tests/test_lean_layers.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -6
fi

echo "== 2. fast_launch on and off"
timeout 330 python benchmarks/fast_launch_gpu.py $SMOKE_FLAG --out "$OUT" 2>&1 | tail -14

echo "== 3. host profiles, backward on the calling thread"
timeout 150 python benchmarks/host_profile.py $SMOKE_FLAG --workload agentic64k --opt group_tokens=4096 \
  --opt checkpoint_layers=0 --steps 2 --backward-here --tag 4096_calls 2>&1 | sed -n 1,12p
timeout 90 python benchmarks/host_profile.py $SMOKE_FLAG --workload case1 --steps 6 --backward-here 2>&1 | sed -n 1,12p
ls "$OUT"
