"""Checkpointed layers' inputs kept in pinned host memory between a call's forward and its backward.

A checkpointed decoder layer keeps only its ``[T, H]`` input for its re-run
(:mod:`dtree.models.layer_recompute`); with every layer of a call checkpointed those inputs
are most of what the call holds (86 of 93 KB per token on qwen2.5-1.5b in bf16: 1 GiB for a
12k-token call). Under a memory cap they can wait on the host instead: each input is copied
to pinned pages on a side stream while the forward goes on, and copied back in the backward,
the layer below's copy started while the current layer's re-run runs (a prefetch one layer
deep). On the device a call then holds two layer inputs at a time instead of all of them.

The copies are exact (bytes), so the step's gradients are the same bits. What it costs is
PCIe time beside the compute (about 0.7 ms per layer input of a 12k-token call at the
H200's ~53 GB/s) and some host work per layer (a few stream and event calls).

Why pages: pools of pinned pages in power-of-two sizes (:func:`page_size`, up to
:data:`PAGE_BYTES`; a larger tensor takes several) serve every tensor size, so steps over fresh
forests (new call sizes every step) reuse the pages of the steps before them instead of
pinning new memory (pinning 3 GB took 2.2-2.6 s on an H200 host); a page holds its tensor in
one copy (each copy costs host time) and wastes less than the tensor's size. The pools keep
their pages for later steps; :func:`release_host_pages` returns the free ones to the system.

Every copy runs on one side stream per device, in the order they were asked for, so a page
given back after its copy to the device was queued can be filled by a later copy from the
device without waiting on the host. On CPU (tests) the inputs are cloned: the same
bookkeeping, no streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["PAGE_BYTES", "HostCheckpoints", "free_page_bytes", "host_page_bytes", "page_size", "release_host_pages"]

PAGE_BYTES = 64 * 2**20  # one copy per layer input up to 21k tokens of qwen2.5-1.5b (each copy costs host time)
SMALLEST_PAGE = 2**20
FETCH_ALIGN = 512  # each tensor's offset in a unit's fetch buffer: aligned for any dtype and for TMA loads

_FREE_PAGES: dict[int, list[torch.Tensor]] = {}  # page bytes -> free pinned uint8 pages of that size
_HELD = [0]  # bytes of pages this process pinned and still holds (free or in use)
_SIDE: dict = {}  # CUDA device -> the copy stream


def release_host_pages() -> int:
    """Return the free pinned pages to the system; the pages in use stay. Returns how many were
    released. The next step that offloads pins what it needs again."""
    count = sum(len(pages) for pages in _FREE_PAGES.values())
    _HELD[0] -= free_page_bytes()
    _FREE_PAGES.clear()
    return count


def host_page_bytes() -> int:
    """Bytes of pinned host memory this process holds in pages (free or in use)."""
    return _HELD[0]


def free_page_bytes() -> int:
    """Bytes of the pages that are free now (not holding any entry)."""
    return sum(size * len(pages) for size, pages in _FREE_PAGES.items())


def page_size(nbytes: int) -> int:
    """The page size for a tensor of ``nbytes``: the power of two that holds it, from
    :data:`SMALLEST_PAGE` to :data:`PAGE_BYTES` (larger tensors take several of the largest),
    so a page wastes less than its tensor's size and pages of like tensors are shared."""
    size = SMALLEST_PAGE
    while size < min(nbytes, PAGE_BYTES):
        size *= 2
    return size


