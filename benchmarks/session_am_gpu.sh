#!/usr/bin/env bash
# Session AM on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The questions: do the bf16 GPU tests still pass on today's code as a whole (sessions AA-AL ran the files they
# touched), and does the tree-mask baseline, whose FlexAttention calls now raise dynamo's recompile limit for
# themselves and refuse to run uncompiled past it (dtree.baselines.kernels.tree_mask_attention.compiled_call),
# keep its speed against dtree on the 64k tree?
#
#   PART=tests_a  the GPU tests (pytest -m gpu) of the Triton stack attention, the stack ops and the fused log-probs;
#   PART=tests_b  every other GPU test (whole steps, the flash-attn backend, the baselines, hybrids, memory);
#   PART=steps    in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the
#                 default (bench_cases.sh's vs_mask64k, as session AL ran it);
#   PART=case1_7b GRPO case 1 (prompt 2048, G=8, answers 512): dtree's default against tree-mask:whole+ckpt and
#                 linearized training (flash-attn-4), 10 steps; then qwen2.5-7b on one ~32k agentic tree, the default;
#   PART=half256  the 256k tree: the mask (32,768-row re-run chunks) against memory=19.9, half its peak (half256k);
#   PART=host_ab  GRPO case 1's host time sampled by py-spy (benchmarks/host_sampling.py, py-spy from .whl/), this
#                 checkout against the one in $OLD (dtree/ and benchmarks/ of an earlier commit), alternating, twice
#                 each: what the step's host does before its first kernel and after its sync, where the GPU waits.
#
# With PART=steps, case1_7b and half256 on one machine these are issue 17's cases on today's code, in three calls.
#
#     PART=tests_a bash benchmarks/session_am_gpu.sh           # reports in $OUT (default /tmp/dtree_session_am)
#     SMOKE=1 PART=steps bash benchmarks/session_am_gpu.sh     # tiny trees on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_am}
source benchmarks/bench_cases.sh  # gpu_tests, vs_mask64k
KERNEL_TESTS="tests/test_stack_attention_triton.py tests/test_stack_ops.py tests/test_logprobs_triton.py"

case "${PART:-tests_a}" in
  tests_a)
    gpu_tests gpu_tests_a.txt 540 "" $KERNEL_TESTS -rfE
    ;;
  tests_b)
    others=$(ls tests/test_*.py | grep -v -F -x -f <(tr ' ' '\n' <<<"$KERNEL_TESTS"))
    gpu_tests gpu_tests_b.txt 540 "" $others -rfE
    ;;
  steps)
    vs_mask64k
    ;;
  case1_7b)
    bench case1 200 $CASE1 --steps ${CASE1_STEPS:-10} --configs "dtree,tree-mask:whole+ckpt,linearized"
    MODEL7B=qwen2.5-7b T7B=32768
    [ -n "$SMOKE_FLAG" ] && MODEL7B=tiny T7B=400
    BENCH=${BENCH/qwen2.5-1.5b/$MODEL7B} bench agentic32k_7b 240 $AGENTIC64K --set target_unique_tokens=$T7B \
      --steps 4 --configs dtree
    ;;
  half256)
    half256k
    ;;
  host_ab)
    if [ -n "$SMOKE_FLAG" ]; then  # no py-spy on CI: the sampled script's own plumbing
      python benchmarks/host_sampling.py run --smoke --steps 2 >"$OUT/host_ab_smoke.log" 2>&1; echo "smoke: exit $?"
    else
      SPY=$(python -c "import glob, os, zipfile; w = sorted(glob.glob('.whl/py_spy-*.whl'))[-1]; d = os.path.expanduser('~/py-spy'); zipfile.ZipFile(w).extractall(d); p = glob.glob(d + '/*.data/scripts/py-spy')[0]; os.chmod(p, 0o755); print(p)")
      here=$PWD
      for round in 1 2; do
        for arm in new old; do
          dir=$here; [ $arm = old ] && dir=${OLD:?OLD: an earlier checkout}
          (cd "$dir" && timeout 200 "$SPY" record --nonblocking -r 500 -f raw -o "$OUT/stacks_${arm}_$round.txt" -- \
            python benchmarks/host_sampling.py run --steps 40 --workload case1 2>&1 | grep -v "^py-spy>" | tail -1)
          python benchmarks/host_sampling.py report "$OUT/stacks_${arm}_$round.txt" --steps 40 --rate 500 \
            --out "$OUT/host_sampling_${arm}_$round.md" | sed -n 5,12p
          gzip -f "$OUT/stacks_${arm}_$round.txt"
        done
      done
    fi
    ;;
  *) echo "PART must be tests_a, tests_b, steps, case1_7b, half256 or host_ab"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
