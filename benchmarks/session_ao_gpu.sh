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
#     PART=diag bash benchmarks/session_ao_gpu.sh              # reports in $OUT (default /tmp/dtree_session_ao)
#     SMOKE=1 PART=speed bash benchmarks/session_ao_gpu.sh     # the tiny model on the CPU: plumbing only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_session_ao}
source benchmarks/bench_cases.sh  # script, SMOKE_FLAG

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
  *) echo "PART must be diag, depth or speed"; exit 2 ;;
esac
rm -f "$OUT"/*/*.png "$OUT"/*/*.json "$OUT"/*.json
