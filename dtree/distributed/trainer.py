"""One data-parallel training step over a forest, exact and hang-free.

Per step, every rank runs the same collectives in the same order, whatever it
received (a whole tree, a piece of one, or nothing)::

    1. all-reduce [loss tokens, loss sequences, sequences] -> global Normalization
    2. sync.begin()                                   (FSDP2: all-gather once)
    3. the local DFS walk (no collective)             TreeRuntime.forward_backward
    4. all-reduce [loss, failed flag, seconds] per rank
    5a. all ranks ok:     sync.finish()               (one all-reduce / reduce-scatter)
    5b. some rank failed: all-gather the error texts, sync.abort() and raise
        DistributedStepError on every rank; param.grad is as before the step

Step 4 comes before any gradient collective, so a rank that ran out of memory or
found a non-finite loss cannot leave the others waiting in an all-reduce it never
joins, and no rank applies a partial gradient.

Exactness: :mod:`dtree.distributed.partition` gives every sequence to exactly one
rank; with the global counts of step 1, every rank's loss terms carry the weights
of the single-process loss, so the summed gradient (and the summed loss) equal the
single-process ones up to floating-point rounding (docs/design.md section 7).
"""

from __future__ import annotations

import gc
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..config import RuntimeConfig
from ..engine.checks import check_forest, check_loss_argument
from ..engine.runtime import StepOutput, TreeRuntime
from ..forest.forest import Forest
from ..losses import Normalization, SequenceLoss, TokenLoss, local_normalization
from .cost_model import CostModel
from .partition import Partition, PartitionReport, plan_partition
from .sync import DEFAULT_BUCKET_BYTES, GradSync, make_grad_sync

__all__ = ["DistributedStepError", "DistributedStepOutput", "DistributedTreeTrainer", "distributed_forward_backward"]


class DistributedStepError(RuntimeError):
    """A step failed on at least one rank; raised on every rank.

    Attributes:
        failures: ``{rank: "ExceptionType: message"}`` of every failing rank.
    """

    def __init__(self, failures: dict[int, str], world_size: int) -> None:
        self.failures = dict(sorted(failures.items()))
        if len(self.failures) == 1:
            ((rank, msg),) = self.failures.items()
            where = f"rank {rank} of {world_size}: {msg}"
        else:
            ranks = ", ".join(str(r) for r in self.failures)
            where = f"ranks {ranks} of {world_size}: " + "; ".join(f"rank {r}: {m}" for r, m in self.failures.items())
        super().__init__(
            f"training step failed on {where} [no gradient was synchronized; param.grad is as it was "
            "before the step on every rank]"
        )


@dataclass
class DistributedStepOutput:
    """What a distributed step returns (the same on every rank, except ``local``).

    ``loss`` is the global loss (the single-process value); ``rank_seconds`` every
    rank's local walk time, whose spread is the measured imbalance.
    """

    loss: float
    normalization: Normalization | None
    local: StepOutput | None  # this rank's counters; None on a rank with no sequence
    rank_seconds: list[float]
    sync_seconds: float
    seconds: float
    partition: PartitionReport | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        """Measured max / mean local walk time."""
        mean = sum(self.rank_seconds) / len(self.rank_seconds)
        return max(self.rank_seconds) / mean if mean > 0 else 1.0


