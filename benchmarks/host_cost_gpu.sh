#!/usr/bin/env bash
# Issue 17, host time: fast_launch (dtree/ops/fast_launch.py) and dtree's rotary kernel
# (dtree/ops/rotary) on the H100, in one device call (~7 minutes; no flash-attn needed):
#
# 1. the GPU tests of the Triton kernels launched through fast_launch, the rotary kernel (bit
#    for bit against HF), the lean layers and the runtime on the GPU;
# 2. benchmarks/host_cost_ab.py: host us per launch both ways; case 1, the 64k tree and the 64k
#    tree in 4,096-token calls with each change turned off against the default, interleaved;
# 3. benchmarks/gpu_idle.py on the 64k tree in 4,096-token calls: where the GPU still waits.
#
#     bash benchmarks/host_cost_gpu.sh      # reports in $OUT (default /tmp/dtree_host_cost)
#
# SMOKE=1 runs parts 2 and 3 on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_host_cost}
source benchmarks/bench_cases.sh

if [ "${SMOKE:-0}" != 1 ]; then
  echo "== 1. GPU tests"
  timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_launch.py tests/test_rotary.py \
    tests/test_lean_layers.py tests/test_runtime_gpu.py tests/test_rms_norm.py tests/test_swiglu.py \
    --deselect tests/test_lean_layers.py::test_gpu_compiled_lean_layers_by_the_flash_rule 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -4
fi

echo "== 2. each change against the default"
timeout 330 python benchmarks/host_cost_ab.py $SMOKE_FLAG --out "$OUT" 2>&1 | tail -16

echo "== 3. where the GPU still waits"
timeout 100 python benchmarks/gpu_idle.py $SMOKE_FLAG --opt group_tokens=4096 --opt checkpoint_layers=0 --tag 4096_calls 2>&1 | sed -n 1,16p
ls "$OUT"
