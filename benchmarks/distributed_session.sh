#!/usr/bin/env bash
# Distributed measurements on one multi-GPU host (NCCL, NVLink multicast off):
# benchmarks/bench_distributed.py with 2 and then 4 processes, reports into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/dtree_out}
MODEL=${MODEL:-qwen2.5-1.5b}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
for w in "$@"; do
  echo "=== $w GPUs $(date +%T)"
  timeout 280 torchrun --nproc-per-node "$w" benchmarks/bench_distributed.py --model "$MODEL" --out "$OUT/distributed_${w}gpu.md" 2>&1 \
    | grep -v "Warning\|warn" | tail -40
done
ls "$OUT"
