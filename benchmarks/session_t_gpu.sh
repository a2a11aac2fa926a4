#!/usr/bin/env bash
# Session T on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# that each fit one device call. The session's subject is gradient accumulation: the micro-batches
# of one optimizer step.
#
#   PART=check   the bf16 GPU tests of the runtime's step (the step's end changed: the next
#                micro-batch planned before its sync, param.grad's guard optional); GRPO case 1 in
#                optimizer steps of 4 micro-batches (benchmarks/micro_batches.py: one forward_backward
#                each, forward_backward_micro_batches, unguarded, the mask), and the code before the
#                change (.oldm/: git archive <rev> dtree | tar -x -C .oldm) one forward_backward each;
#   PART=memory  the 64k agentic tree, 2 micro-batches per optimizer step under memory=14.5: what the
#                plan predicted against the peak, with and without the guard, this code and .oldm's;
#                then `dtree bench --accumulate` on the 64k tree (memory=14.5 and low, each with and
#                without the guard, against tree-mask:whole+ckpt accumulating in place);
#   PART=final   the usual comparisons, one step at a time (gradients cleared before each): the 64k tree
#                (default, memory=14.5, memory="low", tree-mask:whole+ckpt) and GRPO case 1 against the
#                mask, with this session's step (the plan's gradient accounting, the step's end);
#   PART=attn    the stack attention kernels against flash-attn-4's own kernel on the same dense
#                batch (bench_stack_attention.py's `fa4 dense`, qwen2.5-1.5b's 12/2 heads): the
#                backward/forward ratio a FlashAttention-class kernel reaches without a tree.
#
#     PART=check bash benchmarks/session_t_gpu.sh             # reports in $OUT (default /tmp/dtree_session_t)
#     SMOKE=1 PART=memory bash benchmarks/session_t_gpu.sh    # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_t}
PART=${PART:-check}
source benchmarks/bench_cases.sh
CAP=14.5 ATTN="--heads 12 --kv-heads 2 --layouts grpo,agentic" IMPLS="flash-attn,fa4 gathered"
if [ "${SMOKE:-0}" = 1 ]; then
  CAP=4 ATTN="--layouts grpo" IMPLS="triton fused"
fi

case "$PART" in
  check)
    if [ -z "$SMOKE_FLAG" ]; then
      timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.txt" | tail -1
    fi
    micro case1_micro 240 --workload case1 --micro-batches 4 --steps "${CASE1_STEPS:-4}"
    if [ -d .oldm/dtree ]; then
      micro case1_before 120 --workload case1 --micro-batches 4 --steps 2 --ways loop --dtree-src .oldm
    fi
    ;;
  memory)
    micro agentic64k_micro 300 --workload agentic64k --micro-batches 2 --steps 2 --opt "memory=$CAP"
    if [ -d .oldm/dtree ]; then
      micro agentic64k_before 150 --workload agentic64k --micro-batches 2 --steps 1 --ways loop \
        --opt "memory=$CAP" --dtree-src .oldm
    fi
    bench accumulate64k 300 $AGENTIC64K --steps "${STEPS}" --accumulate --configs \
      "dtree:memory=$CAP,dtree:memory=$CAP+grad_guard=False,dtree:low,dtree:low+grad_guard=False,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  final)
    bench final64k 300 $AGENTIC64K --steps "${STEPS}" --configs "dtree,dtree:memory=$CAP,dtree:low,tree-mask:whole+ckpt"
    bench case1 150 $CASE1 --steps "${CASE1_STEPS:-8}" --configs "dtree,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  attn)
    timeout 400 python benchmarks/bench_stack_attention.py $SMOKE_FLAG $ATTN --impls "$IMPLS" \
      --option-cases "" --out "$OUT" >"$OUT/attn.log" 2>&1
    grep -E "^\|" "$OUT"/stack_attention_*.md 2>/dev/null | head -30
    ;;
  *) echo "PART must be check, memory, final or attn"; exit 2 ;;
esac
