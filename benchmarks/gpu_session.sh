#!/usr/bin/env bash
# One device-machine call: run the named stages in order, each under its own time
# limit, and bundle logs and reports into $OUT (the device tool returns at most 8
# files). Usage:  bash benchmarks/gpu_session.sh STAGE[:SECONDS] ...
#
# Stages:
#   env        versions, GPU, varlen_attn signature
#   gputests   the runtime's and the kernel's GPU tests only
#   tests      pytest -m gpu (fixed Triton config: autotuning every test case would
#              spend minutes compiling)
#   kernel     benchmarks/bench_stack_attention.py (layouts and attention options)
#   warmup     benchmarks/warmup_steps.py: first 4 steps of a fresh process, cold Triton cache,
#              fixed configs then DTREE_TRITON_AUTOTUNE=1
#   case1      dtree bench qwen2.5-1.5b grpo 2048/8x512 (the fast-path target case)
#   grpo15     dtree bench qwen2.5-1.5b grpo default shape (1 batch of prompts)
#   agentic15  dtree bench qwen2.5-1.5b agentic (1 tree)
#   agentic7   dtree bench qwen2.5-7b agentic (1 tree)
#   case2      dtree bench qwen2.5-1.5b agentic, one >=64k-unique-token tree
#   sdpa1      case1 with dtree's unfused sdpa attention (the reference GPU path)
#   profile1   benchmarks/profile_step.py on case1: dtree vs tree-mask kernels
#   sweep1     benchmarks/sweep.py on case1: dtree variants vs the baselines
#   sweep1c    sweep1 with torch.compile'd decoder layers (for every method)
#   sweep2     case 2: one agentic tree of >=64k unique tokens; tree-mask whole and split
#   sweep1c2   case 1, compiled layers, after the auto mode and leaf-group changes
#   sweep2c    case 2 on an emulated 80 GB GPU, compiled layers
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/dtree_out}
RES=$OUT/results
mkdir -p "$RES"
LOG=$OUT/session.log
BENCH="python -m dtree bench --out $RES --warmup 1 --repeats 3"
CASE1="--set num_prompts=1 --set prompt_len=2048 --set group_size=8 --set answer_len=512"

