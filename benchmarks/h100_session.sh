#!/usr/bin/env bash
# GPU session for issue 11 (fast and lean by default) and issue 10 part 5 (memory
# scaling), one part per device command (each must end within 10 minutes):
#
#   bash benchmarks/h100_session.sh PART [PART ...]
#
# Every part runs under `timeout`, writes its reports under $OUT/results/PART/, appends
# its Markdown reports to $OUT/summary.md and its output to $OUT/session.log; at the end
# the reports are bundled into $OUT/results.tgz (the device tool returns at most 8
# files, 2 folders deep). Parts and their expected time on an H100 (eager layers,
# qwen2.5-1.5b, bf16):
#
#   env              versions, GPU                                            ~10 s
#   tests            pytest -m gpu (fixed Triton configs)                     ~3-5 min
#   tests-mem        the GPU tests of the memory/fused-kernel work only, and its
#                    checkpointing/policy CPU tests on this transformers       ~2-3 min
#   issue11          everything issue 11 needs, in one command:               ~7-8.5 min
#                      i11-agentic64k, i11-case1, i11-low21k, i11-fused (below, each on its own too)
#   i11-agentic64k   64k agentic tree, 5 fresh forests: dtree, dtree:low,
#                    tree-mask whole+ckpt, tree-mask split16k                 ~2.5-3 min
#   i11-case1        grpo case 1, 5 steps: dtree, dtree:low, tree-mask whole+ckpt /
#                    split16k, linearized plain / ckpt (the ideal-speedup ratio) ~1.5 min
#   i11-low21k       profile_memory on the 21k agentic tree: dtree:low, dtree ~1-1.5 min
#   i11-fused        --fused (Liger layers): 64k (dtree, dtree:low, tree-mask whole+ckpt, 4 steps)
#                    and case 1 (dtree, tree-mask split16k, linearized, 5 steps) ~2-2.5 min
#   grpo-default     default grpo workload, 3 fresh forests: dtree, tree-mask whole+ckpt /
#                    split16k, linearized (each best form that fits)         ~5 min
#   i13-7b           qwen2.5-7b, one agentic tree of ~32k unique tokens, dtree eager and
#                    with --fused (Liger layers): MFU                          ~3-4 min
#   bench-case1      dtree bench, grpo case 1 (prompt 2048, G=8, answers 512) ~2-3 min
#   bench-agentic64k dtree bench, one agentic tree of ~64k unique tokens       ~7-9 min
#   bench-agentic    dtree bench, default agentic (4 trees, ~66k unique)       ~6-8 min
#   bench-grpo       dtree bench, default grpo (8 prompts, 120k-210k unique)   ~7-9 min
#   warmup           benchmarks/profile_warmup.py (fresh processes, 5 steps)   ~5 min
#   memory           benchmarks/profile_memory.py (21k-unique agentic tree)    ~2-3 min
#   memscale         benchmarks/bench_memory_scaling.py (both sweeps)          ~8 min
#   kernel           benchmarks/bench_stack_attention.py                       ~2 min
#
# Issue 17 (lean path-bounded memory, lean layers, fair kernels), two device commands:
#
#   i17a             (~4.7 min, at most 5.5) i17-tests, i17-64k, i17-case1, i17-7b, i17-between
#   i17b             (~4.7 min, at most 5.5) i17-128k, i17-256k, i17-calls
#   i17-tests        pytest -m gpu: lean RMSNorm/SwiGLU, stack glue, lean layers end to
#                    end, the runtime with the probe and free_after_step      ~1 min
#   i17-64k          64k agentic, 4 fresh forests: dtree, dtree:low, tree-mask:whole+ckpt,
#                    dtree:memory=17.6 (at the mask's peak: the memory-accuracy check) ~1.6 min
#   i17-case1        grpo case 1, 5 steps: dtree, dtree:low, tree-mask whole+ckpt / split16k,
#                    linearized (its default backend: flash-attn when importable) ~45 s
#   i17-7b           qwen2.5-7b, one ~32k agentic tree, dtree default: MFU    ~50 s
#   i17-between      benchmarks/between_steps.py: a training loop on fresh 16k-41k trees,
#                    free_after_step on and off: what stays between steps     ~45 s
#   i17-128k         128k agentic, 3 fresh forests: dtree, tree-mask:whole+ckpt, dtree:low ~1.6 min
#   i17-256k         256k agentic, 3 fresh forests: the same                  ~3 min
#   i17-calls        64k agentic, 3 forests: 4,096- and 8,192-token calls without checkpointing
#                    (the per-call cost the policy assumes)                   ~35 s
#
# Every i17 bench runs `--layers auto` (the default): every method gets the same decoder
# layers (dtree's lean RMSNorm/SwiGLU, Liger's rotary when installed), named in the report.
#
# The bench parts run a fresh forest every step (--steps), every configuration in one
# process; a time budget cuts the last configurations cleanly (reported as skipped), and
# the reports are rewritten after every configuration, so even a killed run leaves them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/dtree_out}
RES=$OUT/results
mkdir -p "$RES"
LOG=$OUT/session.log
SUMMARY=$OUT/summary.md

