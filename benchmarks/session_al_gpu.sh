#!/usr/bin/env bash
# Session AL on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: at the mask's memory the 64k step is the default's kernels, the cap's re-run and ~0.1 s of waiting on
# the host, most of it in the forwards of calls under ~8k tokens (sessions AJ, AK). Session AD ran the whole tree as
# one call with the layer inputs on the host: 3.5% faster than the policy's 16k-token calls then, at 10.08 GiB (under
# the mask's 12.51) but 2.4 GiB above its prediction, so the policy does not pick it. Is it still faster after
# sessions AE-AK, where does its memory go, and what does its step wait on?
#
#   PART=calls  on the 64k tree, interleaved on fresh forests (benchmarks/options_ab.py): memory=12.5 as the policy
#               plans it, with 32k-token calls and with one call (131,072-token budget), the inputs on the host;
#               one profiled step per arm; then benchmarks/profile_memory.py on the one-call plan (where its peak is);
#   PART=predict the memory policy's prediction against the allocator's peak (benchmarks/profile_memory.py) where a
#               step's only call peaks at its bottom layer's backward with the step's gradients (the policy counted
#               none there until this session): the 64k tree in one call with its inputs on the host, the policy's
#               memory=12.5 plan beside it; a 21k tree in one call under caps of 9 and 12.5 GiB and under low; the
#               GPU tests of the memory policy and of the offloaded checkpoints;
#   PART=origins benchmarks/kernel_origins.py on the 64k tree: memory=12.5 as the policy plans it, in one call with
#               the inputs on the host, and the default: what the capped step's kernels spend beyond the default's;
#   PART=probe  benchmarks/probe_peaks.py: the memory probe's per-token figures in three fresh runtimes of one
#               process (the first probe of a process read ~4 KB per token less before it warmed its short call);
#   PART=steps  in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5 (ARM, the
#               runtime options after memory=12.5, default none), low and the default.
#
#     PART=calls bash benchmarks/session_al_gpu.sh            # reports in $OUT (default /tmp/dtree_session_al)
#     SMOKE=1 PART=calls bash benchmarks/session_al_gpu.sh    # tiny trees on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_al}
source benchmarks/bench_cases.sh  # AGENTIC64K, bench, script, memory_profile, SMOKE_FLAG, AT_MASK
ONE=131072 TWO=32768
[ -n "$SMOKE_FLAG" ] && ONE=1024 TWO=256

case "${PART:-calls}" in
  calls)
    script options_ab 360 --workload agentic64k --arm memory=$AT_MASK \
      --arm memory=$AT_MASK,group_tokens=$TWO,offload_checkpoints=true \
      --arm memory=$AT_MASK,group_tokens=$ONE,offload_checkpoints=true --rounds ${ROUNDS:-5} --kernels --tag calls
    memory_profile memory_one_call 200 "dtree:memory=$AT_MASK+group_tokens=$ONE+offload_checkpoints=true" 60
    ;;
  predict)
    gpu_tests gpu_tests_predict.txt 200 "" tests/test_memory_policy.py tests/test_host_checkpoints.py \
      tests/test_runtime_memory.py
    memory_profile predict64k 240 "dtree:memory=$AT_MASK+group_tokens=$ONE+offload_checkpoints=true,dtree:memory=$AT_MASK" 80
    mkdir -p "$OUT/predict21k"
    SMALL="--set num_trees=1 --set target_unique_tokens=21000"
    [ -n "$SMOKE_FLAG" ] && SMALL=${AGENTIC64K#--workload agentic }  # the tiny tree memory_profile runs
    timeout 240 python benchmarks/profile_memory.py --configs "dtree:memory=9,dtree:memory=$AT_MASK,dtree:low" $SMALL \
      --out "$OUT/predict21k" >"$OUT/predict21k.log" 2>&1
    echo "predict21k: exit $?"; grep -E "^\| |^Predicted" "$OUT/predict21k.log" | cut -c1-400
    ;;
  origins)
    script kernel_origins 200 --workload agentic64k --opt memory=$AT_MASK --tag capped --top 40
    mv "$OUT/kernel_origins.log" "$OUT/kernel_origins_capped.log"
    script kernel_origins 200 --workload agentic64k --opt memory=$AT_MASK --opt group_tokens=$ONE \
      --opt offload_checkpoints=true --tag one_call --top 40
    mv "$OUT/kernel_origins.log" "$OUT/kernel_origins_one_call.log"
    script kernel_origins 200 --workload agentic64k --tag default --top 40
    ;;
  probe)
    script probe_peaks 200
    ;;
  steps)
    bench at_mask64k 300 $AGENTIC64K --steps 5 \
      --configs "tree-mask:whole+ckpt,dtree:memory=$AT_MASK${ARM:+$ARM},dtree:low,dtree"
    ;;
  *) echo "PART must be calls, predict, origins, probe or steps"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
