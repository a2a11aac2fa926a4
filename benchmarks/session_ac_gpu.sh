#!/usr/bin/env bash
# Session AC on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: `memory="low"` sits on issue 17's 1.2x line on the 64k tree (1.17-1.20x); where does its step
# leave the GPU idle, which code launches its kernels, and where do its kernels' time go against the mask's.
#
#   PART=diag    the 64k tree under low: the GPU's idle time charged to the step's phases (benchmarks/gpu_idle.py),
#                which code launches each kernel (benchmarks/kernel_origins.py), the kernels' time by kind against
#                the mask's (benchmarks/profile_step.py); the same idle profile under memory=12.5 (the mask's memory);
#   PART=final   the GPU tests of kept attention outputs and of the offload (not with SKIP_TESTS=1); low (its attention
#                outputs kept on the host with its layer inputs), low without them and the mask in one process, 6 fresh
#                forests; memory=12.5 and the mask likewise;
#   PART=ab      the same two `low` arms interleaved on fresh forests (benchmarks/options_ab.py: `dtree bench` runs them
#                one after the other, and the first to meet a forest pays its once-per-shape costs); memory=12.5 with
#                the layer inputs (and kept outputs) on the host against the policy's choice;
#   PART=held    the two `low` arms interleaved, the allocator's cache emptied before every step (the peak each holds),
#                then low against the mask (session AC ran it on a variant, since reverted, that allocated the
#                offload's fetch buffers from the side stream's pool);
#   PART=unit    a unit's fetches into one buffer (one block per layer, not per tensor): the held peak again.
#
#     PART=diag bash benchmarks/session_ac_gpu.sh           # reports in $OUT (default /tmp/dtree_session_ac)
#     SMOKE=1 PART=diag bash benchmarks/session_ac_gpu.sh   # CPU, tiny model: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ac}
PART=${PART:-diag}
source benchmarks/bench_cases.sh  # AGENTIC64K, bench, script, gpu_tests, SMOKE_FLAG
AT_MASK=${AT_MASK:-12.5}
[ -n "$SMOKE_FLAG" ] && AT_MASK=4

case "$PART" in
  diag)
    script gpu_idle 200 --workload agentic64k --opt memory=low --tag low
    mv "$OUT/gpu_idle.log" "$OUT/gpu_idle_low.log"
    script kernel_origins 200 --workload agentic64k --opt memory=low --tag low
    script gpu_idle 200 --workload agentic64k --opt memory=$AT_MASK --tag at_mask
    mkdir -p "$OUT/profile"
    timeout 300 python benchmarks/profile_step.py $([ -n "$SMOKE_FLAG" ] && echo "--model tiny") $AGENTIC64K --top 30 \
      --configs "dtree:low,tree-mask:whole+ckpt" --name _64k_low --out "$OUT/profile" >"$OUT/profile.log" 2>&1
    echo "profile_step: exit $?"; tail -4 "$OUT/profile.log" | cut -c1-200
    ;;
  final)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_final.txt 200 "keeping or offload or host or checkpoint" \
      tests/test_output_memo.py tests/test_host_checkpoints.py tests/test_runtime_gpu.py
    bench low64k 420 $AGENTIC64K --steps 6 \
      --configs "dtree:low,dtree:memory=low+keep_attention_outputs=false,tree-mask:whole+ckpt"
    bench at_mask64k 300 $AGENTIC64K --steps 5 --configs "dtree:memory=$AT_MASK,tree-mask:whole+ckpt"
    ;;
  ab)
    script options_ab 300 --workload agentic64k --arm memory=low --arm memory=low,keep_attention_outputs=false \
      --rounds 8 --tag low
    script options_ab 240 --workload agentic64k --arm memory=$AT_MASK --arm memory=$AT_MASK,offload_checkpoints=true \
      --rounds 6 --tag at_mask
    ;;
  held)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_held.txt 200 "keeping or offload or host" \
      tests/test_output_memo.py tests/test_host_checkpoints.py tests/test_runtime_gpu.py
    script options_ab 300 --workload agentic64k --arm memory=low --arm memory=low,keep_attention_outputs=false \
      --rounds 5 --empty-cache --tag held
    bench low64k_held 300 $AGENTIC64K --steps 6 --configs "dtree:low,tree-mask:whole+ckpt"
    ;;
  unit)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests gpu_tests_unit.txt 150 "flash_rule or offload" \
      tests/test_output_memo.py tests/test_runtime_gpu.py
    script options_ab 200 --workload agentic64k --arm memory=low --arm memory=low,keep_attention_outputs=false \
      --rounds 4 --warmup 1 --empty-cache --tag unit
    ;;
  *) echo "PART must be diag, final, ab, held or unit"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
