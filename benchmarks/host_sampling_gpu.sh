#!/usr/bin/env bash
# Issue 17, host time sampled on the GPU machine (benchmarks/host_sampling.py under py-spy):
# GRPO case 1, the 64k tree with memory="low" and by default. py-spy comes from a wheel
# carried in .whl/ (pip download py-spy -d .whl); flash-attn-4 installed as in its header.
# CASES picks among case1, agentic64k_low, agentic64k_cap (memory=14.5), agentic64k_at_mask (memory=$AT_MASK, the
# mask's peak: bench_cases.sh) and agentic64k (all but the two caps by default).
#
#     bash benchmarks/host_sampling_gpu.sh    # reports in $OUT (default /tmp/dtree_host_sampling)
#     CASES="agentic64k_low agentic64k_cap" bash benchmarks/host_sampling_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtree_host_sampling}
source benchmarks/bench_cases.sh
SPY=$(python - <<'PY'
import glob, os, zipfile
wheel = sorted(glob.glob(".whl/py_spy-*.whl"))[-1]
dest = os.path.expanduser("~/py-spy")
zipfile.ZipFile(wheel).extractall(dest)
path = glob.glob(os.path.join(dest, "*.data/scripts/py-spy"))[0]
os.chmod(path, 0o755)
print(path)
PY
)
RATE=500
sample() {  # name, steps, run arguments...
  local name=$1 steps=$2; shift 2
  timeout 240 "$SPY" record --nonblocking -r $RATE -f raw -o "$OUT/stacks_$name.txt" -- \
    python benchmarks/host_sampling.py run --steps "$steps" "$@" 2>&1 | grep -v "^py-spy>" | tail -2
  python benchmarks/host_sampling.py report "$OUT/stacks_$name.txt" --steps "$steps" --rate $RATE \
    --out "$OUT/host_sampling_$name.md" | sed -n 3,14p
  gzip -f "$OUT/stacks_$name.txt"
}
for case in ${CASES:-case1 agentic64k_low agentic64k}; do
  case "$case" in
    case1) sample case1 40 --workload case1 ;;
    agentic64k_low) sample agentic64k_low 4 --workload agentic64k --opt memory=low ;;
    agentic64k_cap) sample agentic64k_cap 4 --workload agentic64k --opt memory=14.5 ;;
    agentic64k_at_mask) sample agentic64k_at_mask 4 --workload agentic64k --opt memory=$AT_MASK ;;
    agentic64k) sample agentic64k 4 --workload agentic64k ;;
    *) echo "unknown case $case" ;;
  esac
done
