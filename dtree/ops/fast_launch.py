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
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

_ENABLED = os.environ.get("DTREE_FAST_LAUNCH", "1").lower() not in ("0", "false", "off", "no")
_MAX_CLASSES = 4096  # per kernel: beyond this the table restarts (values of non-constexpr ints never key it)


class _KernelTable:
    """One jitted function's parameter layout and its compiled kernel per argument class."""

    __slots__ = ("compiled", "constexpr", "defaults", "hits", "names", "positions")

    def __init__(self, kernel) -> None:
        params = list(kernel.signature.parameters.values())
        self.names = tuple(p.name for p in params)
        self.positions = {name: i for i, name in enumerate(self.names)}
        self.constexpr = tuple(i in set(kernel.constexprs) for i in range(len(params)))
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.compiled: dict[tuple, Any] = {}
        self.hits = 0

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
        return (int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31, -(2**63) <= value < 2**63)
    if kind is float:
        return float
    return (kind, value)


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
    bound = table.bind(args, kwargs) if table is not None else None
    if bound is None or _hooks_installed(runtime):
        kernel[grid](*args, **kwargs)
        return
    values, options = bound
    device = torch.cuda.current_device()
    key = (device, options, tuple(map(argument_class, values, table.constexpr)))
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
