#!/usr/bin/env bash
# Session U on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in parts
# that each fit one device call. The session's subject is the guard of param.grad while
# accumulating: under a memory cap the old gradients can wait in pinned host memory
# (grad_guard="host", dtree.engine.grad_guard.GradHostCopy) instead of a second copy on the device.
#
#   PART=check       the bf16 GPU tests of the runtime (with the host guard's: its copy waited for
#                    before the first write, a failed step restored, no device copy at the peak); the
#                    64k agentic tree, 2 micro-batches per optimizer step under memory=14.5
#                    (benchmarks/micro_batches.py): the default guard (the plan picks the place), the
#                    device copy, unguarded (SKIP_TESTS=1: the table only);
#   PART=diag        what the host guard costs (benchmarks/host_guard_cost.py: pinning, its copies'
#                    GB/s, alone and beside matmuls; on the 64k micro-batches, the guard against its
#                    parts and against no guard);
#   PART=recheck     session T's micro-batch gains again, with the ways' order rotating each round
#                    (session T's runs put `loop` first in every round, where it met each round's fresh
#                    forests first): GRPO case 1 (4 micro-batches) and the 64k tree under memory=14.5
#                    (2 micro-batches), one forward_backward each against forward_backward_micro_batches;
#   PART=accumulate  `dtree bench --accumulate` on the 64k tree: memory=14.5 and low with the default
#                    guard, the device copy and unguarded, against tree-mask:whole+ckpt accumulating
#                    in place.
#
#     PART=check bash benchmarks/session_u_gpu.sh             # reports in $OUT (default /tmp/dtree_session_u)
#     SMOKE=1 PART=accumulate bash benchmarks/session_u_gpu.sh    # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_u}
PART=${PART:-check}
source benchmarks/bench_cases.sh  # CAP: 14.5 GiB, the mask's peak on the 64k tree (4 with SMOKE=1)

case "$PART" in
  check)
    if [ -z "$SMOKE_FLAG" ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
      timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.txt" | tail -3
    fi
    micro agentic64k_micro 330 --workload agentic64k --micro-batches 2 --steps 2 --opt "memory=$CAP" \
      --ways "micro,micro device copy,micro unguarded"
    ;;
  diag)
    mkdir -p "$OUT/host_guard"
    OUT="$OUT/host_guard" timeout 500 python benchmarks/host_guard_cost.py $SMOKE_FLAG --step "${GUARD_STEPS:-3}" \
      >"$OUT/host_guard.log" 2>&1
    grep -E "^\|" "$OUT/host_guard.log"
    ;;
  recheck)
    micro case1_rotated 200 --workload case1 --micro-batches 4 --steps "${CASE1_STEPS:-4}" --ways "loop,micro"
    micro agentic64k_rotated 260 --workload agentic64k --micro-batches 2 --steps "${AGENTIC_STEPS:-4}" \
      --opt "memory=$CAP" --ways "loop,micro"
    ;;
  accumulate)
    bench accumulate64k 560 $AGENTIC64K --steps "${STEPS}" --accumulate --configs \
      "dtree:memory=$CAP,dtree:memory=$CAP+grad_guard=device,dtree:memory=$CAP+grad_guard=False,dtree:low,dtree:low+grad_guard=device,dtree:low+grad_guard=False,tree-mask:whole+ckpt"
    rm -f "$OUT"/*/*.png
    ;;
  *) echo "PART must be check, diag, recheck or accumulate"; exit 2 ;;
esac
