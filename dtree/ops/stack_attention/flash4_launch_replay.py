"""flash-attn-4's launches for the one-call path (:mod:`.flash4_masked_call`), replayed
for the next calls of the same shapes and mask tables without its per-call Python.

``_flash_attn_fwd`` / ``_flash_attn_bwd`` spend ~0.3-0.5 ms of CPU per call before they
launch anything (argument checks, tile heuristics, the compile key, block-sparsity
normalization, scratch allocation). The one-call path makes one forward and one backward
call per layer with the same shapes and tables in every layer of a model call (and in the
re-run of a checkpointed or recomputed layer), so after the first call of a *key* (kind,
the inputs' shapes, strides and dtypes, the scale, the mask tables' buffer) the later ones
launch the recorded kernels directly:

* the first call of a key runs the interface while its compile caches log what it
  launches (:func:`.flash4_replay.recording`);
* the log becomes a template (:func:`_template`): every tensor argument that *is* one of
  the call's inputs (same address and dtype; out, lse, dq, dk, dv are passed in, never
  allocated by the interface) becomes a slot for the next call's tensor of that role, viewed
  with the recorded shape and strides; the mask tables stay (the key holds their buffer,
  and the template keeps it alive, so no other buffer takes its address); every other
  tensor is the interface's scratch (the backward's dQ accumulator, its preprocess's dP
  sums and base-2 LSE, the GQA dK/dV accumulators), allocated zeroed for each replay as
  the interface allocates it (``torch.zeros``, or written by the preprocess before read),
  all of them views of one buffer (one allocation and one memset, not one per tensor);
* a replay binds each launch's arguments with a binder built with the template
  (:func:`_binder`): only the containers that hold an input or scratch slot are rebuilt;
* a key whose inputs the interface copies (``maybe_contiguous``: misaligned pointers or
  strides), whose scratch overlaps an input (a view the interface made of it), or
  a flash-attn-4 other than the one the ``flash`` extra pins (:data:`VERSION`), keeps
  calling the interface.

One template per kind (forward, backward) is held: a new key replaces the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .flash4_replay import recording

__all__ = ["VERSION", "Flash4LaunchReplay", "tensor_key"]

VERSION = "4.0.0b36"  # the flash-attn-4 whose interface this replays (the ``flash`` extra's pin)


@dataclass(frozen=True)
class _Input:
    """A template's slot: input ``index`` of the call, as a view of ``shape`` and ``stride``."""

    index: int
    shape: tuple
    stride: tuple


@dataclass(frozen=True)
class _Scratch:
    """A template's scratch tensor: allocated zeroed per replay with this layout; ``index``
    says which of the call's scratch tensors (one launch's output is a later one's input)."""

    index: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


_ALIGN = 256  # bytes between the scratch tensors in their one buffer (the caching allocator's alignment is 512)


