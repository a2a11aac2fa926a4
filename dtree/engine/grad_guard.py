"""Keep ``param.grad`` intact when a training step fails.

A step accumulates into ``param.grad`` over many backward calls, so a failure found
at the end (a non-finite loss, an out-of-memory error) would leave half a step's
gradient behind. ``GradStash`` moves the existing gradients aside first; the step
accumulates into fresh ``.grad`` tensors; ``commit()`` adds the old gradients back
(one add per parameter, and only when there were old gradients), ``restore()``
puts them back untouched.

The price: in a gradient-accumulation loop (``param.grad`` already set when a step
starts) the old gradients and the step's are both alive during the step, one more copy
of the gradients at its peak (the memory policy counts it:
:func:`dtree.plan.memory_policy.step_grad_bytes`). ``RuntimeConfig(grad_guard=False)``
runs steps with :class:`GradInPlace` instead: the step accumulates into ``param.grad``
directly, as a plain PyTorch loop does, and a failed step leaves part of its gradient
there (its error says so). ``grad_guard="host"`` runs :class:`GradHostCopy`: the step
accumulates in place, as unguarded, and the gradients already there are copied to pinned host
memory first (a device-to-host copy on a side stream, overlapped with the step's forward: the
step's first write into a ``.grad`` waits for it); a failed step copies them back. It costs no
device memory, and PCIe time only where the forward is shorter than the copy (53 GB/s on an
H200 host: 58 ms for qwen2.5-1.5b's 3.1 GB), plus one pinning of the host buffer, kept for the
later steps (:func:`release_host_buffer`). Under a memory cap the runtime picks it when the
device copy would make the plan slower, and under ``memory="low"`` when it would make it leaner
(:func:`dtree.plan.step_plan.plan_memory`).
"""

from __future__ import annotations

from typing import Iterable, Self

import torch

from ..config import check_grad_guard
from ..ops.weight_grads import WAIT_BEFORE_WRITE

__all__ = ["KEPT_NOTE", "PARTIAL_NOTE", "GradHostCopy", "GradInPlace", "GradStash", "grad_guard", "release_host_buffer"]

KEPT_NOTE = "param.grad was left as it was before this call"
PARTIAL_NOTE = (
    "param.grad may hold part of this call's gradient (grad_guard=False): clear it (optimizer.zero_grad()) "
    "before the next step"
)


class _Guard:
    """A guard as a context manager: ``commit`` when the block succeeds, ``restore`` when it raises."""

    def commit(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.restore()


class GradStash(_Guard):
    note = KEPT_NOTE

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def releasing_bytes(self) -> float:
        """Bytes :meth:`commit` frees now: the step's gradients that it adds into old ones."""
        seen, total = set(), 0
        for p, old in zip(self.params, self.saved):
            if old is not None and p.grad is not None and id(p.grad) not in seen:
                seen.add(id(p.grad))
                total += p.grad.numel() * p.grad.element_size()
        return float(total)

    def commit(self) -> None:
        """Keep the step's gradients, added to what was there before."""
        for p, old in zip(self.params, self.saved):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)

    def restore(self) -> None:
        """Drop the step's gradients; ``param.grad`` is as before the step."""
        for p, old in zip(self.params, self.saved):
            p.grad = old


class GradInPlace(_Guard):
    """The unguarded form of :class:`GradStash` (``grad_guard=False``): the step accumulates
    into ``param.grad`` as it is; nothing is kept aside, so nothing can be put back."""

    note = PARTIAL_NOTE

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        del params

    def releasing_bytes(self) -> float:
        return 0.0

    def commit(self) -> None:
        pass

    def restore(self) -> None:
        pass


