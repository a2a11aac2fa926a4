#!/usr/bin/env bash
# Session V on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# that each fit one device call. The session's subject is what the first run over a fresh forest
# pays (session U: 0.3-0.5 s per optimizer step on the 64k tree, in every step of a training loop).
#
#   PART=encounter   benchmarks/first_encounter.py on the 64k agentic tree, the default and
#                    memory=14.5: first, second, deep-copied and allocator-emptied runs over each
#                    fresh forest, and a profiled first/second pair;
#   PART=offload     checkpointed layers' inputs in pinned host memory (offload_checkpoints, on by
#                    default under a memory cap): the bf16 GPU tests of the runtime (with the
#                    offload's: the same bits, a lower peak), then `dtree bench` on the 64k tree:
#                    the default, low and memory=$CAP with and without the offload, low with
#                    10k-token calls, against tree-mask:whole+ckpt (TESTS=offload: only the offload's test);
#   PART=split       the offload's cost apart from the plan's: low's plans (12k-token calls, the path
#                    retained or recomputed) with and without the offload; a memory profile of low;
#   PART=final       the GPU tests of checkpointing, the offload and low; low with and without the
#                    offload, memory=$CAP and the default against tree-mask:whole+ckpt on the 64k
#                    tree (session V ran it at 38b775f, with a re-run MLP in row chunks that this
#                    run had measured slower and no leaner for dtree, and that was reverted after it);
#   PART=offloadcost what the offload costs a step (benchmarks/offload_cost.py): memory=low with and
#                    without it on fresh 64k forests, host time in its puts and gets, pages pinned,
#                    the allocator's retries, and a profiled step of each;
#
#     PART=encounter bash benchmarks/session_v_gpu.sh           # reports in $OUT (default /tmp/dtree_session_v)
#     SMOKE=1 PART=encounter bash benchmarks/session_v_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_v}
PART=${PART:-encounter}
source benchmarks/bench_cases.sh  # CAP: 14.5 GiB, the mask's peak on the 64k tree (4 with SMOKE=1)

encounter() {  # encounter NAME TIMEOUT ARGS...: benchmarks/first_encounter.py into $OUT/NAME
  mkdir -p "$OUT/$1"
  OUT="$OUT/$1" timeout "$2" python benchmarks/first_encounter.py $SMOKE_FLAG "${@:3}" >"$OUT/$1.log" 2>&1
  grep -E "^\| " "$OUT/$1.log" | cut -c1-200
}

case "$PART" in
  encounter)
    encounter default 280 --workload agentic64k --forests "${FORESTS:-3}"
    encounter capped 280 --workload agentic64k --forests "${FORESTS:-3}" --opt "memory=$CAP"
    ;;
  offload)
    if [ -z "$SMOKE_FLAG" ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
      timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py -k "${TESTS:-}" 2>&1 \
        | tee "$OUT/gpu_tests.txt" | tail -3
    fi
    bench offload64k 520 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree,dtree:low,dtree:low+group_tokens=10240,dtree:low+offload_checkpoints=False,dtree:memory=$CAP,dtree:memory=$CAP+offload_checkpoints=False,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  split)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py -k offload 2>&1 \
        | tee "$OUT/gpu_tests_offload.txt" | tail -2
    fi
    bench split64k 420 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree:low,dtree:low+offload_checkpoints=False+group_tokens=12288,dtree:low+mode=recompute,dtree:low+offload_checkpoints=False,tree-mask:whole+ckpt"
    memory_profile memory_low 200 dtree:low
    rm -f "$OUT"/*/*.png
    ;;
  final)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py -k "checkpoint or offload or fused_head" \
        2>&1 | tee "$OUT/gpu_tests_final.txt" | tail -2
    fi
    bench final64k 330 $AGENTIC64K --steps "${STEPS}" --configs \
      "dtree:low,dtree:low+offload_checkpoints=False,dtree:memory=$CAP,dtree,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  offloadcost)
    mkdir -p "$OUT/offload_cost"
    OUT="$OUT/offload_cost" timeout 400 python benchmarks/offload_cost.py $SMOKE_FLAG --steps "${COST_STEPS:-3}" \
      >"$OUT/offload_cost.log" 2>&1
    grep -E "^\| |^step" "$OUT/offload_cost.log" | cut -c1-240
    ;;
  *) echo "PART must be encounter, offload, split, final or offloadcost"; exit 2 ;;
esac
