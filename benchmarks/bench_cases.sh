# Sourced, from the repository root, by the H100 scripts (house_gpu_check.sh,
# step_defaults_gpu.sh, call_size_gpu.sh, host_cost_gpu.sh, gpu_idle_gpu.sh, vs_mask_gpu.sh, profile_gpu.sh,
# scale_gpu.sh): dtree importable from this checkout, $OUT created,
# the bench command and issue 17's two cases, or with SMOKE=1 their CPU stand-ins on the
# tiny model (plumbing only). Sets BENCH, CASE1, AGENTIC64K, AGENTIC256K, AT_MASK and HALF (the memory caps at
# the mask's peak on the 64k tree and at half its peak on the 256k one), SMOKE_FLAG (--smoke for the Python
# scripts), MASK_GIB (the mask's peak on the
# 64k tree: the memory cap that compares dtree at the mask's memory), CAP (the same for the mask with
# dtree's lean layers, sessions Q on) and STEPS, and defines bench (one `dtree bench` run into
# $OUT/DIR, its report rows printed), vs_mask64k, half256k and capped256k_origins (the comparisons against the mask and
# the capped 256k step's kernels, as sessions AG and AH ran them), script (one benchmarks/*.py diagnostic, its log in $OUT), memory_profile (benchmarks/profile_memory.py on the 64k tree), gpu_tests
# (a selection of the GPU tests into $OUT), ab (benchmarks/options_ab.py's arms interleaved) and micro (one benchmarks/micro_batches.py run, likewise).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
BENCH="python -m dtree bench --model qwen2.5-1.5b"
CASE1="--workload grpo --set num_prompts=1 --set prompt_len=2048 --set group_size=8 --set answer_len=512"
AGENTIC64K="--workload agentic --set num_trees=1 --set target_unique_tokens=65536"
MASK_GIB=17.6 STEPS=4 SMOKE_FLAG= CAP=14.5
AGENTIC256K="--workload agentic --set num_trees=1 --set target_unique_tokens=262144"
if [ "${SMOKE:-0}" = 1 ]; then
  BENCH="python -m dtree bench --model tiny --device cpu"
  CASE1="--workload grpo --set num_prompts=1 --set prompt_len=64 --set group_size=4 --set answer_len=16"
  AGENTIC64K="--workload agentic --set num_trees=1 --set system_prompt_len=64 --set trajectories=2 --set turn_len=4,40 --set target_unique_tokens=400"
  MASK_GIB=4 STEPS=2 SMOKE_FLAG=--smoke CAP=4
  AGENTIC256K=$AGENTIC64K AT_MASK=${AT_MASK:-4} HALF=${HALF:-4}
fi
AT_MASK=${AT_MASK:-12.5} HALF=${HALF:-19.9}  # the mask's peak on the 64k tree (H200 sessions), half its 256k one

script() {  # script NAME TIMEOUT ARGS...: one of the benchmarks/*.py diagnostics, its Markdown into $OUT
  local name=$1 limit=$2
  shift 2
  OUT="$OUT" timeout "$limit" python "benchmarks/$name.py" $SMOKE_FLAG "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $?"; tail -4 "$OUT/$name.log" | cut -c1-200
}

bench() {  # bench DIR TIMEOUT ARGS...: one `dtree bench` run, its report rows printed
  local dir=$1 limit=$2
  shift 2
  mkdir -p "$OUT/$dir"
  timeout "$limit" $BENCH "$@" --out "$OUT/$dir" >"$OUT/$dir.log" 2>&1
  grep -hE "^\| \`(dtree|tree-mask)[^|]*\` \| ok \|" "$OUT/$dir"/*.md | cut -d'|' -f2,6,8,12
}

vs_mask64k() {  # vs_mask64k: the 64k tree against tree-mask:whole+ckpt in one process: memory=$AT_MASK, low, the default
  bench at_mask64k 300 $AGENTIC64K --steps 5 --configs "tree-mask:whole+ckpt,dtree:memory=$AT_MASK,dtree:low,dtree"
}

half256k() {  # half256k: the 256k tree, the mask with 32,768-row re-run chunks against memory=$HALF (STEPS256, default 4)
  bench half256k 500 $AGENTIC256K --steps ${STEPS256:-4} --configs \
    "tree-mask:whole+ckpt+rerun_chunk_rows=32768,dtree:memory=$HALF"
}

capped256k_origins() {  # capped256k_origins: benchmarks/kernel_origins.py on the 256k tree under memory=$HALF
  script kernel_origins 240 --workload agentic256k --opt memory=$HALF --tag capped --top 40
}

memory_profile() {  # memory_profile DIR TIMEOUT CONFIGS [LINES]: benchmarks/profile_memory.py on the 64k tree, its rows printed
  mkdir -p "$OUT/$1"
  timeout "$2" python benchmarks/profile_memory.py --configs "$3" ${AGENTIC64K#--workload agentic } --out "$OUT/$1" \
    >"$OUT/$1.log" 2>&1
  grep -E "^\| " "$OUT/$1.log" | head -"${4:-40}" | cut -c1-200
}

gpu_tests() {  # gpu_tests FILE TIMEOUT KEYWORDS TESTS...: the GPU tests (-m gpu) of TESTS matching KEYWORDS, into $OUT/FILE; none with SMOKE=1
  [ -n "$SMOKE_FLAG" ] && return 0
  local file=$1 limit=$2 keywords=$3
  shift 3
  timeout "$limit" python -m pytest -q -p no:cacheprovider -m gpu "$@" -k "$keywords" 2>&1 | tee "$OUT/$file" | tail -3
}

ab() {  # ab WORKLOAD ROUNDS TAG ARMS...: benchmarks/options_ab.py (AB_LIMIT s, default 420), its table printed
  local workload=$1 rounds=$2 tag=$3
  shift 3
  local arms=()
  for arm in "$@"; do arms+=(--arm "$arm"); done
  [ -n "$SMOKE_FLAG" ] && rounds=2
  OUT="$OUT" timeout "${AB_LIMIT:-420}" python benchmarks/options_ab.py $SMOKE_FLAG --workload "$workload" "${arms[@]}" \
    --rounds "$rounds" --warmup 2 --tag "$tag" --kernels >"$OUT/options_ab_$tag.log" 2>&1
  echo "options_ab $tag: exit $?"
  grep -E "^\| [0-9]+ \|" "$OUT/options_ab_$tag.log" | cut -c1-240
}

micro() {  # micro DIR TIMEOUT ARGS...: benchmarks/micro_batches.py, its report in $OUT/DIR, its table printed
  mkdir -p "$OUT/$1"
  OUT="$OUT/$1" timeout "$2" python benchmarks/micro_batches.py $SMOKE_FLAG "${@:3}" >"$OUT/$1.log" 2>&1
  grep -E "^\| \`|^- dtree from" "$OUT/$1.log" | cut -c1-220
}
