#!/usr/bin/env bash
# What a model call costs beyond its tokens with today's defaults (issue 17: at the mask's
# memory the policy checkpoints every layer of 16k-token calls, because small calls were
# measured ~70-110 ms dearer each in session C). The 64k agentic tree under the mask's peak
# (memory=17.6) at fixed call sizes with no layer checkpointed in the calls, against the
# policy's own choice and tree-mask:whole+ckpt; then the same with compiled decoder layers
# (--compile: fewer launches and less Python per call). One device call, ~5 minutes.
#
#     bash benchmarks/call_size_gpu.sh            # reports in $OUT (default /tmp/dtree_calls)
#     PARTS=compiled bash benchmarks/call_size_gpu.sh     # one part only (eager, compiled)
#
# SMOKE=1 runs the same on CPU with the tiny model (plumbing only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_calls}
source benchmarks/bench_cases.sh
CAP=$MASK_GIB
PARTS=${PARTS:-eager compiled}
SMALL="dtree:memory=$CAP+group_tokens=4096+checkpoint_layers=0,dtree:memory=$CAP+group_tokens=8192+checkpoint_layers=0"

if [[ " $PARTS " == *" eager "* ]]; then
echo "== 64k agentic at the mask's memory: the policy's plan, fixed call sizes without checkpointing, the mask"
timeout 290 $BENCH $AGENTIC64K --steps $STEPS --time-budget 270 --tag calls-64k --out "$OUT/eager" \
  --configs "dtree:memory=$CAP,$SMALL,tree-mask:whole+ckpt" 2>&1 | grep -v "^\s*\[" | tail -12

fi
if [[ " $PARTS " == *" compiled "* ]]; then
echo "== the same with compiled decoder layers"
timeout 290 $BENCH $AGENTIC64K --compile --steps $STEPS --time-budget 270 --tag calls-64k-compiled \
  --out "$OUT/compiled" --configs "dtree:memory=$CAP,$SMALL" 2>&1 | grep -v "^\s*\[" | tail -12
fi
