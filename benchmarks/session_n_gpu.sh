#!/usr/bin/env bash
# Session N on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in
# parts that each fit one device call:
#
#   PART=new    the GPU tests of what this session changed (the KV stack's gradient slots
#               sized to the groups with children, on the flash-attn one-call path and its
#               fallbacks; the runtime's bf16 steps against HF per path), the LM head's cost per
#               row chunk (benchmarks/head_chunk_cost.py: HEAD_CHUNK_PENALTY's fit), then the
#               64k agentic tree: dtree default, memory=14.5, memory="low" and
#               tree-mask:whole+ckpt in one process, and GRPO case 1 against the mask;
#   PART=ab     the GPU tests mended after the first run, then benchmarks/grad_slots_ab.py: each
#               of the session's two memory changes undone alone, in one process, on the 64k
#               tree (the first run's steps were 3-15% slower than session M's on another host);
#   PART=final  after the first two (memory="low"'s cap without slack undone: it took 1,024-row
#               head chunks for no measured memory): the 64k tree, memory="low" against
#               tree-mask:whole+ckpt in one process; grad_slots_ab.py again (each round starting
#               at the next variant); the 256k agentic tree (dtree default, memory="low",
#               tree-mask:whole+ckpt); qwen2.5-7b on one ~32k agentic tree (dtree default, MFU).
#
#     PART=new bash benchmarks/session_n_gpu.sh            # reports in $OUT (default /tmp/dtree_session_n)
#     SMOKE=1 PART=new bash benchmarks/session_n_gpu.sh    # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_n}
PART=${PART:-new}
source benchmarks/bench_cases.sh
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
AGENTIC32K="--workload agentic --set num_trees=1 --set target_unique_tokens=32768" MODEL7B=qwen2.5-7b
[ "${SMOKE:-0}" = 1 ] && AGENTIC256K="$AGENTIC64K" AGENTIC32K="$AGENTIC64K" MODEL7B=tiny

case "$PART" in
  new)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_stack.py tests/test_masked_call.py \
        tests/test_runtime_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -3
    fi
    timeout 90 python benchmarks/head_chunk_cost.py --out "$OUT" $SMOKE_FLAG 2>/dev/null | tail -2
    bench new 260 $AGENTIC64K --steps $STEPS --configs "dtree,dtree:memory=14.5,dtree:low,tree-mask:whole+ckpt"
    bench case1 90 $CASE1 --steps 10 --configs "dtree,tree-mask:whole+ckpt"
    ;;
  ab)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_masked_call.py \
        tests/test_runtime_gpu.py -k "flash4_replayed or gradient_slots_for_the_path" 2>&1 | tee "$OUT/gpu_tests_ab.txt" | tail -3
    fi
    OUT=$OUT timeout 330 python benchmarks/grad_slots_ab.py --workload agentic64k $SMOKE_FLAG 2>"$OUT/ab_err.txt" | tail -8
    ;;
  final)
    bench final64k 100 $AGENTIC64K --steps $STEPS --configs "dtree:low,tree-mask:whole+ckpt"
    OUT=$OUT timeout 170 python benchmarks/grad_slots_ab.py --workload agentic64k --rounds 3 $SMOKE_FLAG \
      2>"$OUT/ab2_err.txt" | tail -6
    [ -f "$OUT/grad_slots_ab_agentic64k.md" ] && mv "$OUT/grad_slots_ab_agentic64k.md" "$OUT/grad_slots_ab2_agentic64k.md"
    bench agentic256k 200 $AGENTIC256K --steps $STEPS --configs "dtree,dtree:low,tree-mask:whole+ckpt"
    BENCH=${BENCH/qwen2.5-1.5b/$MODEL7B} bench qwen7b 100 $AGENTIC32K --steps $STEPS --configs dtree
    ;;
  *) echo "PART must be new, ab or final"; exit 2 ;;
esac