def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _comm_device(group) -> torch.device:
    """Where small control tensors live: NCCL only moves CUDA tensors."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: Sequence[float], group, op=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device(group))
    if dist.is_initialized():
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t.cpu().tolist()


def global_normalization(forest: Forest | None, group=None, use_loss_mask: bool = True) -> Normalization:
    """The batch's loss-token, loss-sequence and sequence counts, summed over ranks (step 1).

    Mirrors what ``TokenLoss.weights`` uses on one process (``local_normalization``),
    so the reductions divide by exactly the single-process counts."""
    local = local_normalization(forest, use_loss_mask) if forest is not None else Normalization(0.0, 0.0, 0.0)
    tokens, seqs, all_seqs = _all_reduce([local.loss_tokens, local.loss_sequences, local.num_sequences], group)
    return Normalization(loss_tokens=tokens, loss_sequences=seqs, num_sequences=all_seqs)


def _free_memory(runtime: TreeRuntime) -> None:
    runtime.release_memory()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _local_walk(
    runtime: TreeRuntime,
    forest: Forest | None,
    loss: TokenLoss | Callable,
    norm: Normalization | None,
    sequence_ids: np.ndarray | None,
    return_logprobs: bool,
) -> tuple[StepOutput | None, str, float]:
    """Step 3, this rank's walk: (its output, None without a forest; the error text, ""
    when it ran; its seconds). A failure is caught, never raised: it must reach the
    other ranks in step 4, or they hang."""
    local: StepOutput | None = None
    error = ""
    t_walk = time.perf_counter()
    try:
        if forest is not None:
            kw = dict(normalization=norm) if isinstance(loss, TokenLoss) else {}
            local = runtime.forward_backward(forest, loss, return_logprobs=return_logprobs, **kw)
    except torch.OutOfMemoryError as e:  # before Exception: free what the walk held first
        _free_memory(runtime)
        error = _describe(e)
    except Exception as e:
        error = _globalize(_describe(e), sequence_ids)
    return local, error, time.perf_counter() - t_walk


def distributed_forward_backward(
    runtime: TreeRuntime,
    forest: Forest | None,
    loss: TokenLoss | Callable,
    *,
    group=None,
    sync: GradSync | None = None,
    sequence_ids: np.ndarray | None = None,
    normalization: Normalization | None = None,
    return_logprobs: bool = False,
) -> DistributedStepOutput:
    """Accumulate into ``param.grad`` this rank's share of the global step's gradient,
    synchronized once (see module docstring). Call it on every rank of ``group``.

    Args:
        runtime: this rank's :class:`TreeRuntime` (over the unwrapped module).
        forest: this rank's forest, ``None`` for a rank that received no sequence.
        loss: a :class:`TokenLoss` or a :class:`SequenceLoss` (``gspo``); their reductions
            use the global counts. Any other two-pass callable runs on the local forest as
            is: it must already be a sum over sequences (or normalize by global counts itself).
        sync: the gradient strategy, default :func:`make_grad_sync` of ``runtime.module``
            (plain all-reduce). Pass the trainer's DDP/FSDP strategy for wrapped models.
        sequence_ids: this rank's original sequence indices; only used to name the
            global sequence in error messages.
        normalization: the global counts to divide by, when the caller has them (a
            trainer's own, e.g. verl's ``batch_num_tokens`` / ``global_batch_size``);
            default: this rank's counts summed over ``group``.
        return_logprobs: this rank's ``local`` output carries the log-probs (and
            entropies) the loss saw, as ``TreeRuntime.forward_backward`` returns them.

    Raises:
        DistributedStepError: on every rank, if any rank failed (out of memory,
            non-finite loss, bad input, ...); ``param.grad`` is unchanged everywhere.
    """
    t0 = time.perf_counter()
    rank, world = _world(group)
    sync = sync or make_grad_sync(runtime.module, group)
    norm = normalization
    if norm is None and isinstance(loss, (TokenLoss, SequenceLoss)):
        norm = global_normalization(forest, group, loss.use_loss_mask)
    if isinstance(loss, SequenceLoss):  # the two-pass path takes its counts from the loss itself
        loss = loss.with_normalization(norm)
    sync.begin()

    local, error, walk_seconds = _local_walk(runtime, forest, loss, norm, sequence_ids, return_logprobs)
    status = [0.0] * (1 + 2 * world)
    status[0] = local.loss if local is not None else 0.0
    status[1 + rank] = 1.0 if error else 0.0
    status[1 + world + rank] = walk_seconds
    status = _all_reduce(status, group)
    failed = [r for r in range(world) if status[1 + r] > 0]

    t_sync = time.perf_counter()
    if failed:
        messages = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(messages, error, group=group)
        else:
            messages = [error]
        sync.abort()
        raise DistributedStepError({r: messages[r] or "failed" for r in failed}, world)
    sync.finish()
    sync_seconds = time.perf_counter() - t_sync
    return DistributedStepOutput(
        loss=status[0],
        normalization=norm,
        local=local,
        rank_seconds=status[1 + world :],
        sync_seconds=sync_seconds,
        seconds=time.perf_counter() - t0,
    )


def _globalize(message: str, sequence_ids: np.ndarray | None) -> str:
    """Rewrite the runtime's rank-local "sequence i" into the batch's sequence index."""
    if sequence_ids is None:
        return message

    def repl(m: re.Match) -> str:
        i = int(m.group(1))
        return f"sequence {int(sequence_ids[i])}" if 0 <= i < len(sequence_ids) else m.group(0)

    return re.sub(r"\bsequence (\d+)", repl, message)


class DistributedTreeTrainer:
    """Data-parallel tree training: partition the batch, run the local DFS, sync once.

    Args:
        model: a plain module (gradients all-reduced by dtree), a
            ``DistributedDataParallel`` wrapper, or an FSDP2 module (``fully_shard``
            applied to its layers and to the model). Every rank passes its own.
        process_group: the data-parallel group (default: the world).
        cost_model: balances the ranks; default ``CostModel.from_spec`` of the model.
        partition_method, split, split_threshold: see :func:`dtree.distributed.plan_partition`.
        check_assignment: all-reduce a fingerprint of the partition every step and fail
            if ranks disagree (they would if their batches differed).
        fsdp_probe: forward used by the FSDP2 sync pass (see :class:`FSDPSync`).
        bucket_bytes: all-reduce bucket size for plain and DDP models.
        config: the :class:`~dtree.config.RuntimeConfig` of the local runtime (``mode``,
            ``group_tokens``, ...); default ``RuntimeConfig()``.

    Every rank must call :meth:`step` with the same global forest (or
    :meth:`forward_backward` with its own share) the same number of times.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        process_group=None,
        cost_model: CostModel | None = None,
        partition_method: str = "auto",
        split: bool = True,
        split_threshold: float | None = None,
        check_assignment: bool = True,
        fsdp_probe: Callable | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        config: RuntimeConfig | None = None,
    ) -> None:
        self.group = process_group
        self.rank, self.world_size = _world(process_group)
        self.sync = make_grad_sync(model, process_group, bucket_bytes=bucket_bytes, probe=fsdp_probe)
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.model = model
        self.runtime = TreeRuntime(module, config=config or RuntimeConfig())
        # recompute mode runs every forward twice: 4 passes of FLOPs instead of 3
        passes = 4.0 if self.runtime.mode == "recompute" else 3.0
        self.cost_model = cost_model or CostModel.from_spec(self.runtime.spec, passes=passes)
        self.partition_method = partition_method
        self.split = split
        self.split_threshold = split_threshold
        self.check_assignment = check_assignment

    def plan(self, forest: Forest) -> Partition:
        """The assignment of ``forest``'s sequences to the ranks (the same on every rank)."""
        return plan_partition(forest, self.world_size, self.cost_model, method=self.partition_method, split=self.split,
                              split_threshold=self.split_threshold)

    def step(self, forest: Forest, loss: TokenLoss | Callable) -> DistributedStepOutput:
        """Partition the global batch ``forest`` and accumulate its gradient (synced)."""
        check_forest(forest)  # the same forest on every rank: all raise here, before any collective
        check_loss_argument(loss)
        plan = self.plan(forest)
        if self.check_assignment and self.world_size > 1:
            self._check_same_plan(plan)
        ids = plan.sequence_ids[self.rank]
        out = self.forward_backward(plan.forest(self.rank), loss, sequence_ids=ids)
        out.partition = plan.report
        return out

    def forward_backward(
        self, forest: Forest | None, loss: TokenLoss | Callable, *, sequence_ids: np.ndarray | None = None
    ) -> DistributedStepOutput:
        """Run this rank's share (``None``: nothing) and synchronize; see
        :func:`distributed_forward_backward`."""
        return distributed_forward_backward(
            self.runtime, forest, loss, group=self.group, sync=self.sync, sequence_ids=sequence_ids
        )

    def _check_same_plan(self, plan: Partition) -> None:
        d = float(plan.digest() >> 11)  # 52 bits: exact in a float64
        hi, neg_lo = _all_reduce([d, -d], self.group, op=dist.ReduceOp.MAX)
        if hi != -neg_lo:
            raise RuntimeError(
                "ranks computed different partitions of the batch: every rank must pass the same forest "
                "(same sequences and fields, same order) and the same cost model to step()"
            )
