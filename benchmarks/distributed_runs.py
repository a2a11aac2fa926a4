"""The state and the measurements of ``benchmarks/bench_distributed.py``: the batch (and
each kind of tree in it, timed alone), one timed configuration (:meth:`Bench.measure`),
the trainers per gradient sync, the time budget, the reports."""

from __future__ import annotations

import copy
import datetime
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import dtree
from benchmarks.distributed_report import write_reports
from dtree.bench.calibrate import time_step
from dtree.bench.configs import parse_assignments
from dtree.distributed import CostModel, DistributedStepError, DistributedTreeTrainer, wrap_model
from dtree.distributed.features import TreeIndex
from dtree.forest.forest import Forest
from dtree.workloads import TINY, make_workload, mixed_batch, workload_parameters
from dtree.workloads.mixed import KINDS

__all__ = ["Bench", "build_batch", "batch_failure_forest", "time_kinds"]

# the tree-count parameters --batch-scale multiplies
COUNTS = {"mixed": ("grpo_groups", "agentic_trees", "search_trees"), "grpo": ("num_prompts",),
          "agentic": ("num_trees",), "search": ("num_trees",)}


def build_batch(args, vocab_size: int):
    """(forest, MixedBatch or None, description) of ``--workload`` with ``--set``,
    ``--tiny`` and ``--batch-scale``."""
    name = args.workload
    valid = workload_parameters(name)  # raises on an unknown workload
    params = {**(TINY[name] if args.tiny else {}), **parse_assignments(args.overrides, "--set")}
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"--set {unknown}: not parameters of workload {name!r}; valid: {', '.join(valid)}")
    if args.batch_scale < 1:
        raise ValueError(f"--batch-scale must be >= 1, got {args.batch_scale}")
    for key in COUNTS.get(name, ()):
        params[key] = args.batch_scale * params.get(key, valid[key])
    batch = mixed_batch(seed=args.seed, vocab_size=vocab_size, **params) if name == "mixed" else None
    forest = batch.forest if batch else make_workload(name, seed=args.seed, vocab_size=vocab_size, **params)
    st, lengths = forest.stats(), forest.sequence_lengths()
    text = (f"{st.num_trees} trees, {st.num_sequences} sequences of {lengths.min():,} to {lengths.max():,} tokens, "
            f"{st.unique_tokens:,} unique / {st.linearized_tokens:,} linearized tokens ({st.compression_ratio:.2f}x), "
            f"{st.num_nodes} nodes (batch scale {args.batch_scale}); loss PPO clip, token mean (global counts)")
    desc = dict(workload=name, seed=args.seed, batch_scale=args.batch_scale, description=text,
                params={k: v for k, v in params.items()}, stats=st.as_dict())
    return forest, batch, desc


def batch_failure_forest(bench: "Bench") -> Forest:
    """A small batch for the failure runs: the first tree of each kind (or the first three trees)."""
    f = bench.forest
    tree_of = f.sequence_tree()
    if bench.kinds is not None:
        kinds = bench.kinds.tree_kinds()
        trees = [kinds.index(k) for k in KINDS if k in kinds]
    else:
        trees = list(range(min(3, f.num_trees)))
    return f.subset(np.flatnonzero(np.isin(tree_of, trees)))


def time_kinds(bench: "Bench", args) -> None:
    """Each kind of tree of a mixed batch alone on one GPU (ranks share the kinds)."""
    if bench.kinds is None:
        return
    parts = [(k, bench.kinds.part(k)) for k in KINDS if len(bench.kinds.sequences_of(k))]
    mine = {k: time_step(bench.runtime, part, repeats=1, warmup=1)
            for i, (k, part) in enumerate(parts) if i % bench.world == bench.rank}
    seconds = {k: v for d in bench.gather(mine) for k, v in d.items()}
    rows = []
    for k, part in parts:
        st, lengths = part.stats(), part.sequence_lengths()
        rows.append(dict(kind=k, trees=st.num_trees, sequences=st.num_sequences, unique_tokens=st.unique_tokens,
                         min_len=int(lengths.min()), max_len=int(lengths.max()), seconds=seconds[k],
                         us_per_token=1e6 * seconds[k] / st.unique_tokens, flops_s=bench.flops.cost(part)))
    bench.result["batch"]["kinds"] = rows
    bench.log("per kind (1 GPU): " + ", ".join(f"{r['kind']} {r['us_per_token']:.1f} us/token" for r in rows))


