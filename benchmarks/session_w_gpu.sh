#!/usr/bin/env bash
# Session W on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# that each fit one device call. The session's subject: checkpointed layers' attention outputs kept
# for their re-run in pinned host memory beside their layer's input (0a2cdff: measured slower, reverted),
# and what the offload of layer inputs costs a step under a cap in GiB.
#
#   PART=main    the bf16 GPU tests of the offload and of kept outputs, then `dtree bench` on the 64k
#                agentic tree: low and memory=$CAP with and without kept outputs, the default, against
#                tree-mask:whole+ckpt (run at 0a2cdff);
#   PART=ab      the same process, fresh 64k forests, the order rotating (benchmarks/offload_cost.py
#                --compare keep_attention_outputs): low and memory=$CAP with and without kept outputs; then
#                `dtree bench`: memory=$CAP as planned, without the offload, with 16k-token calls (0a2cdff);
#   PART=scale   the 256k tree at half the mask's peak (memory=$HALF256K) with and without kept
#                outputs, against the mask; a memory profile of low on the 64k tree (0a2cdff);
#   PART=final   after the revert, with the offload under a cap in GiB only where nothing fits without it:
#                the GPU tests of checkpointing, the offload and kept outputs; the 64k tree (low,
#                memory=$CAP, the default) and the 256k tree (memory=$HALF256K) against the mask;
#
#   PART=tight   a cap (memory=$TIGHT) where the 64k tree's only plan that fits with the layer inputs on the
#                device runs 2k-token calls: the default offload against it (first run: the offload taken only
#                where nothing fit without it, which chose that plan), and memory=$CAP, against the mask;
#
#     PART=main bash benchmarks/session_w_gpu.sh           # reports in $OUT (default /tmp/dtree_session_w)
#     SMOKE=1 PART=main bash benchmarks/session_w_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_w}
PART=${PART:-main}
source benchmarks/bench_cases.sh  # CAP: 14.5 GiB, the mask's peak on the 64k tree (4 with SMOKE=1)
HALF256K=19.9
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
[ -n "$SMOKE_FLAG" ] && HALF256K=4 AGENTIC256K="$AGENTIC64K"
NOKEEP=keep_attention_outputs=False
TIGHT=${TIGHT:-8}
[ -n "$SMOKE_FLAG" ] && TIGHT=3.5

case "$PART" in
  main)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py tests/test_output_memo.py \
        -k "offload or keeping" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -3
    fi
    bench main64k 380 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree:low,dtree:low+$NOKEEP,dtree:memory=$CAP,dtree:memory=$CAP+$NOKEEP,dtree,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  ab)
    for opt in low "$CAP"; do
      mkdir -p "$OUT/keep_$opt"
      OUT="$OUT/keep_$opt" timeout 200 python benchmarks/offload_cost.py $SMOKE_FLAG --steps "${COST_STEPS:-3}" \
        --compare keep_attention_outputs --opt "memory=$opt" >"$OUT/keep_$opt.log" 2>&1
      grep -E "^\| |^step" "$OUT/keep_$opt.log" | head -12 | cut -c1-260
    done
    bench capped64k 300 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree:memory=$CAP,dtree:memory=$CAP+offload_checkpoints=False,dtree:memory=$CAP+group_tokens=16384,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  final)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py tests/test_output_memo.py \
        -k "checkpoint or offload or keeping" 2>&1 | tee "$OUT/gpu_tests_final.txt" | tail -3
    fi
    bench final64k 240 $AGENTIC64K --steps "${STEPS}" --configs "dtree:low,dtree:memory=$CAP,dtree,tree-mask:whole+ckpt"
    bench final256k 240 $AGENTIC256K --steps "${SCALE_STEPS:-3}" --configs "dtree:memory=$HALF256K,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  tight)
    bench tight64k 300 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree:memory=$TIGHT,dtree:memory=$CAP,tree-mask:whole+ckpt${TIGHT_EXTRA:-}"
    rm -f "$OUT"/*/*.png
    ;;
  scale)
    bench half256k 420 $AGENTIC256K --steps "${SCALE_STEPS:-3}" --configs \
      "dtree:memory=$HALF256K,dtree:memory=$HALF256K+$NOKEEP,tree-mask:whole+ckpt"
    memory_profile memory_low 150 dtree:low 30
    rm -f "$OUT"/*/*.png
    ;;
  *) echo "PART must be main, ab, scale, final or tight"; exit 2 ;;
esac