class _PinnedBuffer:
    """One pinned host buffer reused by every step (pinning gigabytes takes longer than a
    step's forward): :meth:`take` hands it out, grown when too small; a second guard alive at
    once gets a buffer of its own. It stays allocated (``release`` frees it)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.lent = False

    def take(self, nbytes: int) -> torch.Tensor:
        if self.lent:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.lent = True
        return self.buffer

    def give_back(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None and buffer is self.buffer:
            self.lent = False

    def release(self) -> None:
        """Free the buffer (the next host-guarded step pins a new one)."""
        self.buffer, self.lent = None, False


_PINNED = _PinnedBuffer()


def release_host_buffer() -> None:
    """Unpin the host buffer that host-guarded steps keep between them (the gradients' size:
    3.1 GB for qwen2.5-1.5b in bf16). Pinning it again costs the next host-guarded step about
    a second per 1.2-1.4 GB (2.2-2.6 s for 3.1 GB on an H200 host)."""
    _PINNED.release()


class GradHostCopy(_Guard):
    """The guard that keeps the old gradients in pinned host memory (``grad_guard="host"``).

    On entering, every ``param.grad`` already set is copied into one pinned host buffer
    ([bytes] uint8, views per gradient, 64-byte aligned) on a side stream, and a hook on each
    such parameter makes the stream that accumulates its gradient wait for that copy (the
    first time it fires; then it is removed). The copies run last parameter first, each with
    its own event, so a hook waits for its own gradient's copy only. The buffer is one pinned
    buffer kept for every step (:class:`_PinnedBuffer`). The step accumulates in place. ``commit`` drops
    the copy; ``restore`` copies it back into the same tensors. Gradients off CUDA are cloned
    (the same semantics, on the host's own memory)."""

    note = KEPT_NOTE

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.saved = [p.grad for p in self.params]
        self.copies: list[torch.Tensor | None] = [None] * len(self.params)
        self._hooks: list = []
        self._done: list = []  # per device, the event after its last copy
        self._sides: list = []  # per device, the stream of the copies
        self._buffer = None
        on_cuda = [i for i, g in enumerate(self.saved) if g is not None and g.is_cuda]
        for i, g in enumerate(self.saved):
            if g is not None and not g.is_cuda:
                self.copies[i] = g.detach().clone()
        if on_cuda:
            self._copy_to_host(on_cuda)

    def _copy_to_host(self, indices: list[int]) -> None:
        offsets, total = {}, 0
        for i in indices:
            offsets[i] = total
            total += -(-self.saved[i].numel() * self.saved[i].element_size() // 64) * 64
        self._buffer = _PINNED.take(total)
        for device in dict.fromkeys(self.saved[i].device for i in indices):
            compute = torch.cuda.current_stream(device)
            side = torch.cuda.Stream(device)
            self._sides.append(side)
            side.wait_stream(compute)  # the gradients as the work queued before the step leaves them
            # last parameters first: a backward writes the head's and the top layers' gradients
            # first, so each hook's own copy is done long before the copies of the layers below it
            with torch.cuda.stream(side):
                for i in reversed([i for i in indices if self.saved[i].device == device]):
                    g, lo = self.saved[i], offsets[i]
                    view = self._buffer[lo:lo + g.numel() * g.element_size()].view(g.dtype).view(g.shape)
                    view.copy_(g.detach(), non_blocking=True)
                    self.copies[i] = view
                    done = torch.cuda.Event()
                    done.record(side)
                    self._hooks.append(self.params[i].register_hook(self._wait_hook(len(self._hooks), done, compute)))
            self._done.append(done)

    def _wait_hook(self, k: int, done: torch.cuda.Event, compute: torch.cuda.Stream):
        def wait(grad: torch.Tensor) -> None:
            stream = torch.cuda.current_stream(grad.device)
            stream.wait_event(done)
            if stream != compute:
                compute.wait_event(done)
            self._hooks[k].remove()
        setattr(wait, WAIT_BEFORE_WRITE, True)  # ops adding into .grad themselves run it first (dtree.ops.weight_grads)
        return wait

    def releasing_bytes(self) -> float:
        return 0.0

    def _wait_copies(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for done in self._done:
            done.synchronize()

    def commit(self) -> None:
        """Keep the step's gradients (already added in place); drop the copy."""
        self._wait_copies()  # the buffer then serves the next step
        self.copies = []
        _PINNED.give_back(self._buffer)

    def restore(self) -> None:
        """Put ``param.grad`` back as before the step, into the tensors it had."""
        self._wait_copies()
        for p, old, copy in zip(self.params, self.saved, self.copies):
            if old is not None:
                old.copy_(copy)
            p.grad = old
        self.copies = []
        _PINNED.give_back(self._buffer)


def grad_guard(params: Iterable[torch.Tensor], guarded: bool | str = True) -> GradStash | GradHostCopy | GradInPlace:
    """A step's guard of ``param.grad`` (``guarded``, one of :data:`dtree.config.GRAD_GUARDS`):
    :class:`GradStash` (True, ``"device"``), :class:`GradHostCopy` (``"host"``) or
    :class:`GradInPlace` (False); its ``note`` ends the step's error messages."""
    check_grad_guard(guarded)
    if guarded is False:
        return GradInPlace(params)
    return GradHostCopy(params) if guarded == "host" else GradStash(params)
