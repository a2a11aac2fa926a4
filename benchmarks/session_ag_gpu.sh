#!/usr/bin/env bash
# Session AG on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: the capped 256k step's attention runs at ~480 TFLOP/s forward and ~370 backward over its visible
# pairs, where flash-attn-4 ran 700 and 605 on session AA's agentic call; a fifth of a real call's tiles are
# partially visible (the mask function runs on them). What do those tiles cost?
#
#   PART=tiles   benchmarks/mask_tile_cost.py on the two largest calls of the 256k tree's 32k-token schedule and
#                of the 64k tree's 16k-token one: the call as it runs, its mask from one table, the mask function
#                reading nothing, every tile full (and the formulations tried: packed, hi_only, ...).
#   PART=packed  the backward's mask from one packed table (call_mask.packed_bounds), as the step now runs it: the
#                GPU tests of the one-call path and of flash-attn-4's call against the reference (flash-attn rule),
#                then in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and
#                the default;
#   PART=packed256  the same on the 256k tree: the mask with 32,768-row re-run chunks against memory=19.9
#                   (STEPS256 steps each, default 4);
#   PART=origins    benchmarks/kernel_origins.py on the 256k tree under memory=19.9 (session AF's PART=origins
#                   ran it with the two-table backward).
#
#     PART=tiles bash benchmarks/session_ag_gpu.sh           # reports in $OUT (default /tmp/dtree_session_ag)
#     SMOKE=1 PART=tiles bash benchmarks/session_ag_gpu.sh   # tiny trees: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ag}
PART=${PART:-tiles}
source benchmarks/bench_cases.sh  # vs_mask64k, half256k, capped256k_origins, script, gpu_tests, SMOKE_FLAG

case "$PART" in
  tiles)
    script mask_tile_cost 400 --calls agentic256k:32768:1,agentic64k:16384:1
    ;;
  packed)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_packed.txt 240 "gpu and (flash or packed or replayed)" \
      tests/test_masked_call.py tests/test_stack_attention_regions.py tests/test_call_mask.py
    vs_mask64k
    ;;
  packed256)
    half256k
    ;;
  origins)
    capped256k_origins
    ;;
  *) echo "PART must be tiles, packed, packed256 or origins"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
