#!/usr/bin/env bash
# Session Z on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call.
# The question: with its leaf calls' K/V in the KV window (session Y), should `memory="low"` (the layer inputs on
# the host) run 16k-token calls instead of 12k (dtree/plan/memory_policy.py: LOW_GROUP_TOKENS_OFFLOADED)?
# The session's run had the constant at 16384 (`dtree:low` = 16k, the other config 12k); it stays at 12288
# (results/h200/session_z/README.md says why), so the script now names the 16k plan explicitly.
#
#   PART=low     the 64k agentic tree: `low` and the 16k-call recipe (`memory=low+group_tokens=16384`)
#                and the mask in one process, then the two `low`s in the other order in a second process;
#                then (not with SKIP_TESTS=1) the GPU tests of the memory policy, the window and the offload;
#   PART=final   the GPU tests of the flash-attn steps (not with SKIP_TESTS=1); the 64k tree's default, memory=$AT_MASK,
#                low, the mask and linearized (flash-attn-4 where installed) in one process; GRPO case 1 likewise;
#   PART=ab      with BASE a directory holding the package of the last session (`git archive 36d00ae dtree | tar -x -C
#                $BASE`): GRPO case 1's default and the 64k tree's memory=$AT_MASK with this checkout, that package, this checkout.
#
#     PART=low bash benchmarks/session_z_gpu.sh           # reports in $OUT (default /tmp/dtree_session_z)
#     SMOKE=1 PART=low bash benchmarks/session_z_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_z}
PART=${PART:-low}
source benchmarks/bench_cases.sh  # AGENTIC64K, STEPS, bench, gpu_tests
OTHER_LOW="dtree:memory=low+group_tokens=16384"
AT_MASK=${AT_MASK:-12.5}
[ -n "$SMOKE_FLAG" ] && AT_MASK=3.8

case "$PART" in
  low)
    bench low_first 200 $AGENTIC64K --steps 5 --configs "$OTHER_LOW,dtree:low,tree-mask:whole+ckpt"
    bench low_second 150 $AGENTIC64K --steps 5 --configs "dtree:low,$OTHER_LOW"
    grep -hoE '^- `[^`]+` \(last step\)|"group_tokens": [0-9]+' "$OUT"/low_*/*.md | paste -sd' ' | sed 's/- `/\n/g'
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_low.txt 200 "window or memory or offload or checkpoint" \
      tests/test_kv_window.py tests/test_runtime_gpu.py tests/test_memory_policy.py tests/test_host_checkpoints.py
    rm -f "$OUT"/*/*.png "$OUT"/*/*.json
    ;;
  final)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_final.txt 200 "flash_attn" tests/test_kv_window.py tests/test_runtime_gpu.py
    bench final64k 420 $AGENTIC64K --steps 4 --configs \
      "dtree,dtree:memory=$AT_MASK,dtree:low,tree-mask:whole+ckpt,linearized"
    bench case1 120 $CASE1 --steps 6 --configs "dtree,tree-mask:whole+ckpt,linearized"
    rm -f "$OUT"/*/*.png "$OUT"/*/*.json
    ;;
  ab)
    here=$PWD
    both() {  # both ROUND: GRPO case 1's default and the 64k tree's memory=$AT_MASK, one process each
      bench ab_${1}_case1 120 $CASE1 --steps 8 --configs "dtree"
      bench ab_${1}_64k 150 $AGENTIC64K --steps 4 --configs "dtree:memory=$AT_MASK"
    }
    both new1
    (cd "${BASE:?BASE must name the package of the last session}" && PYTHONPATH=$BASE:${PYTHONPATH#$here:} &&
      export PYTHONPATH && python -c 'import dtree; print("base: dtree from", dtree.__file__)' && OUT=$OUT both base)
    both new2
    rm -f "$OUT"/*/*.png "$OUT"/*/*.json
    ;;
  *) echo "PART must be low, final or ab"; exit 2 ;;
esac