def _take_page(size: int) -> torch.Tensor:
    try:
        return _FREE_PAGES[size].pop()  # one call (atomic under the GIL): backward runs on another thread
    except (KeyError, IndexError):
        pass
    _HELD[0] += size
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _give_pages(pages: list[torch.Tensor]) -> None:
    for page in pages:
        _FREE_PAGES.setdefault(page.numel(), []).append(page)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class _Entry:
    """One offloaded tensor: its unit in its group (the layer call that put it), its pages
    (CUDA) or its clone (CPU), its shape and dtype, and its copy back to the device once asked
    for (with the event that ends it)."""

    __slots__ = ("clone", "device", "dtype", "fetched", "nbytes", "pages", "ready", "shape", "taken", "unit")

    def __init__(self, tensor: torch.Tensor, unit: int) -> None:
        self.unit = unit
        self.taken = False
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.pages: list[torch.Tensor] = []
        self.clone: torch.Tensor | None = None
        self.fetched: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class HostCheckpoints:
    """The offloaded tensors of one model call, in forward order, by unit (a layer call).

    :meth:`put` takes a tensor (``[T, H]``-like, any shape and dtype) and returns its entry;
    :meth:`get` returns the tensor again (on its device, the same bits) and starts the copies of
    the unit put before it, which a backward in reverse layer order asks for next. Every put is
    its own unit, except inside :meth:`unit`, whose puts share one (a checkpointed layer's input
    and the attention outputs it keeps, :mod:`dtree.ops.stack_attention.output_memo`: all of
    them are read by the same re-run, so all are prefetched together).
    """

    def __init__(self) -> None:
        self._units: list[list[_Entry]] = []
        self._open = False

    def __del__(self) -> None:  # a call whose backward never ran (an error): its pages go back
        for unit in self._units:
            for entry in unit:
                if entry.pages:
                    _give_pages(entry.pages)
                    entry.pages = []

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        """While the block runs, every put joins one new unit."""
        self._units.append([])
        self._open = True
        try:
            yield
        finally:
            self._open = False

    def put(self, tensor: torch.Tensor) -> _Entry:
        if not self._open:
            self._units.append([])
        entry = _Entry(tensor, len(self._units) - 1)
        if tensor.device.type == "cuda":
            self._to_host(entry, tensor)
        else:
            entry.clone = tensor.detach().clone()
        self._units[-1].append(entry)
        return entry

    def get(self, entry: _Entry) -> torch.Tensor:
        """The tensor ``entry`` holds, ready on the current stream; the entry is done after (a
        RuntimeError if it was taken before: a graph backpropagated twice)."""
        if entry.taken:
            raise RuntimeError(
                "an offloaded checkpoint was asked for twice: a checkpointed layer with its inputs on the host "
                "(offload_checkpoints) backpropagates once; run backward(retain_graph=True) with "
                "offload_checkpoints=False"
            )
        entry.taken = True
        if entry.clone is not None:
            out, entry.clone = entry.clone, None
            return out
        if entry.fetched is None:
            self._to_device(entry.unit)
        if entry.unit:  # the unit below is the next one a backward re-runs
            self._to_device(entry.unit - 1)
        torch.cuda.current_stream(entry.device).wait_event(entry.ready)
        out, entry.fetched = entry.fetched, None
        return out.view(entry.dtype).view(entry.shape)

    def _to_host(self, entry: _Entry, tensor: torch.Tensor) -> None:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        current, side = torch.cuda.current_stream(tensor.device), _side_stream(tensor.device)
        side.wait_stream(current)  # the tensor's producer has run
        size = page_size(entry.nbytes)
        with torch.cuda.stream(side):
            for start in range(0, entry.nbytes, size):
                page = _take_page(size)
                n = min(size, entry.nbytes - start)
                page[:n].copy_(flat[start:start + n], non_blocking=True)
                entry.pages.append(page)
        flat.record_stream(side)  # its memory is not handed out again before the copies ran

    def _to_device(self, unit: int) -> None:
        """Start the copies of ``unit``'s entries still on the host back to the device, into one
        buffer: a unit's tensors live and die together (one layer's re-run and backward), and
        one block per unit leaves the compute stream's pool fewer holes than one per tensor."""
        entries = [e for e in self._units[unit] if e.fetched is None and e.pages]
        if not entries:
            return
        device = entries[0].device
        current, side = torch.cuda.current_stream(device), _side_stream(device)
        spans = [-(-e.nbytes // FETCH_ALIGN) * FETCH_ALIGN for e in entries]
        buffer = torch.empty(sum(spans), dtype=torch.uint8, device=device)
        side.wait_stream(current)  # the block's earlier users on the current stream are done
        ready = torch.cuda.Event()
        with torch.cuda.stream(side):
            offset = 0
            for entry, span in zip(entries, spans):
                out, start = buffer[offset:offset + entry.nbytes], 0
                for page in entry.pages:
                    n = min(page.numel(), entry.nbytes - start)
                    out[start:start + n].copy_(page[:n], non_blocking=True)
                    start += n
                entry.fetched, offset = out, offset + span
            ready.record(side)
        buffer.record_stream(side)
        for entry in entries:
            entry.ready = ready
            _give_pages(entry.pages)  # later copies into them queue behind this one on the same stream
            entry.pages = []
