#!/usr/bin/env bash
# Session AO on one Hopper GPU (flash-attn-4 installed as in ../shared/tools/fa4_wheels.sh), in one device call each.
# The question: GRPO case 1 (prompt 2048, G=8, answers 512) sits at 45.8% MFU against issue 17's 50% on the H200s of
# sessions AM-AN, with ~110 ms of kernels in a 0.13-0.15 s step. Where does its GPU wait on today's code, and what
# does the host do there?
#
#   PART=diag   GRPO case 1's steady steps profiled with CUDA activity only (benchmarks/gpu_gaps.py: the wait before
#               the first kernel, the gaps by size and by kernel pair), then its host time sampled by py-spy
#               (benchmarks/host_sampling.py, py-spy from a wheel in .whl/: pip download py-spy -d .whl);
#   PART=depth  how far case 1's host runs ahead of its GPU at every decoder layer (benchmarks/queue_depth.py, each
#               forest measured twice), and the step's host work under cProfile (benchmarks/host_profile.py);
#   PART=speed  this host's cost per call of a view, an allocation, a launch (benchmarks/host_speed.py), and case 1's
#               steps with torch's default intra-op threads against one, alternating on fresh forests;
#
# Then one change: dtree's Triton launches read their argument classes through code generated once per call site
# (dtree.ops.fast_launch._reader) instead of binding every argument and classing it in a Python call each (the
# reference, still there):
#
#   PART=check  the GPU tests (pytest -m gpu) of the Triton kernels launched through fast_launch, the lean layers and
#               whole steps; benchmarks/host_cost_ab.py with the reference keys against the generated readers, per
#               launch and per step, interleaved on fresh forests: case 1, the 64k tree at the mask's memory and low;
#   PART=steps  in one process (dtree bench) the 64k tree: tree-mask:whole+ckpt against memory=12.5, low and the
#               default (bench_cases.sh's vs_mask64k); then GRPO case 1: dtree, tree-mask:whole+ckpt, linearized.
#
#   PART=first  case 1's first run over each fresh forest against a second over the same forest object, a deep copy
#               and a run after empty_cache() (benchmarks/first_encounter.py): dtree bench meets every forest once and
#               ran case 1 at 0.155 s where host_cost_ab.py, which steps each forest twice, ran it at 0.131 s.
#
#     PART=diag bash benchmarks/session_ao_gpu.sh              # reports in $OUT (default /tmp/dtree_session_ao)
#     SMOKE=1 PART=speed bash benchmarks/session_ao_gpu.sh     # the tiny model on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ao}
source benchmarks/bench_cases.sh  # script, bench, gpu_tests, vs_mask64k, CASE1, SMOKE_FLAG
TOUCHED="tests/test_fast_launch.py tests/test_rms_norm.py tests/test_swiglu.py tests/test_rotary.py tests/test_stack_ops_triton.py
 tests/test_shared_input_linear.py tests/test_logprobs_triton.py tests/test_lean_layers.py tests/test_runtime_gpu.py
 tests/test_masked_call.py"

sampled_case1() {  # sampled_case1 TAG: case 1's host time under py-spy (the sampled script's plumbing alone on CI)
  if [ -n "$SMOKE_FLAG" ]; then
    python benchmarks/host_sampling.py run --smoke --steps 2 >"$OUT/host_sampling_smoke.log" 2>&1; echo "smoke: exit $?"
    return
  fi
  local spy
  spy=$(python -c "import glob, os, zipfile; w = sorted(glob.glob('.whl/py_spy-*.whl'))[-1]; d = os.path.expanduser('~/py-spy'); zipfile.ZipFile(w).extractall(d); p = glob.glob(d + '/*.data/scripts/py-spy')[0]; os.chmod(p, 0o755); print(p)")
  timeout 200 "$spy" record --nonblocking -r 500 -f raw -o "$OUT/stacks_$1.txt" -- \
    python benchmarks/host_sampling.py run --steps 40 --workload case1 2>&1 | grep -v "^py-spy>" | tail -1
  python benchmarks/host_sampling.py report "$OUT/stacks_$1.txt" --steps 40 --rate 500 \
    --out "$OUT/host_sampling_$1.md" | sed -n 5,14p
  gzip -f "$OUT/stacks_$1.txt"
}

case "${PART:-diag}" in
  diag)
    script gpu_gaps 200 --workload case1 --steps 8 --top 20
    tail -n 40 "$OUT/gpu_gaps.log"
    sampled_case1 case1
    ;;
  depth)
    script queue_depth 200 --workload case1 --steps 3 --repeat --layer-every 1
    cat "$OUT/queue_depth.log" | head -120
    script host_profile 200 --workload case1 --steps 6 --top 60
    ;;
  speed)
    script host_speed 300 --workload case1 --forests 8 --rounds 2
    cat "$OUT/host_speed.log" | tail -25
    ;;
  check)
    gpu_tests gpu_tests.txt 240 "" $TOUCHED -rfE
    cases=case1,agentic64k_12.5GiB,agentic64k_low
    [ -n "$SMOKE_FLAG" ] && cases=case1
    timeout 300 python benchmarks/host_cost_ab.py $SMOKE_FLAG --cases $cases --variants reference_keys --rounds 8 \
      --out "$OUT" 2>&1 | tail -4
    ;;
  steps)
    vs_mask64k
    bench case1 200 $CASE1 --steps ${CASE1_STEPS:-10} --configs "dtree,tree-mask:whole+ckpt,linearized"
    ;;
  first)
    script first_encounter 300 --workload case1 --forests 6
    tail -n 40 "$OUT/first_encounter.log"
    ;;
  *) echo "PART must be diag, depth, speed, check, steps or first"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
