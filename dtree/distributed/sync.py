"""Gradient synchronization for tree training: once per step, never inside the walk.

A dtree step runs many ``autograd.backward`` calls (one per group of the DFS) and
ranks run different numbers of them, or none. A data-parallel wrapper that reduces
gradients inside backward would issue a collective per call, in a different count
on every rank: a hang. So every strategy here keeps the walk local and issues a
fixed sequence of collectives before and after it, identical on every rank:

=====================  ==========================================================
strategy               per step
=====================  ==========================================================
:class:`AllReduceSync`  plain module (or DDP, :class:`DDPSync`): the walk
                        accumulates into fresh ``.grad`` (the previous gradients
                        are set aside); then one bucketed all-reduce (SUM) of the
                        flattened step gradients, zeros for parameters a rank did
                        not touch; then the old gradients are added back.
:class:`DDPSync`        as above, with the walk inside ``ddp.no_sync()`` (the walk
                        calls ``ddp.module``'s submodules, never DDP's forward, so
                        DDP's reducer is not armed; ``no_sync`` makes that explicit).
:class:`FSDPSync`       FSDP2 (``fully_shard``): all-gather every FSDP module once
                        (``unshard()``), walk with ``reshard_after_forward`` and
                        ``reshard_after_backward`` off and gradient sync off (so the
                        walk's many forwards and backwards issue no collective), then
                        one zero-gradient "sync pass" through the root module with
                        sync on: FSDP's own post-backward reduce-scatters every
                        parameter group's accumulated unsharded gradient (SUM, divide
                        factor 1) into the sharded ``.grad`` and reshards.
=====================  ==========================================================

The loss is already normalized by the *global* counts, so gradients are summed,
not averaged. Each strategy has ``begin()`` (before the walk, on every rank),
``finish()`` (after every rank succeeded) and ``abort()`` (after any rank failed:
drop this step's gradients, leaving ``param.grad`` as before the step).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from ..engine.grad_guard import GradStash

__all__ = ["GradSync", "LocalSync", "AllReduceSync", "DDPSync", "FSDPSync", "make_grad_sync", "hf_probe"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class GradSync:
    """Interface; see module docstring."""

    name = "none"

    def begin(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalSync(GradSync):
    """Single process: keep ``param.grad`` intact on failure, nothing to reduce."""

    name = "local"

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self._stash: GradStash | None = None

    def begin(self) -> None:
        self._stash = GradStash(self.params)

    def finish(self) -> None:
        self._stash.commit()
        self._stash = None

    def abort(self) -> None:
        self._stash.restore()
        self._stash = None


class AllReduceSync(LocalSync):
    """One bucketed SUM all-reduce of the step's gradients (see module docstring)."""

    name = "allreduce"

    def __init__(self, params: Iterable[torch.Tensor], group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(params)
        self.group = group
        self.bucket_bytes = int(bucket_bytes)

    def finish(self) -> None:
        params = self._stash.params
        # Every rank reduces every parameter, touched or not, in the same order and
        # buckets: the collective sequence cannot depend on what a rank computed.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for p, g in zip(params, grads):
            p.grad = g
        super().finish()


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_bytes``
    (a larger tensor is a bucket of its own)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device and size + nbytes <= bucket_bytes:
            out[-1].append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


class DDPSync(AllReduceSync):
    """DistributedDataParallel: the walk under ``no_sync()``, then one all-reduce."""

    name = "ddp"

    def __init__(
        self, ddp: torch.nn.parallel.DistributedDataParallel, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        super().__init__(ddp.module.parameters(), ddp.process_group, bucket_bytes)
        self.ddp = ddp
        self._ctx: contextlib.ExitStack | None = None

    def begin(self) -> None:
        self._ctx = contextlib.ExitStack()
        self._ctx.enter_context(self.ddp.no_sync())
        super().begin()

    def _leave(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None

    def finish(self) -> None:
        self._leave()
        super().finish()

    def abort(self) -> None:
        self._leave()
        super().abort()


def hf_probe(model: torch.nn.Module) -> torch.Tensor:
    """The sync pass's forward for a transformers causal LM: one token through the
    whole model (every parameter is used, so every FSDP group takes part)."""
    param = next(model.parameters())
    ids = torch.zeros((1, 1), dtype=torch.long, device=param.device)
    out = model(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


class FSDPSync(GradSync):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``), see module docstring.

    Args:
        root: the module ``fully_shard`` was applied to last (the model).
        probe: ``fn(root) -> tensor`` running one tiny forward through ``root`` that
            uses every parameter; default :func:`hf_probe` (transformers models). It
            runs once without grad to let FSDP pick ``root`` as its root (the walk
            only calls submodules, and FSDP makes the first module it sees run
            forward the root), and once per step as the sync pass, whose gradient is
            exactly zero: only the accumulated step gradients are reduced.

    The trainer owns the FSDP flags of ``root``'s modules: ``reshard_after_forward``
    stays off after the first step (the walk calls each layer many times per step;
    resharding between calls would all-gather per call), the gradient divide factor
    is 1 with sum-only reductions (the loss is globally normalized).
    """

    name = "fsdp2"

    def __init__(self, root: torch.nn.Module, probe: Callable[[torch.nn.Module], torch.Tensor] | None = None) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(root, FSDPModule):
            raise TypeError("FSDPSync needs the module fully_shard was applied to")
        self.root = root
        self.modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
        self.probe = probe or hf_probe
        self._ready = False

    def _setup(self) -> None:
        with torch.no_grad():
            self.probe(self.root)  # FSDP's lazy init: makes `root` the root state
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM; gloo has no PREMUL_SUM
        self._ready = True

    def _set_sync(self, on: bool) -> None:
        for m in self.modules:
            m.set_requires_gradient_sync(on, recurse=False)
            m.set_reshard_after_backward(on, recurse=False)

    def begin(self) -> None:
        if not self._ready:
            self._setup()
        self._set_sync(False)
        for m in self.modules:  # the step's only all-gathers, in module order on every rank
            m.unshard()

    def finish(self) -> None:
        self._set_sync(True)
        with torch.enable_grad():
            out = self.probe(self.root)
            # A zero seed: the sync pass adds exactly nothing to the gradients, but
            # runs every group's post-backward, which reduce-scatters what the walk
            # accumulated into the sharded .grad (adding to any earlier gradient).
            torch.autograd.backward(out, torch.zeros_like(out))
        for m in self.modules:
            m.reshard()

    @contextlib.contextmanager
    def unsharded(self):
        """Every FSDP module's parameters gathered for an inference walk (log-probs: the
        walk calls submodules, whose parameters FSDP's root hooks would not gather), then
        resharded."""
        if not self._ready:
            self._setup()
        for m in self.modules:
            m.unshard()
        try:
            yield
        finally:
            for m in self.modules:
                m.reshard()

    def abort(self) -> None:
        # The modules are still unsharded: their parameters are the unsharded ones,
        # holding this step's local gradients. Drop them; the sharded .grad was never
        # touched, so param.grad is as before the step.
        for p in self.root.parameters():
            p.grad = None
        reset = getattr(self.root, "reset_iter_state", None)
        if reset is not None:  # torch >= 2.13: clears FSDP's per-iteration state, reshards
            reset()
        for m in self.modules:
            m.reshard()
        self._set_sync(True)


def make_grad_sync(
    model: torch.nn.Module,
    group=None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    probe: Callable[[torch.nn.Module], torch.Tensor] | None = None,
) -> GradSync:
    """The strategy for ``model``: FSDP2 module, DDP wrapper, or plain module (all-reduce
    over ``group``, or local when torch.distributed is not initialized)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - very old torch
        FSDPModule = ()
    if isinstance(model, FSDPModule):
        return FSDPSync(model, probe)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DDPSync(model, bucket_bytes)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        return AllReduceSync(model.parameters(), group, bucket_bytes)
    return LocalSync(model.parameters())