stage() {
  local name=$1 secs=$2
  echo "=== $name (limit ${secs}s) $(date +%T)" | tee -a "$LOG"
  local t0=$SECONDS
  case $name in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
      python - <<'PY'
import inspect, torch, triton, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except Exception as e:
    print("varlen_attn unavailable:", e)
PY
      ;;
    gputests) DTREE_TRITON_AUTOTUNE=0 timeout "$secs" python -m pytest -q -p no:cacheprovider --timeout 240 -rfE \
             tests/test_runtime_gpu.py tests/test_stack_attention_triton.py tests/test_runtime_attention_options.py \
             tests/test_kv_stack.py -m gpu ;;
    tests) DTREE_TRITON_AUTOTUNE=0 timeout "$secs" python -m pytest -m gpu -q -p no:cacheprovider --timeout 240 -rfE tests ;;
    kernel) timeout "$secs" python benchmarks/bench_stack_attention.py --out "$RES" ;;
    warmup) for tune in 0 1; do
              TRITON_CACHE_DIR=$(mktemp -d) DTREE_TRITON_AUTOTUNE=$tune timeout "$secs" python benchmarks/warmup_steps.py \
                --model qwen2.5-1.5b --workload agentic --set num_trees=1 --steps 4
            done ;;
    case1) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload grpo \
             --set num_prompts=1 --set prompt_len=2048 --set group_size=8 --set answer_len=512 --tag case1 ;;
    sdpa1) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload grpo --methods dtree \
             --set num_prompts=1 --set prompt_len=2048 --set group_size=8 --set answer_len=512 \
             --opt dtree.attention=sdpa --tag case1-sdpa ;;
    grpo15) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload grpo --set num_prompts=2 ;;
    agentic15) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload agentic --set num_trees=1 ;;
    agentic7) timeout "$secs" $BENCH --model qwen2.5-7b --workload agentic --set num_trees=1 --repeats 2 ;;
    case2) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload agentic --set num_trees=1 \
             --set target_unique_tokens=65536 --repeats 2 --tag case2 ;;
    profile1) timeout "$secs" python benchmarks/profile_step.py --model qwen2.5-1.5b --workload grpo $CASE1 \
             --config dtree --config tree-mask --out "$RES" ;;
    sweep1) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload grpo $CASE1 --name case1 \
             --config tree-mask --config dtree --config dtree:group_tokens=2048 --config dtree:group_tokens=1024 \
             --config dtree:mode=recompute --config dtree:attention=sdpa --config linearized --out "$RES" ;;
    sweep1c) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload grpo $CASE1 --name case1-compiled \
             --compile --config tree-mask --config dtree --config dtree:group_tokens=2048 --config dtree:group_tokens=1024 \
             --config linearized --out "$RES" ;;
    sweep2) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload agentic --name case2 --repeats 2 \
             --set num_trees=1 --set target_unique_tokens=65536 \
             --config dtree --config dtree:group_tokens=4096 --config dtree:mode=recompute \
             --config dtree:mode=recompute,group_tokens=16384 --config tree-mask \
             --config tree-mask:max_tokens_per_batch=32768 --config tree-mask:max_tokens_per_batch=16384 \
             --config linearized --out "$RES" ;;
    sweep1c2) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload grpo $CASE1 --name case1-compiled-2 \
             --compile --config tree-mask --config dtree --config dtree:group_tokens=2048 --config dtree:mode=recompute \
             --config dtree:mode=recompute,group_tokens=2048 --config linearized --out "$RES" ;;
    sweep2c) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload agentic --name case2-80gb-compiled \
             --repeats 2 --memory-limit-gib 80 --compile --set num_trees=1 --set target_unique_tokens=65536 \
             --config dtree --config dtree:group_tokens=16384 --config dtree:mode=recompute \
             --config dtree:mode=recompute,group_tokens=16384 --config tree-mask \
             --config tree-mask:max_tokens_per_batch=16384 --config tree-mask:max_tokens_per_batch=8192 --out "$RES" ;;
    sweepa) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload agentic --name agentic-1tree \
             --set num_trees=1 --config tree-mask --config dtree --config dtree:group_tokens=16384 \
             --config dtree:group_tokens=4096 --config dtree:mode=recompute --out "$RES" ;;
    profile1c) timeout "$secs" python benchmarks/profile_step.py --model qwen2.5-1.5b --workload grpo $CASE1 --compile \
             --config dtree --config dtree:group_tokens=2048 --config tree-mask --name _compiled --out "$RES" ;;
    sweep1c3) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload grpo $CASE1 --name case1-compiled-3 \
             --compile --config tree-mask --config dtree --config dtree:group_tokens=4096 --config dtree:group_tokens=2048 \
             --out "$RES" ;;
    sweep2c3) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload agentic --name case2-80gb-compiled-3 \
             --repeats 2 --memory-limit-gib 80 --compile --set num_trees=1 --set target_unique_tokens=65536 \
             --config dtree --config dtree:group_tokens=16384 --config dtree:group_tokens=32768 \
             --config dtree:mode=recompute,group_tokens=8192 --config tree-mask:max_tokens_per_batch=16384 \
             --config tree-mask:max_tokens_per_batch=32768 --out "$RES" ;;
    sweepac) timeout "$secs" python benchmarks/sweep.py --model qwen2.5-1.5b --workload agentic --name agentic-1tree-compiled \
             --compile --set num_trees=1 --config tree-mask --config dtree --config dtree:group_tokens=8192 \
             --config dtree:group_tokens=4096 --out "$RES" ;;
    final1) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload grpo $CASE1 --compile --tag case1 ;;
    final1e) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload grpo $CASE1 --tag case1-final ;;
    finala15) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload agentic --set num_trees=1 --compile ;;
    finala7) timeout "$secs" $BENCH --model qwen2.5-7b --workload agentic --set num_trees=1 --compile --repeats 2 --warmup 2 ;;
    finalc2) timeout "$secs" $BENCH --model qwen2.5-1.5b --workload agentic --set num_trees=1 --set target_unique_tokens=65536 \
             --compile --memory-limit-gib 80 --opt tree-mask.max_tokens_per_batch=16384 --repeats 2 --warmup 2 --tag case2-80gb ;;
    finalg7) timeout "$secs" $BENCH --model qwen2.5-7b --workload grpo $CASE1 --compile --tag case1 ;;
    *) echo "unknown stage $name"; false ;;
  esac
  local rc=$?
  echo "=== $name done in $((SECONDS - t0))s, rc=$rc" | tee -a "$LOG"
}

for spec in "$@"; do
  [[ $spec == *:* ]] || spec="$spec:300"
  stage "${spec%%:*}" "${spec#*:}" 2>&1 | tee -a "$LOG"
done
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$RES"