# Configurations (dtree bench --configs): dtree's default and recompute mode against the
# strongest forms of the baselines. linearized:ckpt only where the run has time for it
# (its steps are the slowest, and plain linearized fits in 16k micro-batches anyway).
CONFIGS_FULL="dtree,dtree:recompute,tree-mask:whole+ckpt,tree-mask:split16k,tree-mask:split16k+ckpt,linearized,linearized:ckpt"
CONFIGS_BIG="dtree,dtree:recompute,tree-mask:whole+ckpt,tree-mask:split16k,tree-mask:split16k+ckpt,linearized"
BENCH="python -m dtree bench --model qwen2.5-1.5b"
CASE1="--workload grpo --set num_prompts=1 --set prompt_len=2048 --set group_size=8 --set answer_len=512"
AGENTIC64K="--workload agentic --set num_trees=1 --set target_unique_tokens=65536"
AGENTIC="--workload agentic"
GRPO="--workload grpo"
AGENTIC21K="--set num_trees=1 --set target_unique_tokens=21000"
WARMUP="" MEMORY="" MEMSCALE=""
MODEL7B=qwen2.5-7b T7B=32768 T128K=131072 T256K=262144 SCALE=1
BETWEEN="--steps 6"
# SMOKE=1: the same parts on CPU with the tiny model and small shapes (checks the plumbing)
if [ "${SMOKE:-0}" = 1 ]; then
  SMALL_TREE="--set num_trees=1 --set system_prompt_len=64 --set trajectories=2 --set turn_len=4,40 --set turn_len_median=12"
  BENCH="python -m dtree bench --model tiny --device cpu"
  CASE1="--workload grpo --set num_prompts=1 --set prompt_len=64 --set group_size=4 --set answer_len=16"
  AGENTIC64K="--workload agentic $SMALL_TREE --set target_unique_tokens=400"
  AGENTIC="--workload agentic --set num_trees=2 --set system_prompt_len=64 --set trajectories=2,3 --set turn_len=4,40"
  GRPO="--workload grpo --set num_prompts=2 --set prompt_len=32,64 --set group_size=2,4 --set answer_len=8,16"
  WARMUP="--model tiny --device cpu --configs dtree,tree-mask --steps 2 $SMALL_TREE --set target_unique_tokens=300"
  MEMORY="--model tiny --device cpu --configs dtree:recompute,dtree $SMALL_TREE --set target_unique_tokens=300"
  AGENTIC21K="--model tiny --device cpu $SMALL_TREE --set target_unique_tokens=300"
  MEMSCALE="--model tiny --device cpu --branches 2,3 --prompt-len 32 --answer-len 8 --tree-sizes 200,300 \
    --set-tree system_prompt_len=64 --set-tree turn_len=4,24"
  MODEL7B=tiny T7B=400 T128K=500 T256K=600 SCALE=6  # a shared CPU is far slower than the GPU
  BETWEEN="--device cpu --steps 2 --min-tokens 200 --max-tokens 300 --set system_prompt_len=64 --set trajectories=2 \
    --set turn_len=4,24 --set turn_len_median=12"
