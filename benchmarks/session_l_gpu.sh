#!/usr/bin/env bash
# Session L on one H100 (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# so that each fits one device call:
#
#   PART=tests  the GPU tests of the runtime, the one-call path, checkpointing, kept attention
#               outputs and the memory probe (bf16 steps against HF per path under the
#               flash-attention rule);
#   PART=ab     same-host A/B of an older checkout against this one: OLD (default .oldk, a
#               `git archive` of the older commit's dtree/ and benchmarks/) and this checkout run
#               alternately (OLD, new, new, OLD), each one process of `dtree bench` over the same
#               fresh forests: GRPO case 1 (dtree) and the 64k agentic tree (default,
#               memory=14.5, memory="low");
#   PART=final  this checkout against tree-mask:whole+ckpt: case 1 and the 64k tree (default,
#               the mask, dtree at the mask's memory, memory="low").
#
#     PART=ab bash benchmarks/session_l_gpu.sh      # reports in $OUT (default /tmp/dtree_session_l)
#     SMOKE=1 PART=ab bash benchmarks/session_l_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_l}
OLD=${OLD:-.oldk}
PART=${PART:-tests}
HERE=$PWD
source benchmarks/bench_cases.sh
CONFIGS64="dtree,dtree:memory=14.5,dtree:low"

run_bench() {  # $1: label, $2: source tree; case 1 then the 64k tree
  local out="$OUT/ab/$1"
  mkdir -p "$out/case1" "$out/agentic64k"
  (cd "$2" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 100 $BENCH $CASE1 --steps 10 --configs dtree \
    --out "$out/case1" >"$out/case1.log" 2>&1)
  (cd "$2" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 200 $BENCH $AGENTIC64K --steps $STEPS \
    --configs "$CONFIGS64" --out "$out/agentic64k" >"$out/agentic64k.log" 2>&1)
  echo "-- $1 ($2)"
  grep -hE "^\| \`dtree[^|]*\` \| ok \|" "$out"/case1/*.md "$out"/agentic64k/*.md 2>/dev/null | cut -d'|' -f2,6,8
}

case "$PART" in
  tests)
    timeout 400 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py tests/test_masked_call.py \
      tests/test_checkpointing.py tests/test_output_memo.py tests/test_memory_policy.py tests/test_layer_recompute.py tests/test_transfer.py \
      2>&1 | tee "$OUT/gpu_tests.txt" | tail -4
    ;;
  ab)
    [ -d "$OLD/dtree" ] || { echo "no older checkout at $OLD (git archive <rev> dtree benchmarks | tar -x -C $OLD)"; exit 2; }
    run_bench old_1 "$OLD"
    run_bench new_1 "$HERE"
    run_bench new_2 "$HERE"
    run_bench old_2 "$OLD"
    ;;
  final)
    mkdir -p "$OUT/final/case1" "$OUT/final/agentic64k"
    timeout 110 $BENCH $CASE1 --steps 10 --configs "dtree,tree-mask:whole+ckpt" --out "$OUT/final/case1" >/dev/null 2>&1
    grep -hE "^\| \`(dtree|tree-mask)[^|]*\` \| ok \|" "$OUT"/final/case1/*.md | cut -d'|' -f2,6,8,12
    timeout 330 $BENCH $AGENTIC64K --steps $STEPS --configs "dtree,tree-mask:whole+ckpt,dtree:memory=14.5,dtree:low" \
      --out "$OUT/final/agentic64k" >/dev/null 2>&1
    grep -hE "^\| \`(dtree|tree-mask)[^|]*\` \| ok \|" "$OUT"/final/agentic64k/*.md | cut -d'|' -f2,6,8,12
    ;;
  *) echo "PART must be tests, ab or final"; exit 2 ;;
esac
