#!/usr/bin/env bash
# Session AH on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: flash-attn-4 evaluates the mask function once per score of a partial tile, and Hopper's backward also
# wraps both indices and checks them against the lengths per score (session AG: the mask's evaluation 12% of the
# backward with the packed word, 7-8% of the forward). Reading each key's bounds once per thread and tile
# (dtree/ops/stack_attention/flash4_slot_bounds.py), how much of that goes?
#
#   PART=check   the GPU tests of the one-call path (the per-key masks against flash-attn-4's own evaluation, the
#                replayed calls), then benchmarks/mask_tile_cost.py on the largest call of the 256k tree's
#                32k-token schedule and of the 64k tree's 16k-token one: two_tables, packed (session AG's forward
#                and backward), slot_two_tables, slot_packed (this session's) and all_full;
#   PART=steps   the whole-step GPU tests through the flash-attn backend (every gradient by the flash-attention
#                rule against the float32 model per path), then in one process (dtree bench) the 64k tree:
#                tree-mask:whole+ckpt against memory=12.5, low and the default;
#   PART=half256 the 256k tree: the mask with 32,768-row re-run chunks against memory=19.9 (STEPS256 steps, default 4).
#   PART=origins benchmarks/kernel_origins.py on the 256k tree under memory=19.9 (session AG's PART=origins ran it
#                with flash-attn-4's own evaluation of the masks).
#
#     PART=check bash benchmarks/session_ah_gpu.sh           # reports in $OUT (default /tmp/dtree_session_ah)
#     SMOKE=1 PART=steps bash benchmarks/session_ah_gpu.sh   # tiny trees: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ah}
PART=${PART:-check}
source benchmarks/bench_cases.sh  # vs_mask64k, half256k, capped256k_origins, script, gpu_tests, SMOKE_FLAG

case "$PART" in
  check)
    gpu_tests gpu_tests_masks.txt 300 "flash4" tests/test_masked_call.py
    script mask_tile_cost 400 --calls agentic256k:32768:1,agentic64k:16384:1 \
      --variants two_tables,packed,slot_two_tables,slot_packed,all_full
    ;;
  steps)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_steps.txt 300 "flash or window or keeping" \
      tests/test_runtime_gpu.py tests/test_kv_window.py tests/test_output_memo.py tests/test_stack_attention_regions.py
    vs_mask64k
    ;;
  half256)
    half256k
    ;;
  origins)
    capped256k_origins
    ;;
  *) echo "PART must be check, steps, half256 or origins"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