fi

part() {
  local name=$1 secs=$2 dir=$RES/$1
  mkdir -p "$dir"
  echo "=== $name (limit ${secs}s) $(date +%T)"
  local t0=$SECONDS rc
  case $name in
    env)
      { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || echo "no nvidia-smi"; } \
        | tee "$dir/env.txt"
      python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" | tee -a "$dir/env.txt"
      ;;
    tests)
      local to=""
      python -c "import pytest_timeout" 2>/dev/null && to="--timeout 240"
      timeout "$secs" python -m pytest -m gpu -q -p no:cacheprovider -rfE $to tests \
        2>&1 | tee "$dir/pytest.txt"
      ;;
    tests-mem)
      local to=""
      python -c "import pytest_timeout" 2>/dev/null && to="--timeout 200"
      timeout "$secs" python -m pytest -m gpu -q -p no:cacheprovider -rfE $to tests/test_runtime_gpu.py \
        tests/test_logprobs_triton.py tests/test_checkpointing.py tests/test_late_changes.py tests/test_fused.py \
        tests/test_baselines.py 2>&1 | tee "$dir/pytest.txt"
      # the CPU tests of HF/dtree layer checkpointing and the policy, on this machine's transformers
      timeout 120 python -m pytest -q -p no:cacheprovider -rfE tests/test_checkpoint_layers.py \
        tests/test_memory_policy.py tests/test_kernel_specialization.py 2>&1 | tail -n 15 | tee -a "$dir/pytest.txt"
      ;;
    i11-agentic64k)
      timeout "$secs" $BENCH $AGENTIC64K --steps 5 --configs dtree,dtree:low,tree-mask:whole+ckpt,tree-mask:split16k \
        --max-config-seconds 60 --time-budget $((secs - 30)) --tag i11-64k --out "$dir" ;;
    i11-case1)
      timeout "$secs" $BENCH $CASE1 --steps 5 \
        --configs dtree,dtree:low,tree-mask:whole+ckpt,tree-mask:split16k,linearized,linearized:ckpt \
        --time-budget $((secs - 20)) --tag i11-case1 --out "$dir" ;;
    i11-low21k)
      timeout "$secs" python benchmarks/profile_memory.py ${AGENTIC21K} --configs dtree:low,dtree \
        --time-budget $((secs - 40)) --out "$dir" ;;
    i11-fused)
      if [ "${SMOKE:-0}" = 1 ]; then
        echo "SMOKE: --fused needs a GPU (Liger's kernels are Triton); skipped"
      elif ! python -c "import liger_kernel" 2>/dev/null; then
        echo "liger-kernel is not installed: pip install liger-kernel (or 'dtree[fused]'); skipping --fused"; false
      else
        local half=$((secs / 2))
        timeout "$((half + 20))" $BENCH $AGENTIC64K --fused --steps 4 --configs dtree,dtree:low,tree-mask:whole+ckpt \
          --max-config-seconds 45 --time-budget $((half - 10)) --tag i11-64k-fused --out "$dir"
        timeout "$((secs - half - 25))" $BENCH $CASE1 --fused --steps 5 --configs dtree,tree-mask:split16k,linearized \
          --time-budget $((secs - half - 45)) --tag i11-case1-fused --out "$dir"
      fi ;;
    issue11)
      # the four i11 parts in one device command (<= 9 minutes), each time-bounded
      local started=$SECONDS
      part i11-agentic64k 180
      part i11-case1 105
      part i11-low21k 80
      part i11-fused $((secs - (SECONDS - started) - 10))
      ;;
    grpo-default)
      timeout "$secs" $BENCH $GRPO --steps 3 --configs dtree,tree-mask:whole+ckpt,tree-mask:split16k,linearized \
        --max-config-seconds 75 --time-budget $((secs - 30)) --tag grpo-default --out "$dir" ;;
    i13-7b)
      local half=$((secs / 2)) model=qwen2.5-7b t7b=32768
      [ "${SMOKE:-0}" = 1 ] && model=tiny t7b=400
      timeout "$half" ${BENCH/qwen2.5-1.5b/$model} $AGENTIC64K --set target_unique_tokens=$t7b --steps 4 \
        --configs dtree --time-budget $((half - 20)) --tag i13-7b-eager --out "$dir"
      if python -c "import liger_kernel" 2>/dev/null && [ "${SMOKE:-0}" != 1 ]; then
        timeout "$((secs - half))" ${BENCH/qwen2.5-1.5b/$model} $AGENTIC64K --set target_unique_tokens=$t7b --fused \
          --steps 4 --configs dtree --time-budget $((secs - half - 20)) --tag i13-7b-fused --out "$dir"
      else
        echo "liger-kernel is not installed (or SMOKE): the --fused half is skipped"
      fi ;;
    bench-case1)
      timeout "$secs" $BENCH $CASE1 --steps 6 --configs "$CONFIGS_FULL" --time-budget $((secs - 40)) \
        --tag case1 --out "$dir" ;;
    bench-agentic64k)
      timeout "$secs" $BENCH $AGENTIC64K --steps 6 \
        --configs "$CONFIGS_BIG" --max-config-seconds 90 --time-budget $((secs - 40)) --tag 64k --out "$dir" ;;
    bench-agentic)
      timeout "$secs" $BENCH $AGENTIC --steps 6 --configs "$CONFIGS_FULL" --max-config-seconds 80 \
        --time-budget $((secs - 40)) --out "$dir" ;;
    bench-grpo)
      timeout "$secs" $BENCH $GRPO --steps 4 --configs "$CONFIGS_FULL" --max-config-seconds 70 \
        --time-budget $((secs - 40)) --out "$dir" ;;
    warmup)
      timeout "$secs" python benchmarks/profile_warmup.py $WARMUP --time-budget $((secs - 30)) --out "$dir" ;;
    memory)
      timeout "$secs" python benchmarks/profile_memory.py $MEMORY --time-budget $((secs - 60)) --out "$dir" ;;
    memscale)
      timeout "$secs" python benchmarks/bench_memory_scaling.py $MEMSCALE --time-budget $((secs - 90)) --out "$dir" ;;
    kernel)
      timeout "$secs" python benchmarks/bench_stack_attention.py --out "$dir" ;;
    i17-tests)
      local to=""
      python -c "import pytest_timeout" 2>/dev/null && to="--timeout 120"
      timeout "$secs" python -m pytest -m gpu -q -p no:cacheprovider -rfE $to tests/test_rms_norm.py \
        tests/test_swiglu.py tests/test_stack_ops_triton.py tests/test_stack_ops.py tests/test_lean_layers.py \
        tests/test_runtime_gpu.py 2>&1 | tee "$dir/pytest.txt"
      ;;
    i17-64k)
      timeout "$secs" $BENCH $AGENTIC64K --steps 4 --configs dtree,dtree:group_tokens=4096,dtree:low,tree-mask:whole+ckpt,dtree:memory=17.6 \
        --time-budget $((secs - 20)) --tag i17-64k --out "$dir" ;;
    i17-case1)
      timeout "$secs" $BENCH $CASE1 --steps 5 \
        --configs dtree,dtree:low,tree-mask:whole+ckpt,tree-mask:split16k,linearized \
        --time-budget $((secs - 15)) --tag i17-case1 --out "$dir" ;;
    i17-7b)
      timeout "$secs" ${BENCH/qwen2.5-1.5b/$MODEL7B} $AGENTIC64K --set target_unique_tokens=$T7B --steps 3 \
        --configs dtree --time-budget $((secs - 15)) --tag i17-7b --out "$dir" ;;
    i17-between)
      timeout "$secs" python benchmarks/between_steps.py $BETWEEN --out "$dir" ;;
    i17-128k)
      timeout "$secs" $BENCH $AGENTIC64K --set target_unique_tokens=$T128K --steps 3 \
        --configs dtree,tree-mask:whole+ckpt,dtree:low --time-budget $((secs - 20)) --tag i17-128k --out "$dir" ;;
    i17-256k)
      timeout "$secs" $BENCH $AGENTIC64K --set target_unique_tokens=$T256K --steps 3 \
        --configs dtree,tree-mask:whole+ckpt,dtree:low --time-budget $((secs - 20)) --tag i17-256k --out "$dir" ;;
    i17-calls)
      timeout "$secs" $BENCH $AGENTIC64K --steps 3 \
        --configs dtree:group_tokens=4096+checkpoint_layers=0,dtree:group_tokens=8192+checkpoint_layers=0 \
        --time-budget $((secs - 15)) --tag i17-calls --out "$dir" ;;
    i17a)
      # one device command (<= 9.5 minutes), each part time-bounded
      local started=$SECONDS
      part i17-tests $((60 * SCALE))
      part i17-64k $((100 * SCALE))
      part i17-case1 $((50 * SCALE))
      part i17-7b $((55 * SCALE))
      part i17-between $((secs * SCALE - (SECONDS - started) - 5))
      ;;
    i17b)
      local started=$SECONDS
      part i17-128k $((100 * SCALE))
      part i17-256k $((185 * SCALE))
      part i17-calls $((secs * SCALE - (SECONDS - started) - 5))
      ;;
    *) echo "unknown part $name (see the header of $0)"; false ;;
  esac
  rc=$?
  echo "=== $name done in $((SECONDS - t0))s, rc=$rc"
  {
    echo "## $name: rc=$rc, $((SECONDS - t0)) s"
    echo
    for md in "$dir"/*.md; do [ -f "$md" ] && { cat "$md"; echo; }; done
    [ -f "$dir/env.txt" ] && { echo '```'; cat "$dir/env.txt"; echo '```'; }
    [ -f "$dir/pytest.txt" ] && { echo '```'; tail -n 40 "$dir/pytest.txt"; echo '```'; }
    echo
  } >> "$SUMMARY"
}

# default limits leave a margin under the device tool's 10 minutes per command
limit() {
  case $1 in
    env) echo 60 ;; tests) echo 420 ;; tests-mem) echo 240 ;; bench-case1) echo 300 ;; memory) echo 300 ;;
    kernel) echo 240 ;; i11-agentic64k) echo 200 ;; i11-case1) echo 120 ;; i11-low21k) echo 100 ;; i11-fused) echo 180 ;;
    issue11) echo 540 ;; grpo-default) echo 300 ;; i13-7b) echo 240 ;;
    i17a) echo 330 ;; i17b) echo 330 ;; i17-tests) echo 60 ;; i17-64k) echo 100 ;; i17-case1) echo 50 ;;
    i17-7b) echo 55 ;; i17-between) echo 60 ;; i17-128k) echo 100 ;; i17-256k) echo 185 ;; i17-calls) echo 45 ;;
    *) echo 570 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,52p' "$0"; exit 2; }
for spec in "$@"; do
  name=${spec%%:*}
  secs=${spec#*:}
  [[ $spec == *:* ]] || secs=$(limit "$name")
  part "$name" "$secs" 2>&1 | tee -a "$LOG"
done
tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$RES"
echo "results: $OUT/results.tgz, $SUMMARY, $LOG"
