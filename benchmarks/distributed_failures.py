"""One rank fails in the middle of a distributed step: every rank must raise the same
error, ``param.grad`` must be as before the step on every rank, and the next step must
work (no rank left behind in a collective).

Per gradient sync (plain all-reduce, DDP, FSDP2) and failure kind, on every rank of
``group``:

1. a good step (the gradient ``G`` is now in ``param.grad``);
2. the failing step:

   * ``oom``: the victim rank runs out of memory in its walk. On CUDA the caching
     allocator is capped (``torch.cuda.set_per_process_memory_fraction``) at what is
     reserved when the step starts plus a headroom that lets FSDP2 all-gather the
     parameters (a real allocator error, mid-walk, after gradients were accumulated).
     A CPU has no such cap: there a forward hook on the last decoder layer raises
     ``torch.OutOfMemoryError`` on its second call, after the first groups ran their
     backward.
   * ``nonfinite``: one token of one of the victim's sequences has a loss of ``-logp / 0``.

3. checks: every rank raised :class:`~dtree.distributed.DistributedStepError` with the
   same message naming only the victim; every rank's gradient (its FSDP2 shard) is
   bitwise ``G``;
4. a good step again: the gradient is ``2 G`` (up to the rounding of one addition).

:func:`failure_runs` runs them all and returns this rank's rows; :func:`summarize`
merges every rank's rows into one verdict per run. ``benchmarks/bench_distributed.py``
runs them on NCCL; ``tests/test_distributed_failures.py`` runs the same code on gloo.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from dtree.config import RuntimeConfig
from dtree.distributed import SYNCS, CostModel, DistributedStepError, DistributedTreeTrainer, wrap_model
from dtree.forest.forest import Forest
from dtree.losses import TokenLoss

__all__ = ["FAILURES", "failure_runs", "summarize", "out_of_memory"]

FAILURES = ("oom", "nonfinite")
FSDP_HEADROOM_EXTRA = 1 << 30  # beyond two copies of the unsharded parameters (all-gather + gradients)
HEADROOM = 512 << 20


def _div_loss() -> TokenLoss:
    """``-logp / den``: a zero ``den`` makes that term infinite."""
    return TokenLoss(lambda lp, f: -lp / f["den"], reduction="sum", required_fields=("den",), name="div")


def _zero_den(forest: Forest, sequence: int) -> tuple[Forest, int]:
    """``forest`` with a ``den`` field of ones but a zero at the first loss token of
    ``sequence`` (a masked token's term is never computed); and that position."""
    den = [np.ones(n) for n in forest.sequence_lengths()]
    mask = forest.field("loss_mask", sequence) if "loss_mask" in forest.fields else np.ones(len(den[sequence]))
    position = int(np.flatnonzero(mask[1:])[0]) + 1  # position 0 is never predicted
    den[sequence][position] = 0.0
    return forest.with_fields(den=den), position


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor: global numel


@contextlib.contextmanager
def out_of_memory(model: torch.nn.Module, device: torch.device, headroom: int):
    """Make this rank's walk run out of memory (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(device) + headroom) / total),
                                                   device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    from dtree.models.checkpointing import decoder_layers

    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("CPU stand-in for a CUDA out-of-memory error (second call of the last layer)")

    handle = decoder_layers(model)[-1].register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor | None]:
    out = []
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):  # FSDP2: this rank's shard
            g = g.to_local()
        out.append(None if g is None else g.detach().clone())
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
    )


def _relative_error(now: list, before: list, scale: float) -> float:
    worst = 0.0
    for x, y in zip(now, before):
        if y is None or x is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        ref = scale * y.float()
        worst = max(worst, float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)))
    return worst


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def failure_run(make_model: Callable[[], torch.nn.Module], sync: str, failure: str, forest: Forest, loss: TokenLoss,
                group, config: RuntimeConfig, cost_model: CostModel | None, device: torch.device) -> dict:
    """One failure run on this rank (see the module docstring); returns this rank's row."""
    t0 = time.perf_counter()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = wrap_model(make_model(), sync, group)
    trainer = DistributedTreeTrainer(model, process_group=group, config=config, cost_model=cost_model)
    plan = trainer.plan(forest)
    costs = plan.report.rank_costs
    if failure == "oom":  # the rank with the most work: its walk certainly needs more than the headroom
        victim = max(range(world), key=lambda r: (costs[r], -r))
    else:  # a rank other than 0, so the error has to travel
        victim = max(r for r in range(world) if len(plan.sequence_ids[r]))
    trainer.step(forest, loss)
    before = _snapshot(model)
    bad, bad_loss, where = forest, loss, None
    if failure == "nonfinite":
        sequence = int(plan.sequence_ids[victim][0])
        bad, position = _zero_den(forest, sequence)
        bad_loss, where = _div_loss(), f"sequence {sequence}, position {position}"
    headroom = HEADROOM + (2 * _parameter_bytes(model) + FSDP_HEADROOM_EXTRA if sync == "fsdp2" else 0)
    inject = out_of_memory(_unwrapped(model), device, headroom) if failure == "oom" and rank == victim else None
    mem_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    message, failures = None, {}
    try:
        with inject or contextlib.nullcontext():
            trainer.step(bad, bad_loss)
    except DistributedStepError as e:
        message, failures = str(e), dict(e.failures)
    mem_after = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    restored = _same(before, _snapshot(model))
    trainer.step(forest, loss)
    recovered_error = _relative_error(_snapshot(model), before, 2.0)
    row = dict(sync=trainer.sync.name, failure=failure, rank=rank, world=world, victim=victim, where=where,
               message=message,
               failures={int(k): v for k, v in failures.items()}, restored=restored, recovered_error=recovered_error,
               memory_growth_bytes=mem_after - mem_before, seconds=time.perf_counter() - t0)
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def failure_runs(make_model: Callable[[], torch.nn.Module], forest: Forest, loss: TokenLoss, *, group=None,
                 config: RuntimeConfig | None = None, cost_model: CostModel | None = None,
                 device: torch.device = torch.device("cpu"), syncs=SYNCS, failures=FAILURES,
                 log: Callable[[str], None] | None = None) -> list[dict]:
    """Every (sync, failure) run on this rank; call on every rank of ``group``.
    ``make_model()`` returns a fresh copy of the same model each time (FSDP2 shards it)."""
    rows = []
    for sync in syncs:
        for failure in failures:
            rows.append(failure_run(make_model, sync, failure, forest, loss, group, config or RuntimeConfig(),
                                    cost_model, device))
            if log:
                log(f"failure run {sync}/{failure}: victim rank {rows[-1]['victim']}, raised: "
                    f"{rows[-1]['message'] is not None}, restored: {rows[-1]['restored']}")
    return rows


EXPECTED = {"oom": "OutOfMemoryError", "nonfinite": "loss is not finite"}


def summarize(rows_per_rank: list[list[dict]], tolerance: float) -> list[dict]:
    """One verdict per run from every rank's rows (``tolerance``: of the ``2 G`` check)."""
    out = []
    for runs in zip(*rows_per_rank):
        first = runs[0]
        victim = first["victim"]
        checks = {
            "raised on every rank": all(r["message"] is not None for r in runs),
            "same error on every rank": len({r["message"] for r in runs}) == 1,
            "names only the failing rank": all(list(r["failures"]) == [victim] for r in runs),
            "says what failed": all(EXPECTED[first["failure"]] in (r["message"] or "") for r in runs),
            "says where (batch sequence, position)": all((r["where"] or "") in (r["message"] or "") for r in runs),
            "param.grad restored (bitwise)": all(r["restored"] for r in runs),
            "next step exact (2G)": all(r["recovered_error"] <= tolerance for r in runs),
        }
        out.append(dict(sync=first["sync"], failure=first["failure"], victim=victim, where=first["where"],
                        world=first["world"],
                        checks=checks, passed=all(checks.values()), message=first["message"],
                        recovered_error=max(r["recovered_error"] for r in runs),
                        victim_memory_growth_bytes=runs[victim]["memory_growth_bytes"],
                        seconds=max(r["seconds"] for r in runs)))
    return out
