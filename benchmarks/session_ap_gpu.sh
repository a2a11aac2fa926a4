#!/usr/bin/env bash
# Session AP on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The change: a training call whose loss rows fit one LM-head chunk keeps the head's forward logits for its backward
# (token_logprobs(keep_logits=True), asked for by the walk where the call's backward follows its loss at once: leaf
# calls, calls re-run in the backward, the baselines' calls) instead of recomputing them there with a second
# [rows, H] x [H, V] product: the same bits, one 2*rows*H*V-FLOP matmul less (GRPO case 1: 4,096 rows x 151,936 x 1536,
# 1.9 TFLOP, ~2.4 ms of its ~110 ms of kernels).
#
#   PART=check  the GPU tests (pytest -m gpu) of the head op and of whole steps; then benchmarks/options_ab.py on GRPO
#               case 1, head=keep against head=recompute interleaved on 20 fresh forests (each arm's kernels profiled);
#   PART=ab64   the same on the 64k agentic tree (4 forests): the default plan kept / recomputed, and the default plan
#               with 16,384-row head chunks (its calls' rows in one chunk, so kept); then memory=12.5 kept / recomputed;
#   PART=steps  in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the
#               default (bench_cases.sh's vs_mask64k); then GRPO case 1: dtree, tree-mask:whole+ckpt, linearized.
#
# Then where the host walks the model's modules in a step (session AO's profile of case 1 counted 9,616 module visits
# and 339 parameter walks a step, ~6 ms of host time there, before and between kernels):
#
#   PART=walks  benchmarks/module_walks.py on GRPO case 1 and the 64k tree at memory=12.5: every walk's caller.
#
# Then whether the 64k tree's default plan gains from one head chunk per call (its 3 calls have ~22k loss rows each, more
# than PART=ab64's 16,384-row chunks: nothing was kept there):
#
#   PART=chunks the default against logprob_chunk=32768 kept and recomputed, interleaved on 3 fresh forests.
#
#     PART=check bash benchmarks/session_ap_gpu.sh             # reports in $OUT (default /tmp/dtree_session_ap)
#     SMOKE=1 PART=ab64 bash benchmarks/session_ap_gpu.sh      # the tiny model on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ap}
source benchmarks/bench_cases.sh  # script, bench, gpu_tests, ab, vs_mask64k, CASE1, SMOKE_FLAG
TOUCHED="tests/test_logprobs_triton.py tests/test_runtime_gpu.py tests/test_baselines.py tests/test_determinism.py tests/test_lean_layers.py"

case "${PART:-check}" in
  check)
    gpu_tests gpu_tests.txt 300 "" $TOUCHED -rfE
    ab case1 20 case1 head=keep head=recompute
    ;;
  ab64)
    ab agentic64k 4 agentic64k head=keep head=recompute logprob_chunk=16384
    ab agentic64k 3 agentic64k_12.5GiB memory=12.5 memory=12.5,head=recompute
    ;;
  steps)
    vs_mask64k
    bench case1 200 $CASE1 --steps ${CASE1_STEPS:-10} --configs "dtree,tree-mask:whole+ckpt,linearized"
    ;;
  walks)
    script module_walks 200 --workload case1 --steps 3
    cat "$OUT/module_walks.log" | head -40
    OUT="$OUT" timeout 300 python benchmarks/module_walks.py $SMOKE_FLAG --workload agentic64k --opt memory=12.5 \
      --steps 2 >"$OUT/module_walks_64k.log" 2>&1; echo "module_walks 64k: exit $?"
    head -40 "$OUT/module_walks_64k.log"
    ;;
  chunks)
    ab agentic64k 3 agentic64k_chunks head=keep logprob_chunk=32768 logprob_chunk=32768,head=recompute
    ;;
  *) echo "PART must be check, ab64, steps, walks or chunks"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
