"""Distributed tree training on one multi-GPU host: the mixed batch over 2, 4 and 8 ranks.

One command per machine (NCCL, one process per GPU; `benchmarks/distributed_session.sh`
wraps these with the right environment):

    torchrun --nproc-per-node 4 benchmarks/bench_distributed.py --out-dir $OUT                 # 4 GPUs: W = 4, 2
    torchrun --nproc-per-node 8 benchmarks/bench_distributed.py --batch-scale 2 --ranks 8,4 --out-dir $OUT

What it measures, on one global batch (default the ``mixed`` workload: GRPO groups,
agentic trees with 32k contexts, search trees; the same on every rank), random weights
of a published model shape, bf16:

1. **The batch on one GPU**: each kind of tree alone (microseconds per unique token:
   why token counts mislead), then the whole batch: step time ``T1``, loss and the
   gradient every distributed run is compared with.
2. **Calibration**: the ranks time the synthetic calibration forests in parallel,
   all-gather the times, and every rank fits the same cost model.
3. **Per rank count W** (largest first; W below the machine's size on ranks 0..W-1):
   each balancer (calibrated cost model, FLOP-derived model, unique-token count) with
   subtree splitting on and off, plain all-reduce; then the calibrated balancer with
   DDP and with FSDP2. Per configuration: median step ``TW``, efficiency
   ``T1 / (W x TW)``, imbalance measured and predicted, recomputed prefix tokens, the
   summed gradient's error against ``T1``'s.
4. **Failure runs** (after the largest W): on every sync, one rank runs out of memory
   (a real CUDA allocator error) or hits a non-finite loss; every rank must raise the
   same error, restore ``param.grad`` and train on (`benchmarks/distributed_failures.py`).

Writes ``distributed_<workload>_<model>_<N>x<gpu>.md`` and ``.json`` to ``--out-dir``
after every configuration, so a run cut short keeps what it finished; a time budget
(``--time-budget``) skips the configurations that would not finish in it. ``--smoke``
runs everything on CPU (gloo, the tiny model, the tiny batch), as the tests do.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import statistics
import sys
import time

# Keep NVLink SHARP (NVLS) and symmetric-memory multicast off on these machines; the
# caller's values win, these are only defaults when unset.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import dtree  # noqa: E402
from benchmarks.distributed_failures import failure_runs, summarize  # noqa: E402
from benchmarks.distributed_report import versions  # noqa: E402
from benchmarks.distributed_runs import Bench, batch_failure_forest, build_batch, time_kinds  # noqa: E402
from dtree.bench.calibrate import default_forests, time_step  # noqa: E402
from dtree.distributed import CostModel, forest_features  # noqa: E402
from dtree.presets import build_model, resolve_dtype  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BALANCERS = ("calibrated", "flops", "tokens")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b", help="qwen2.5-0.5b, qwen2.5-1.5b, tiny, or a local config.json")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK, NCCL), or cpu (gloo)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", default="mixed", help="mixed (default), grpo, agentic or search")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a workload parameter (repeatable), e.g. --set agentic_trees=4")
    p.add_argument("--batch-scale", type=int, default=1,
                   help="multiply the workload's tree counts (a global batch that grows with the machine)")
    p.add_argument("--tiny", action="store_true", help="CPU-sized workload shapes")
    p.add_argument("--ranks", default=None, help="rank counts to run, e.g. 8,4 (default: 2, 4, ... up to the world)")
    p.add_argument("--syncs", default="allreduce,ddp,fsdp2", help="gradient syncs (the balancers run on allreduce)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before each configuration")
    p.add_argument("--baseline-steps", type=int, default=2, help="timed 1-GPU steps of the whole batch")
    p.add_argument("--calibration-tokens", type=int, default=32768, help="largest calibration forest (unique tokens)")
    p.add_argument("--calibration-repeats", type=int, default=2)
    p.add_argument("--group-tokens", type=int, default=8192)
    p.add_argument("--mode", default="retain", choices=["retain", "recompute"])
    p.add_argument("--attention", default="auto", help="TreeRuntime attention backend (auto, triton, sdpa)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-failures", action="store_true", help="skip the failure runs")
    p.add_argument("--time-budget", type=float, default=510.0,
                   help="seconds: a configuration that would end after this is skipped (reported as such)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or RESULTS, help="report directory (default $OUT)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: gloo, tiny model and batch, one step per configuration")
    p.add_argument("--compare-balancers", action="store_true",
                   help="no GPU: compare LPT and Karmarkar-Karp partitions on the workloads and write "
                        "benchmarks/results/partition_lpt_vs_kk.md")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.model, args.tiny = "cpu", "tiny", True
        args.steps, args.warmup, args.baseline_steps, args.calibration_repeats = 1, 0, 1, 1
        args.calibration_tokens, args.group_tokens = 64, 64  # several model calls per walk (the failure runs)
    return args


def setup(args) -> tuple[int, int, torch.device]:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(minutes=10)
    if args.device == "auto" and torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu" if args.device == "auto" else args.device)
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def rank_counts(text: str | None, world: int) -> list[int]:
    """The rank counts to run, largest first; each must fit the world."""
    ranks = [int(w) for w in text.split(",")] if text else [w for w in (2, 4, 8, 16) if w <= world] or [world]
    bad = [w for w in ranks if not 1 <= w <= world]
    if bad:
        raise ValueError(f"--ranks {bad} do not fit a world of {world} processes")
    return sorted(set(ranks), reverse=True)


def baseline(b: Bench, args) -> None:
    """The whole batch on every GPU at once (no communication): T1, loss, reference gradient."""
    times = []
    for i in range(1 + args.baseline_steps):
        b.model.zero_grad(set_to_none=True)
        b.sync_device()
        t0 = time.perf_counter()
        out = b.runtime.forward_backward(b.forest, b.loss)
        b.sync_device()
        if i >= 1:
            times.append(time.perf_counter() - t0)
    b.ref_grads = {n: p.grad.detach().clone() for n, p in b.model.named_parameters() if p.grad is not None}
    b.model.zero_grad(set_to_none=True)
    per_rank = b.gather(statistics.median(times))
    b.result["baseline"] = dict(t1_s=statistics.median(per_rank), per_rank_s=per_rank, loss=out.loss)
    b.log(f"1-GPU step {b.t1:.3f}s (per GPU {', '.join(f'{t:.3f}' for t in per_rank)}), loss {out.loss:.6g}")


def calibrate(b: Bench, args) -> None:
    """Each rank times every world-th calibration forest; all fit the same model."""
    forests = default_forests(args.calibration_tokens, seed=args.seed, vocab_size=b.runtime.spec.vocab_size)
    mine = [(i, forest_features(f), time_step(b.runtime, f, repeats=args.calibration_repeats, warmup=1))
            for i, (_, f) in enumerate(forests) if i % b.world == b.rank]
    rows = sorted((r for part in b.gather(mine) for r in part), key=lambda r: r[0])  # the same order everywhere
    b.calibrated, fit = CostModel.fit([r[1] for r in rows], [r[2] for r in rows], meta={"source": "fit (bench)"})
    b.result["calibration"] = dict(coefficients=b.calibrated.format(), values=dict(b.calibrated.coefficients),
                                   fit=fit.__dict__, budget_tokens=args.calibration_tokens)
    b.result["flops_model"] = b.flops.format()
    for row in b.result["batch"].get("kinds", []):  # the fit's prediction of each kind's 1-GPU step
        row["calibrated_s"] = b.calibrated.cost(b.kinds.part(row["kind"]))
    b.log(f"calibrated: {fit.format()}; {b.calibrated.format()}")


def configurations(syncs: list[str]) -> list[tuple[str, bool, str]]:
    """(balancer, split, sync) in the order they run: the comparisons that matter first."""
    out = [(bal, True, "allreduce") for bal in BALANCERS] + [(bal, False, "allreduce") for bal in BALANCERS]
    return out + [("calibrated", True, s) for s in syncs if s != "allreduce"]


def run_world(b: Bench, args, w: int, group) -> None:
    """Every configuration on ranks 0..w-1 (the others wait at the end)."""
    if b.rank < w:
        trainers = {}
        for balancer, split, sync in configurations(args.syncs.split(",")):
            estimate = (args.warmup + args.steps) * 1.3 * b.t1 / w + (15.0 if sync != "allreduce" else 0.0)
            if not b.have_time(estimate, group, args.time_budget):
                b.add_run(w, balancer, split, sync, status="skipped", reason="time budget")
                continue
            if sync not in trainers:
                trainers.clear()  # one wrapped copy at a time
                gc.collect()
                trainers[sync] = b.trainer(sync, group)
            row = b.measure(trainers[sync], w, group, balancer, split, args.steps, args.warmup)
            b.log(f"W={w} {balancer} split={'on' if split else 'off'} {sync}: step {row['step_s']:.3f}s, efficiency "
                  f"{row['efficiency']:.3f}, imbalance {row['imbalance_measured']:.3f} (calibrated prediction "
                  f"{row['imbalance_calibrated']:.3f}), grad error {row['grad_error']:.1e}")
        trainers.clear()
        b.free()
    dist.barrier()


def run_failures(b: Bench, args, w: int, group) -> None:
    if b.rank < w:
        b.model.zero_grad(set_to_none=True)  # each run trains a copy of the model
        forest = batch_failure_forest(b)
        rows = failure_runs(lambda: copy.deepcopy(b.model), forest, b.loss, group=group, config=b.config,
                            cost_model=b.calibrated, device=b.device, syncs=args.syncs.split(","), log=b.log)
        everyone = [None] * w
        dist.all_gather_object(everyone, rows, group=group)
        tolerance = 1e-5 if b.dtype == torch.float32 else 3e-2
        b.result["failures"] = summarize(everyone, tolerance)
        b.log(f"failure runs on {w} ranks: {sum(v['passed'] for v in b.result['failures'])} of "
              f"{len(b.result['failures'])} pass")
        b.free()
    dist.barrier()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compare_balancers:
        from benchmarks.partition_compare import compare_balancers

        compare_balancers(os.path.join(RESULTS, "partition_lpt_vs_kk.md"))
        return
    rank, world, device = setup(args)
    dtype = resolve_dtype(args.dtype, device)
    config = dtree.RuntimeConfig(mode=args.mode, group_tokens=args.group_tokens, attention=args.attention)
    model = build_model(args.model, device=device, dtype=dtype, seed=args.seed)
    b = Bench(rank, world, device, dtype, model, config, args)
    b.forest, b.kinds, b.result["batch"] = build_batch(args, b.runtime.spec.vocab_size)
    b.result["env"] = versions(device)
    b.log(f"{world} x {b.result['env']['gpu']}, {args.model} {dtype}, batch {b.forest!r}")
    ranks = rank_counts(args.ranks, world)
    groups = {w: (None if w == world else dist.new_group(list(range(w)))) for w in ranks}  # every rank, same order
    time_kinds(b, args)
    baseline(b, args)
    calibrate(b, args)
    b.runtime.release_memory()
    b.save()
    for i, w in enumerate(ranks):
        run_world(b, args, w, groups[w])
        b.save()
        if i == 0 and not args.no_failures:
            run_failures(b, args, w, groups[w])
            b.save()
    if rank == 0:
        for t in b.result.get("targets", []):
            print(f"  {'MET' if t['met'] else 'NOT MET'}: {t['target']}: {t['measured']}")
        print("\n".join(f"wrote {p}" for p in b.paths))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
