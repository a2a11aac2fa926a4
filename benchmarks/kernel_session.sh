#!/usr/bin/env bash
# GPU session for the stack-attention kernels (issue 17 sections 1-2, issue 21's
# deterministic backward), one device command per call (each within ~8 minutes):
#
#   bash benchmarks/kernel_session.sh PART[:SECONDS] [PART[:SECONDS] ...]
#
# flash-attn-4 comes from the wheels of ../shared/tools/fa4_wheels.sh (two calls in a
# row: `bash .fa4a/install.sh`, then `bash .fa4b/install.sh && export PYTHONPATH=... &&
# bash benchmarks/kernel_session.sh ...`); parts that need it say so when it is absent.
# Every part runs under `timeout` (default seconds below), writes its reports under
# $OUT/ and its output to $OUT/session.log; the reports are rewritten as they go, so a
# part cut short keeps what it measured. Parts:
#
#   env          GPU, driver, versions, flash-attn-4 import time                    ~10 s
#   bench        bench_stack_attention.py, grpo + agentic, 32/8 and 12/2 heads:
#                triton (atomic, deterministic), flash-attn regions (both),
#                fa4 gathered, sdpa dense; errors, bitwise repeat, TFLOP/s         ~2-4 min
#   tests-fa4    pytest -m gpu tests/test_stack_attention_regions.py              ~1-2 min
#   tests        pytest -m gpu tests/test_stack_attention_triton.py and
#                tests/test_stack_attention_regions.py                            ~3-4 min
#   layouts      bench_stack_attention.py, grpo_long, chain, many_small + options ~2 min
#   tuning       bench_triton_tuning.py (configs, prefix_item_rows)               ~2-3 min
#   linearized   bench_flash_backend.py (flash-attn-4 varlen for the baseline)    ~1 min
#   host         profile_attention_host.py (host time per forward+backward)       ~1 min
#   step         dtree bench, one 64k-unique agentic tree, qwen2.5-1.5b: the triton
#                and flash-attn backends in a whole training step                 ~2 min
# IMPLS / LAYOUTS: the implementations and layouts of `bench` (default: all; grpo,agentic).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${HOME:-/tmp}/fa4-jit-cache
OUT=${OUT:-/tmp/dtree_kernel_out}
mkdir -p "$OUT"
LOG=$OUT/session.log

part() {
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$secs" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}

run_part() {
  local spec=$1 name=${1%%:*} secs=""
  [[ $spec == *:* ]] && secs=${spec#*:}
  case $name in
    env)
      part env "${secs:-60}" bash -c 'nvidia-smi; python -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)";
        python -c "import time; t=time.time(); import flash_attn.cute.interface as i; print(\"flash-attn-4 import\", round(time.time()-t, 1), \"s\")" || true;
        pip list 2>/dev/null | grep -i -E "flash|cutlass|quack|tvm|torch|triton"' ;;
    bench)
      part bench-32x8 "${secs:-200}" python benchmarks/bench_stack_attention.py --layouts "${LAYOUTS:-grpo,agentic}" \
        --option-cases "" --impls "${IMPLS:-}" --tag 32x8 --out "$OUT"
      part bench-12x2 "${secs:-150}" python benchmarks/bench_stack_attention.py --layouts "${LAYOUTS:-grpo,agentic}" \
        --option-cases "" --impls "${IMPLS:-}" --heads 12 --kv-heads 2 --tag 12x2 --out "$OUT" ;;
    tests-fa4)
      part tests-fa4 "${secs:-150}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_stack_attention_regions.py ;;
    tests)
      part tests "${secs:-300}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_stack_attention_triton.py \
        tests/test_stack_attention_regions.py ;;
    layouts)
      part layouts "${secs:-150}" python benchmarks/bench_stack_attention.py --layouts grpo_long,chain,many_small \
        --impls "triton,triton det,flash-attn" --tag layouts --out "$OUT" ;;
    tuning)
      part tuning "${secs:-200}" python benchmarks/bench_triton_tuning.py --head-configs 12/2,32/8 --out "$OUT" ;;
    step)
      part step "${secs:-150}" python -m dtree bench --model qwen2.5-1.5b --workload agentic --set num_trees=1 \
        --set target_unique_tokens=65536 --configs "dtree,dtree:attention=flash-attn" --steps 4 --warmup 1 \
        --time-budget $(( ${secs:-150} - 30 )) --out "$OUT" --tag kernel ;;
    host)
      part host "${secs:-90}" python benchmarks/profile_attention_host.py --impls "${IMPLS:-triton,triton det,flash-attn,flash-attn det}" \
        --out "$OUT" ;;
    linearized)
      part linearized "${secs:-90}" python benchmarks/bench_flash_backend.py --out "$OUT" ;;
    *) echo "unknown part $name" | tee -a "$LOG" ;;
  esac
}

for spec in "$@"; do run_part "$spec"; done
grep -h -E "passed|failed|error" "$LOG" | tail -5
ls -la "$OUT"
