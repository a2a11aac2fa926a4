"""Data-parallel tree training with dtree: partition each batch by cost, train, sync once per step.

Single node, 2 processes on CPU (gloo) with a tiny model:

    torchrun --nproc-per-node 2 examples/train_distributed.py --model tiny --tiny --steps 3

8 GPUs (NCCL), a Qwen2.5-0.5B-shaped model with random weights, FSDP2:

    torchrun --nproc-per-node 8 examples/train_distributed.py --model qwen2.5-0.5b --sync fsdp2

Two nodes of 8 GPUs (the same command on both; README, "Distributed training"):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 \
        --rdzv-id dtree-run examples/train_distributed.py --model qwen2.5-1.5b --workload mixed --sync fsdp2

Every rank builds the same batch (same workload seed) and the same partition; each
trains its own share; gradients are summed once per step. Rank 0 prints the loss,
per-rank walk times, the measured imbalance (max/mean walk time) and the predicted
one (max/mean cost-model time).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import dtree
from dtree.distributed import SYNCS, CostModel, DistributedTreeTrainer, wrap_model
from dtree.presets import add_model_arguments, build_model, resolve_device, resolve_dtype
from dtree.workloads import WORKLOADS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, default_model="tiny")
    p.add_argument("--workload", default="grpo", choices=sorted(WORKLOADS))
    p.add_argument("--tiny", action="store_true", help="CPU-sized workload shapes")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--sync", default="allreduce", choices=[*SYNCS, "fsdp"],
                   help="plain module + one all-reduce, DistributedDataParallel, or FSDP2 (fully_shard; 'fsdp' "
                        "is the same)")
    p.add_argument("--method", default="auto", choices=["auto", "lpt", "kk"], help="rank balancer")
    p.add_argument("--cost-model", default=None, help="a `dtree calibrate` JSON; default: FLOPs of the model")
    p.add_argument("--mode", default="retain", choices=["retain", "recompute"])
    p.add_argument("--group-tokens", type=int, default=8192)
    p.add_argument("--reduction", default="token_mean", choices=list(dtree.losses.REDUCTIONS))
    return p.parse_args()


def setup() -> tuple[int, int, torch.device]:
    """Process group from torchrun's environment (or a single process without it)."""
    device = resolve_device("auto")
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def make_batch(args: argparse.Namespace, step: int, vocab_size: int) -> dtree.Forest:
    from dtree.workloads import make_workload

    return make_workload(args.workload, seed=args.seed + step, vocab_size=vocab_size, tiny=args.tiny)


def main() -> None:
    args = parse_args()
    rank, world, device = setup()
    if args.device != "auto":
        device = torch.device(args.device)
    model = build_model(args.model, device=device, dtype=resolve_dtype(args.dtype, device), seed=args.seed)
    wrapped = wrap_model(model, "fsdp2" if args.sync == "fsdp" else args.sync)
    cost_model = CostModel.load(args.cost_model) if args.cost_model else None
    trainer = DistributedTreeTrainer(wrapped, cost_model=cost_model, partition_method=args.method,
                                     config=dtree.RuntimeConfig(mode=args.mode, group_tokens=args.group_tokens))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = trainer.runtime.spec.vocab_size
    if rank == 0:
        print(f"{world} rank(s), {args.model} on {device}, sync={trainer.sync.name}, "
              f"cost model: {trainer.cost_model.meta.get('source', '?')} ({trainer.cost_model.format()})")

    for step in range(args.steps):
        forest = make_batch(args, step, vocab)
        has_ppo = {"advantages", "old_logprobs"} <= set(forest.fields)
        loss = dtree.losses.ppo_clip(reduction=args.reduction) if has_ppo else dtree.losses.nll(args.reduction)
        t0 = time.perf_counter()
        out = trainer.step(forest, loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if rank == 0:
            rep = out.partition
            walks = " ".join(f"{s:.3f}" for s in out.rank_seconds)
            print(
                f"step {step}: loss {out.loss:.6g}  step {seconds:.3f}s (sync {out.sync_seconds:.3f}s)  "
                f"walk per rank [{walks}]s  imbalance measured {out.imbalance:.3f} / predicted {rep.imbalance:.3f}  "
                f"recomputed {100 * rep.recompute_overhead:.1f}%  split trees {rep.split_trees or '-'}  "
                f"({forest.num_sequences} seqs, {forest.num_unique_tokens:,} unique tokens)"
            )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