class Bench:
    """What every phase of the benchmark shares (one per process)."""

    def __init__(self, rank, world, device, dtype, model, config, args) -> None:
        self.rank, self.world, self.device, self.dtype = rank, world, device, dtype
        self.model, self.config, self.args = model, config, args
        self.t_start = time.perf_counter()
        self.runtime = dtree.TreeRuntime(model, config=config)
        self.flops = CostModel.from_spec(self.runtime.spec, passes=4.0 if self.runtime.mode == "recompute" else 3.0)
        self.calibrated: CostModel | None = None
        self.loss = dtree.losses.ppo_clip(reduction="token_mean")
        self.forest: Forest | None = None
        self.kinds = None
        self.ref_grads: dict[str, torch.Tensor] = {}
        self._index: TreeIndex | None = None
        self.paths: tuple[str, ...] = ()
        self.result = dict(
            generated=datetime.datetime.now().isoformat(timespec="seconds"),
            command="torchrun --nproc-per-node %d benchmarks/bench_distributed.py %s" % (world, " ".join(sys.argv[1:])),
            elapsed_s=0.0,
            setup=dict(model=args.model, dtype=str(dtype).replace("torch.", ""), world=world,
                       runtime=", ".join(f"{k}={v}" for k, v in config.as_dict().items()),
                       steps=args.steps, warmup=args.warmup, time_budget_s=args.time_budget,
                       env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}),
            runs=[],
        )

    # ------------------------------------------------------------------ plumbing
    @property
    def t1(self) -> float:
        return self.result["baseline"]["t1_s"]

    def sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.perf_counter() - self.t_start:5.0f}s] {msg}", flush=True)

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def have_time(self, estimate: float, group, budget: float) -> bool:
        """Whether ``estimate`` more seconds fit the budget; decided on the group's slowest
        clock, so every member decides the same."""
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = torch.tensor([time.perf_counter() - self.t_start], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item()) + estimate <= budget

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def save(self) -> None:
        if self.rank == 0:
            self.result["elapsed_s"] = time.perf_counter() - self.t_start
            gpu = self.result["env"]["gpu"].replace("NVIDIA ", "").replace(" ", "-")
            gpu = "cpu" if self.device.type == "cpu" else gpu
            stem = f"distributed_{self.args.workload}_{self.args.model}_{self.world}x{gpu}"
            self.paths = write_reports(self.result, self.args.out_dir, stem)

    # ------------------------------------------------------------------ runs
    def cost_model(self, balancer: str) -> CostModel:
        return {"calibrated": self.calibrated, "flops": self.flops, "tokens": CostModel.token_count()}[balancer]

    def trainer(self, sync: str, group) -> DistributedTreeTrainer:
        """The plain model for ``allreduce``; a wrapped copy for ``ddp`` and ``fsdp2``."""
        self.model.zero_grad(set_to_none=True)  # a copy does not need the last run's gradients
        model = self.model if sync == "allreduce" else wrap_model(copy.deepcopy(self.model), sync, group)
        return DistributedTreeTrainer(model, process_group=group, config=self.config)

    def add_run(self, w: int, balancer: str, split: bool, sync: str, **fields) -> dict:
        row = dict(world=w, balancer=balancer, split=split, sync=sync, **fields)
        self.result["runs"].append(row)
        return row

    def measure(self, trainer: DistributedTreeTrainer, w: int, group, balancer: str, split: bool, steps: int,
                warmup: int) -> dict:
        """Median step of one configuration, and what the partition and the gradient were."""
        trainer.cost_model, trainer.split = self.cost_model(balancer), split
        times, outs = [], []
        try:
            for i in range(warmup + steps):
                trainer.model.zero_grad(set_to_none=True)
                self.sync_device()
                dist.barrier(group=group)
                t0 = time.perf_counter()
                out = trainer.step(self.forest, self.loss)
                self.sync_device()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    outs.append(out)
        except DistributedStepError as e:  # raised on every rank alike: report it and go on
            return self.add_run(w, balancer, split, trainer.sync.name, status="error", reason=str(e)[:500])
        plan = trainer.plan(self.forest)
        if self._index is None:
            self._index = TreeIndex(self.forest)
        cal = [self.calibrated.cost(self._index.sequences(ids)) for ids in plan.sequence_ids]
        rep, step = plan.report, statistics.median(times)
        base_loss = self.result["baseline"]["loss"]
        return self.add_run(
            w, balancer, split, trainer.sync.name, status="ok", step_s=step, steps_s=times,
            efficiency=self.t1 / (w * step), imbalance_measured=statistics.median(o.imbalance for o in outs),
            imbalance_predicted=rep.imbalance, imbalance_calibrated=max(cal) / (sum(cal) / len(cal)),
            recompute_overhead=rep.recompute_overhead, split_trees=len(rep.split_trees), pieces=rep.num_pieces,
            method=rep.method, rank_walk_s=outs[-1].rank_seconds,
            sync_s=statistics.median(o.sync_seconds for o in outs),
            rank_costs_calibrated=cal, rank_unique_tokens=rep.rank_unique_tokens, loss=outs[-1].loss,
            loss_rel_diff=abs(outs[-1].loss - base_loss) / max(abs(base_loss), 1e-30),
            grad_error=self.grad_error(trainer.runtime.module),
        )

    def grad_error(self, module: torch.nn.Module) -> float:
        """Largest relative L2 error of a parameter's gradient against the 1-GPU step's
        (FSDP2: the full gradient, gathered)."""
        worst = 0.0
        for name, p in module.named_parameters():
            ref = self.ref_grads.get(name)
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            if ref is None or g is None:
                if (ref is None) != (g is None):
                    worst = float("inf")
                continue
            err = float((g.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
            worst = max(worst, err)
        return worst
