#!/usr/bin/env bash
# Issue 22 on one multi-GPU host: one device command per machine, each within ~9.5 minutes
# (NCCL, NVLink multicast off):
#
#   bash benchmarks/distributed_session.sh x4   # nvidia-h200-x4: the mixed batch on 4 and on 2 GPUs
#   bash benchmarks/distributed_session.sh x8   # nvidia-h200-x8: the mixed batch x2 on 8 and on 4 GPUs
#
# Each runs benchmarks/bench_distributed.py under torchrun: the batch on one GPU (per kind and
# whole), calibration, every balancer with splitting on/off, DDP and FSDP2 for each rank count,
# and the failure runs (out of memory / non-finite loss on one rank, every sync) on all GPUs.
# The 8-GPU run doubles the batch (--batch-scale 2): one global batch per machine, as an RL
# trainer sizes it, so that 8 ranks still have enough trees to balance.
# Reports (Markdown + JSON, rewritten after every configuration) and the log go to $OUT.
# SMOKE=1: the same on CPU (gloo, 4 processes, the tiny model and batch).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/dtree_out}
MODEL=${MODEL:-qwen2.5-1.5b}
mkdir -p "$OUT"
case "${1:-}" in
  x4) NPROC=4 ARGS="--model $MODEL --ranks 4,2" ;;
  x8) NPROC=8 ARGS="--model $MODEL --ranks 8,4 --batch-scale 2 --baseline-steps 1" ;;
  *) echo "usage: $0 x4|x8 (SMOKE=1: on CPU)"; exit 2 ;;
esac
if [ "${SMOKE:-0}" = 1 ]; then
  NPROC=4 ARGS="--smoke --ranks 4,2"
fi
LOG=$OUT/distributed_$1.log
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null || echo "no GPU"; } | tee "$LOG"
# --time-budget counts from after the model is built; torchrun and the imports take ~30 s more
timeout -k 10 570 torchrun --nproc-per-node "$NPROC" benchmarks/bench_distributed.py $ARGS --time-budget 480 \
  --out-dir "$OUT" 2>&1 | grep -v "OMP_NUM_THREADS\|^\*\*\*\*\|^W[0-9]* .*Warning" | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "torchrun exit code $rc" | tee -a "$LOG"
ls -l "$OUT"
exit "$rc"
