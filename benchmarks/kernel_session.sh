#!/usr/bin/env bash
# GPU session for the stack-attention kernels (issue 17 sections 1-2, issue 21's
# deterministic backward), one device command per call (each within ~8 minutes):
#
#   bash benchmarks/kernel_session.sh PART[:SECONDS] [PART[:SECONDS] ...]
#   bash benchmarks/kernel_session.sh env tests bench step      # kernel session 4, ~6-7 min on an H100
#
# flash-attn-4 comes from the wheels of ../shared/tools/fa4_wheels.sh (two calls in a
# row: `bash .fa4a/install.sh`, then `bash .fa4b/install.sh && export PYTHONPATH=... &&
# bash benchmarks/kernel_session.sh ...`); without it every part still runs: the
# flash-attn rows, tests and step configuration say why they are absent.
# Every part runs under `timeout` (default seconds below), writes its reports under
# $OUT/ and its output to $OUT/session.log; the reports are rewritten as they go, so a
# part cut short keeps what it measured. Parts:
#
#   env          GPU, driver, versions, flash-attn-4 import time, the Triton default
#                backward and the "auto" rule                                      ~10 s
#   tests        pytest -m gpu: the Triton kernel's fused and split backward by the
#                flash rule (stack dK/dV included), options, deterministic bitwise
#                repeats; flash-attn regions (GQA 6, deterministic GQA 4, in-call
#                ancestors, the replay of recorded kernels)                        ~2.5 min
#   bench        bench_stack_attention.py, grpo + agentic, 32/8 and 12/2 heads:
#                triton fused / split / det, flash-attn regions (both),
#                fa4 gathered, sdpa dense; errors, bitwise repeat, TFLOP/s         ~2 min
#   step         dtree bench, one 64k-unique agentic tree, qwen2.5-1.5b, 4 fresh
#                forests: the default (triton) and flash-attn backends            ~1.5 min
#   tests-all    every GPU test of both backends' files                          ~5 min
#   layouts      bench_stack_attention.py, grpo_long, chain, many_small + options ~2 min
#   tuning       bench_triton_tuning.py (configs incl. the fused kernel's)        ~2-3 min
#   linearized   bench_flash_backend.py (flash-attn-4 varlen for the baseline)    ~1 min
#   host         profile_attention_host.py (host time per forward+backward)       ~1 min
#   keys         flash4_compile_keys.py: flash-attn-4 compile keys over 6 fresh forests
#                per workload, from the plans (CPU)                               ~10 s
# IMPLS / LAYOUTS: the implementations and layouts of `bench` (default: all; grpo,agentic).
# SMOKE=1: the same parts on the CPU (interpreter, tiny model, the CPU tests of the new
# code instead of the GPU ones): checks the plumbing.
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

SMOKE=${SMOKE:-0}
HAS_FA4=0
python -c "import flash_attn.cute.interface" >/dev/null 2>&1 && HAS_FA4=1
# the GPU tests of session 4: both Triton backwards by the flash rule and with every
# option at once; flash-attn-4 at the step's heads (GQA 6), deterministic, replayed
TESTS_K='test_gpu_flash_rule or (test_gpu_options_flash_rule and all) or deterministic or replays
  or in_call_ancestors or (test_gpu_flash_attn_flash_rule and (gqa6 or deterministic)) or merge'
STEP_TREE="--workload agentic --set num_trees=1 --set target_unique_tokens=65536"
STEP_MODEL="--model qwen2.5-1.5b"
if [ "$SMOKE" = 1 ]; then
  STEP_TREE="--workload agentic --set num_trees=1 --set system_prompt_len=64 --set trajectories=2 --set turn_len=4,40
    --set turn_len_median=12 --set target_unique_tokens=400"
  STEP_MODEL="--model tiny --device cpu"
fi

run_part() {
  local spec=$1 name=${1%%:*} secs=""
  [[ $spec == *:* ]] && secs=${spec#*:}
  case $name in
    env)
      part env "${secs:-60}" bash -c '(nvidia-smi || echo "no nvidia-smi");
        python -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)";
        python -c "import time; t=time.time(); import flash_attn.cute.interface as i; print(\"flash-attn-4 import\", round(time.time()-t, 1), \"s\")" || echo "flash-attn-4 absent: its rows, tests and step configuration are skipped";
        python -c "from dtree.ops.stack_attention import triton_autograd as s, interface as i; print(\"DEFAULT_BACKWARD\", s.DEFAULT_BACKWARD, \"PREFERS_FLASH_ATTN\", i.PREFERS_FLASH_ATTN)";
        pip list 2>/dev/null | grep -i -E "flash|cutlass|quack|tvm|torch|triton"' ;;
    tests)
      if [ "$SMOKE" = 1 ]; then
        part tests "${secs:-300}" python -m pytest -q -p no:cacheprovider tests/test_flash4_replay.py \
          tests/test_kernel_specialization.py
      else
        part tests "${secs:-170}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_stack_attention_triton.py \
          tests/test_stack_attention_regions.py -k "$(echo $TESTS_K)"
      fi ;;
    tests-all)
      part tests-all "${secs:-360}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_stack_attention_triton.py \
        tests/test_stack_attention_regions.py ;;
    bench)
      local smoke=""
      [ "$SMOKE" = 1 ] && smoke="--smoke"
      part bench-32x8 "${secs:-110}" python benchmarks/bench_stack_attention.py $smoke --layouts "${LAYOUTS:-grpo,agentic}" \
        --option-cases "" --impls "${IMPLS:-}" --tag 32x8 --out "$OUT"
      part bench-12x2 "${secs:-100}" python benchmarks/bench_stack_attention.py $smoke --layouts "${LAYOUTS:-grpo,agentic}" \
        --option-cases "" --impls "${IMPLS:-}" --heads 12 --kv-heads 2 --tag 12x2 --out "$OUT" ;;
    step)
      local configs="dtree"
      if [ "$HAS_FA4" = 1 ]; then configs="dtree,dtree:attention=flash-attn"
      else echo "step: flash-attn-4 absent, the flash-attn configuration is skipped" | tee -a "$LOG"; fi
      part step "${secs:-150}" python -m dtree bench $STEP_MODEL $STEP_TREE --configs "$configs" --steps 4 \
        --time-budget $(( ${secs:-150} - 30 )) --out "$OUT" --tag kernel ;;
    layouts)
      part layouts "${secs:-150}" python benchmarks/bench_stack_attention.py --layouts grpo_long,chain,many_small \
        --impls "triton fused,triton split,triton det,flash-attn" --tag layouts --out "$OUT" ;;
    tuning)
      part tuning "${secs:-200}" python benchmarks/bench_triton_tuning.py --head-configs 12/2,32/8 --out "$OUT" ;;
    host)
      part host "${secs:-90}" python benchmarks/profile_attention_host.py \
        --impls "${IMPLS:-triton fused,triton split,flash-attn,flash-attn det}" --out "$OUT" ;;
    linearized)
      part linearized "${secs:-90}" python benchmarks/bench_flash_backend.py --out "$OUT" ;;
    keys)
      part keys "${secs:-60}" python benchmarks/flash4_compile_keys.py --out "$OUT" ;;
    *) echo "unknown part $name" | tee -a "$LOG" ;;
  esac
}

for spec in "$@"; do run_part "$spec"; done
grep -h -E "^=== .* rc=|^[0-9]+ (passed|failed)|^(FAILED|ERROR) " "$LOG" | tail -20
ls -la "$OUT"
