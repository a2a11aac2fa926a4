#!/usr/bin/env bash
# Session M on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in
# parts so that each fits one device call:
#
#   PART=diag   where the 64k agentic step's GPU waits, before changing anything: the queue's
#               depth at each group (benchmarks/queue_depth.py) for the default, memory=14.5
#               and memory="low", and the synchronizations inside one step; the gaps between
#               kernels of the default step (benchmarks/gpu_gaps.py);
#   PART=tests_old  the GPU tests of what this session changed (the LM head's vocabulary-slice
#               backward and its memory figure, the runtime's bf16 steps against HF per path),
#               then OLD (default .oldm: `git archive <rev> dtree | tar -x -C .oldm`) on the 64k
#               tree: dtree default, memory=14.5 and memory="low";
#   PART=new    this checkout on the same fresh forests, the same three configurations, then
#               tree-mask:whole+ckpt (last, so that dtree's runs follow the same order as OLD's:
#               the old/new pair is the same-host A/B), then GRPO case 1 against the mask;
# (the fuller GPU test set, an alternating A/B and a final run alone are session L's script's
# parts: PART=tests|ab|final bash benchmarks/session_l_gpu.sh)
#
#     PART=diag bash benchmarks/session_m_gpu.sh          # reports in $OUT (default /tmp/dtree_session_m)
#     SMOKE=1 PART=new bash benchmarks/session_m_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_m}
OLD=${OLD:-.oldm}
PART=${PART:-diag}
source benchmarks/bench_cases.sh
CONFIGS64="dtree,dtree:memory=14.5,dtree:low"

case "$PART" in
  diag)
    export OUT
    timeout 120 python benchmarks/queue_depth.py --workload agentic64k --steps 2 $SMOKE_FLAG >/dev/null 2>"$OUT/diag_err.txt"
    timeout 120 python benchmarks/queue_depth.py --workload agentic64k --steps 2 --opt memory=14.5 --tag cap \
      $SMOKE_FLAG >/dev/null 2>>"$OUT/diag_err.txt"
    timeout 120 python benchmarks/queue_depth.py --workload agentic64k --steps 2 --opt memory=low --tag low \
      $SMOKE_FLAG >/dev/null 2>>"$OUT/diag_err.txt"
    timeout 150 python benchmarks/gpu_gaps.py --workload agentic64k --steps 3 $SMOKE_FLAG >/dev/null \
      2>>"$OUT/diag_err.txt"
    tail -3 "$OUT/diag_err.txt"
    ls "$OUT"
    ;;
  tests_old)
    timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_logprobs_triton.py tests/test_runtime_gpu.py \
      2>&1 | tee "$OUT/gpu_tests.txt" | tail -3
    [ -d "$OLD/dtree" ] || { echo "no older checkout at $OLD (git archive <rev> dtree | tar -x -C $OLD)"; exit 2; }
    mkdir -p "$OUT/old"
    (cd "$OLD" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 190 $BENCH $AGENTIC64K --steps $STEPS \
      --configs "$CONFIGS64" --out "$OUT/old" >"$OUT/old.log" 2>&1)
    grep -hE "^\| \`dtree[^|]*\` \| ok \|" "$OUT"/old/*.md | cut -d'|' -f2,6,8,12
    ;;
  new)
    mkdir -p "$OUT/new" "$OUT/case1"
    timeout 260 $BENCH $AGENTIC64K --steps $STEPS --configs "$CONFIGS64,tree-mask:whole+ckpt" \
      --out "$OUT/new" >"$OUT/new.log" 2>&1
    grep -hE "^\| \`(dtree|tree-mask)[^|]*\` \| ok \|" "$OUT"/new/*.md | cut -d'|' -f2,6,8,12
    timeout 90 $BENCH $CASE1 --steps 10 --configs "dtree,tree-mask:whole+ckpt" --out "$OUT/case1" >"$OUT/case1.log" 2>&1
    grep -hE "^\| \`(dtree|tree-mask)[^|]*\` \| ok \|" "$OUT"/case1/*.md | cut -d'|' -f2,6,8,12
    ;;
  *) echo "PART must be diag, tests_old or new"; exit 2 ;;
esac
