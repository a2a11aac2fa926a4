"""Triton launches without Triton's per-call argument binding.

``kernel[grid](*args, **kw)`` binds every argument, specializes each one, builds a string
key from the specialization and the options, looks the compiled kernel up by it and
builds launch metadata, on every launch. On the H100 machine's host that is tens of
microseconds of Python per launch, and dtree's own kernels launch ~340 times per model
call (norms, SwiGLU, stack attention, stack glue, log-probs): with 4,096-token calls the
profile had the GPU idle 41% of the step (``PERF_NOTES.md``, session F).

:func:`fast_launch` keeps, per jitted function, the compiled kernel for each
*argument class* and launches it through the compiled kernel's own launcher. The class
holds what Triton's specialization reads, and more:

* a tensor: its dtype and whether its address is a multiple of 16;
* an int: whether it is 1, whether it is a multiple of 16, and its width (int32, int64,
  uint64);
* a bool or a float: the type (a bool's value too);
* a constexpr parameter, or any other value: its type and value;
* the launch options (``num_warps``, ``num_stages``, ...) and the current device.

Two launches of one class get the same specialization from Triton, so a hit runs the
kernel Triton would have picked. The reference is ``kernel[grid]`` itself: every first
launch of a class goes through it (compiling if needed) and its compiled kernel is the
one kept; so do launches with a callable grid, under the interpreter, with Triton's
launch hooks installed (proton), or with ``DTREE_FAST_LAUNCH=0`` in the environment.

The class itself is computed two ways. :meth:`_KernelTable.bind` with :func:`argument_class`
per value is the reference (~10 us for a 26-argument launch on a desktop CPU, ~3x that
on the GPU machines' hosts, where GRPO case 1's steps are host-bound: ``PERF_NOTES.md``,
session AO). For each way a call site passes its arguments (how many positionally, which
keywords in which order) a reader is generated once (:func:`_reader`): straight-line code
that reads the same values and builds the same key, guarded by each value's type at its
first launch (a launch of other types takes the reference): ~5 us on that desktop CPU; on an
H200 machine's host one small launch costs 12.8 us with the readers, 20.5 with the reference.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

_ENABLED = os.environ.get("DTREE_FAST_LAUNCH", "1").lower() not in ("0", "false", "off", "no")
_INT_BOUNDS = (-(2**31), 2**31, -(2**63), 2**63)  # Triton's int32 and int64 argument widths
_MAX_CLASSES = 4096  # per kernel: beyond this the table restarts (values of non-constexpr ints never key it)


class _KernelTable:
    """One jitted function's parameter layout, its compiled kernel per argument class and
    its readers (one per way of passing the arguments; None where :meth:`bind` fails)."""

    __slots__ = ("compiled", "constexpr", "defaults", "hits", "name", "names", "positions", "readers")

    def __init__(self, kernel) -> None:
        params = list(kernel.signature.parameters.values())
        name = getattr(getattr(kernel, "fn", None), "__name__", "")
        self.name = name if name.isidentifier() else "kernel"  # it names the generated reader
        self.names = tuple(p.name for p in params)
        self.positions = {name: i for i, name in enumerate(self.names)}
        self.constexpr = tuple(i in set(kernel.constexprs) for i in range(len(params)))
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.compiled: dict[tuple, Any] = {}
        self.readers: dict[tuple, Callable | None] = {}
        self.hits = 0

    def read(self, args: tuple, kwargs: dict, device: int) -> tuple[list, tuple] | None:
        """:meth:`read_reference`'s answer, through the generated reader of this way of
        passing the arguments (the reference where a value's type differs from the reader's
        first launch)."""
        way = (len(args), tuple(kwargs))
        reader = self.readers.get(way, _UNSET)
        if reader is _UNSET:
            bound = self.bind(args, kwargs)
            reader = self.readers[way] = None if bound is None else _reader(self, way, bound[0])
        got = reader(args, kwargs, device) if reader is not None else None
        return got if got is not None else self.read_reference(args, kwargs, device)

    def read_reference(self, args: tuple, kwargs: dict, device: int) -> tuple[list, tuple] | None:
        """(the parameters' values in declaration order, the launch's key on ``device``) from
        :meth:`bind` and :meth:`key`; None where :meth:`bind` is (Triton's own call raises)."""
        bound = self.bind(args, kwargs)
        if bound is None:
            return None
        return bound[0], self.key(bound[0], bound[1], device)

    def key(self, values: list, options: tuple, device: int) -> tuple:
        """The reference key of a launch: the device, the options, then every value's
        :func:`argument_class`, flattened (each class's first item says how many follow)."""
        key = [device, options]
        for value, constexpr in zip(values, self.constexpr):
            cls = argument_class(value, constexpr)
            if type(cls) is tuple:
                key.extend(cls)
            else:
                key.append(cls)
        return tuple(key)

    def bind(self, args: tuple, kwargs: dict) -> tuple[list, tuple] | None:
        """(every parameter's value in declaration order, the launch options), or None
        when a parameter has neither a value nor a default (Triton's own call raises)."""
        values = list(args)
        for name in self.names[len(args):]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                return None
        options = tuple((k, v) for k, v in kwargs.items() if k not in self.positions)
        return values, options


def argument_class(value: Any, constexpr: bool = False) -> Any:
    """What of ``value`` can change Triton's specialization of a launch (module docstring)."""
    if constexpr:
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    kind = type(value)
    if kind is int:
        lo32, hi32, lo64, hi64 = _INT_BOUNDS
        return (int, value == 1, value % 16 == 0, lo32 <= value < hi32, lo64 <= value < hi64)
    if kind is float:
        return float
    return (kind, value)


_UNSET = object()


def _reader(table: _KernelTable, way: tuple[int, tuple], values: list) -> Callable:
    """Generated code for one way of passing ``table``'s arguments (``way``: the number
    passed positionally, the keywords in call order): ``read(args, kwargs, device)`` ->
    (values, key) equal to :meth:`_KernelTable.bind` and :meth:`_KernelTable.key`'s, or
    None when a non-constexpr value's type differs from ``values``' (the first launch's)."""
    count, keywords = way
    sources = [f"args[{i}]" if i < count else f"kwargs[{n!r}]" if n in keywords else f"_defaults[{n!r}]"
               for i, n in enumerate(table.names)]
    env: dict[str, Any] = {"_defaults": table.defaults, "_int": int, "_float": float}
    guards, items = [], []
    lo32, hi32, lo64, hi64 = _INT_BOUNDS
    for i, (value, constexpr) in enumerate(zip(values, table.constexpr)):
        env[f"_t{i}"] = kind = type(value)
        v = f"v{i}"
        if constexpr:  # argument_class(value, constexpr=True)
            items.append(f"type({v}), {v}")
            continue
        guards.append(f"type({v}) is _t{i}")
        if isinstance(value, torch.Tensor):
            items.append(f"{v}.dtype, {v}.data_ptr() % 16 == 0")
        elif kind is int:
            items.append(f"_int, {v} == 1, {v} % 16 == 0, {lo32} <= {v} < {hi32}, {lo64} <= {v} < {hi64}")
        elif kind is float:
            items.append("_float")
        else:
            items.append(f"_t{i}, {v}")
    options = "".join(f"({k!r}, kwargs[{k!r}]), " for k in keywords if k not in table.positions)
    names = "".join(f"v{i}, " for i in range(len(sources)))
    lines = [f"def read_{table.name}(args, kwargs, device):",
             f"    ({names}) = ({''.join(s + ', ' for s in sources)})",
             f"    if not ({' and '.join(guards) or 'True'}):",
             "        return None",
             f"    return [{names}], (device, ({options}), {''.join(item + ', ' for item in items)})"]
    exec("\n".join(lines), env)  # noqa: S102 - code built above from the table's own parameter names
    return env[f"read_{table.name}"]


_TABLES: dict[int, tuple[Any, _KernelTable]] = {}


def _table(kernel) -> _KernelTable | None:
    entry = _TABLES.get(id(kernel))
    if entry is not None and entry[0] is kernel:
        return entry[1]
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - callers import triton first
        return None
    if not isinstance(kernel, JITFunction):  # the interpreter's InterpretedFunction, autotuners
        return None
    table = _KernelTable(kernel)
    _TABLES[id(kernel)] = (kernel, table)
    return table


_RUNTIME_KNOBS: list = []  # [triton.knobs.runtime, whether CUDA is available], filled at the first launch


def _hooks_installed(runtime) -> bool:
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # Triton's HookChain, or a hook set in its place
            return True
    return False


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: ``triton.cdiv`` without its constexpr-function wrapper
    (~3 us a call on the H100's host; the grids of one layer take about 20)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def fast_launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``; the same kernel, with less host time
    on every launch after the first of its argument class (module docstring)."""
    if not _RUNTIME_KNOBS:
        from triton import knobs

        _RUNTIME_KNOBS.extend((knobs.runtime, torch.cuda.is_available()))
    runtime, cuda = _RUNTIME_KNOBS
    table = _table(kernel) if _ENABLED and cuda and type(grid) is tuple else None
    device = torch.cuda.current_device() if table is not None else None
    read = table.read(args, kwargs, device) if table is not None else None
    if read is None or _hooks_installed(runtime):
        kernel[grid](*args, **kwargs)
        return
    values, key = read
    compiled = table.compiled.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # Triton's asynchronous compile mode
            compiled = compiled.result()
        if getattr(compiled, "function", None) is None:  # nothing launchable to keep: Triton's path next time too
            return
        if len(table.compiled) >= _MAX_CLASSES:
            table.compiled.clear()
        table.compiled[key] = compiled
        return
    table.hits += 1
    g0, g1, g2 = (grid + (1, 1))[:3]
    stream = torch._C._cuda_getCurrentRawStream(device)
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)


def launch_counts(kernel) -> tuple[int, int]:
    """(argument classes compiled, launches that reused one) for ``kernel`` in this process."""
    entry = _TABLES.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        return 0, 0
    return len(entry[1].compiled), entry[1].hits
