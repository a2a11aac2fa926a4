#!/usr/bin/env bash
# Session AK on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: session AJ's queue drained in the capped 64k step's small calls (4,346 and 6,925 tokens of a 16k
# budget), left where sibling trajectories were packed into calls in frontier order (next fit). Packed first fit,
# largest first (dtree/plan/unit_bins.py), the same forests take one call fewer (6 -> 5 on five of six seeds at 16k
# tokens), the largest call no larger. What does that buy?
#
#   PART=ab     the GPU tests of the one-call mask, the masked call and whole steps through the flash-attn backend,
#               then benchmarks/options_ab.py on the 64k tree: memory=12.5 and low, each packed as now and in
#               frontier order (packing=frontier_order), interleaved on fresh forests, then one profiled step per arm;
#   PART=steps  in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low, the default;
#   PART=half256 the 256k tree: the mask with 32,768-row re-run chunks against memory=19.9 (STEPS256 steps, default 4);
#   PART=check  the GPU tests of every file whose steps go through the schedule on the committed code: whole steps,
#               hybrids, offloaded and kept checkpoints, the KV window, determinism, the baselines.
#
#     PART=ab bash benchmarks/session_ak_gpu.sh            # reports in $OUT (default /tmp/dtree_session_ak)
#     SMOKE=1 PART=ab bash benchmarks/session_ak_gpu.sh    # tiny trees on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ak}
source benchmarks/bench_cases.sh  # vs_mask64k, half256k, script, gpu_tests, AT_MASK

case "${PART:-ab}" in
  ab)
    gpu_tests gpu_tests_ab.txt 240 "bf16 or flash" tests/test_call_mask.py tests/test_masked_call.py \
      tests/test_runtime_gpu.py
    script options_ab 420 --workload agentic64k --arm memory=$AT_MASK --arm memory=$AT_MASK,packing=frontier_order \
      --arm memory=low --arm memory=low,packing=frontier_order --rounds ${ROUNDS:-6} --kernels --tag packing
    ;;
  steps)
    vs_mask64k
    ;;
  half256)
    half256k
    ;;
  check)
    gpu_tests gpu_tests_check.txt 540 "" tests/test_runtime_gpu.py tests/test_hybrid.py tests/test_host_checkpoints.py \
      tests/test_kv_window.py tests/test_output_memo.py tests/test_determinism.py tests/test_checkpointing.py \
      tests/test_late_changes.py tests/test_runtime_attention_options.py tests/test_baselines.py
    ;;
  *) echo "PART must be ab, steps, half256 or check"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