@dataclass(frozen=True)
class _ScratchLayout:
    """Every scratch tensor of a template as a view into one zeroed buffer: one allocation and
    one memset per replay instead of one each, and one view per dtype plus one
    ``as_strided`` per tensor (each torch op costs ~5 us of host on an H100 host)."""

    nbytes: int
    dtypes: tuple  # the scratch's dtypes, each viewed once
    parts: tuple  # (index into dtypes, element offset, shape, stride) per scratch tensor, by index
    device: torch.device | None

    @staticmethod
    def of(scratch: Sequence[_Scratch]) -> "_ScratchLayout":
        dtypes: list = []
        parts, at = [], 0
        for s in scratch:
            numel = 1 + sum((n - 1) * st for n, st in zip(s.shape, s.stride) if n > 0) if all(s.shape) else 0
            size = s.dtype.itemsize
            if s.dtype not in dtypes:
                dtypes.append(s.dtype)
            parts.append((dtypes.index(s.dtype), at // size, s.shape, s.stride))
            at += -(-numel * size // _ALIGN) * _ALIGN
        return _ScratchLayout(at, tuple(dtypes), tuple(parts), scratch[0].device if scratch else None)

    def allocate(self) -> list[torch.Tensor]:
        """Zeroed tensors of the template's scratch layouts, views of one buffer."""
        if not self.parts:
            return []
        buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        typed = [buf.view(dtype) for dtype in self.dtypes]
        return [typed[d].as_strided(shape, stride, offset) for d, offset, shape, stride in self.parts]


def _ranges_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    def span(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@dataclass
class _Conversion:
    """What :func:`_convert` needs while turning one recorded call into a template."""

    by_address: dict
    kept_storages: set
    inputs: Sequence[torch.Tensor]
    scratch: dict


def _tree_map(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """``x`` (a launch's arguments: nested tuples, lists and NamedTuples such as AuxData)
    with ``leaf`` applied to everything else in it."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_tree_map(a, leaf) for a in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_tree_map(a, leaf) for a in x)
    return leaf(x)


def _convert(x: Any, c: _Conversion):
    """One recorded argument as a template holds it (a module-level function, not a closure
    that recurses through its own cell: that cycle kept the recorded call's inputs, views of
    the KV stack, alive until Python's garbage collector ran, ~2 GiB into the next step on a
    64k tree)."""
    if not isinstance(x, torch.Tensor):
        return x
    i = c.by_address.get((x.data_ptr(), x.dtype))
    if i is not None:
        return _Input(i, tuple(x.shape), tuple(x.stride()))
    if x.untyped_storage().data_ptr() in c.kept_storages:
        return x
    if any(_ranges_overlap(x, t) for t in c.inputs):
        raise LookupError("a view or copy of an input")
    if x.storage_offset() != 0 or x.untyped_storage().nbytes() != x.numel() * x.element_size():
        raise LookupError("a view of the interface's own buffer")
    if id(x) not in c.scratch:
        c.scratch[id(x)] = _Scratch(len(c.scratch), tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
    return c.scratch[id(x)]


def _template(log: list, inputs: Sequence[torch.Tensor], kept: Sequence[torch.Tensor]) -> _Template | None:
    """The replayable form of a recorded call's ``log`` (``[(fn, args)]``), or None where it
    cannot be replayed by substitution. ``inputs``: the call's tensors by role; ``kept``:
    tensors whose buffers stay the same for the key (the mask tables)."""
    c = _Conversion({(t.data_ptr(), t.dtype): i for i, t in enumerate(inputs)},
                    {t.untyped_storage().data_ptr() for t in kept}, inputs, {})
    try:
        launches = [(fn, _tree_map(args, lambda x: _convert(x, c))) for fn, args in log]
    except LookupError:
        return None
    return _Template(launches, list(c.scratch.values()))


def _bind(x: Any, inputs: Sequence[torch.Tensor], scratch: Sequence[torch.Tensor]):
    """A template's argument for this call: its input or scratch tensor, else as held (the
    reference :func:`_binder`'s binders are tested against)."""
    if isinstance(x, _Input):
        t = inputs[x.index]
        return t.as_strided(x.shape, x.stride, t.storage_offset())
    if isinstance(x, _Scratch):
        return scratch[x.index]
    return x


def _binder(x: Any) -> Callable | None:
    """What :func:`_bind` mapped over ``x`` gives, as a function of (inputs, scratch) that
    rebuilds only the containers holding a slot; None where ``x`` holds none (it is passed
    as held). A replay binds each launch's arguments with it (walking the whole argument tree
    per call cost ~60 us of host time per replay on an H100 host)."""
    if isinstance(x, _Input):
        index, shape, stride = x.index, x.shape, x.stride

        def bind_input(inputs, scratch):
            t = inputs[index]
            return t if (t.shape, t.stride()) == (shape, stride) else t.as_strided(shape, stride, t.storage_offset())

        return bind_input
    if isinstance(x, _Scratch):
        index = x.index
        return lambda inputs, scratch: scratch[index]
    if not isinstance(x, (tuple, list)):
        return None
    parts = [(i, b) for i, b in enumerate(map(_binder, x)) if b is not None]
    if not parts:
        return None
    held, kind, named = list(x), type(x), isinstance(x, tuple) and hasattr(x, "_fields")

    def bind_container(inputs, scratch):
        items = held.copy()
        for i, b in parts:
            items[i] = b(inputs, scratch)
        return kind(*items) if named else kind(items)

    return bind_container


class _Template:
    """A recorded call, replayable by substitution: ``launches`` (per launch its compiled
    function and arguments with :class:`_Input` and :class:`_Scratch` slots) and the
    ``scratch`` layouts, held as each launch's binder (:func:`_binder`, built once) and one
    :class:`_ScratchLayout`."""

    def __init__(self, launches: list[tuple[Callable, tuple]], scratch: list[_Scratch]):
        self._bound = [(fn, _binder(args), args) for fn, args in launches]
        self._layout = _ScratchLayout.of(scratch)

    def replay(self, inputs: Sequence[torch.Tensor]) -> None:
        """Launch the recorded kernels on ``inputs`` (the call's tensors by role), with fresh
        zeroed scratch."""
        scratch = self._layout.allocate()
        for fn, bind, args in self._bound:
            fn(*(args if bind is None else bind(inputs, scratch)))


def tensor_key(*tensors: torch.Tensor) -> tuple:
    """The shapes, strides, dtypes, devices and 16-byte alignments of ``tensors`` (part of a
    replay key: the interface copies misaligned inputs)."""
    return tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)


class Flash4LaunchReplay:
    """Runs flash-attn-4 interface calls, replaying the recorded launches of the last call
    of the same key (see the module docstring). ``interface``: ``flash_attn.cute.interface``;
    ``version``: the installed flash-attn-4's."""

    def __init__(self, interface, version: str | None):
        self.fi = interface
        self.enabled = version == VERSION
        self.held: dict[str, tuple[tuple, _Template | None]] = {}  # kind -> (key, template or None)
        self.replays = 0  # calls served by a replay (for tests and reports)

    def run(self, kind: str, key: tuple, inputs: Sequence[torch.Tensor], kept: Sequence[torch.Tensor],
            interface_call: Callable[[], Any]) -> None:
        """One call of ``kind``: ``interface_call()`` writes its results into ``inputs``'
        output tensors; a later call with an equal ``key`` launches the same kernels on its own
        ``inputs`` (same roles, in the same order)."""
        held = self.held.get(kind)
        if held is not None and held[0] == key:
            template = held[1]
            if template is None:
                interface_call()
                return
            template.replay(inputs)
            self.replays += 1
            return
        if not self.enabled:
            interface_call()
            return
        self.held.pop(kind, None)  # the last template's scratch goes before this call allocates its own
        log: list = []
        with recording(self.fi, log):
            interface_call()
        copied = any(self.fi.maybe_contiguous(x) is not x for x in inputs)  # its copies would pass for scratch
        self.held[kind] = (key, None if copied else _template(log, inputs, kept))
