"""How an op's backends are registered and picked.

Each op keeps its own :class:`Backends`: a plain dict of name -> function (an optional
backend's function imports its module at the call, so Triton or flash-attn is only
imported where it is asked for), the checks saying why a backend cannot run on a
:class:`Target`, and what ``"auto"`` prefers per device type:

* ``stack_attention`` (:data:`dtree.ops.stack_attention.BACKENDS`): ``reference``,
  ``sdpa``, ``triton``, ``flash-attn``.
* ``linear_recurrence`` (:data:`dtree.ops.linear_recurrence.BACKENDS`): ``reference``, ``fla``.
* the baselines' ``varlen_attention`` and ``tree_mask_attention``
  (:mod:`dtree.baselines.kernels`).

:meth:`Backends.resolve` turns ``"auto"`` or a name into the name of a backend that runs
on a device, or raises a ValueError naming the fix; the runtime and the baselines call it
once per placement, the ops' dispatchers look the function up per call
(:meth:`Backends.function`). :func:`dtree.ops.registry.resolve_backend` does the same by
op name. This module imports no op (the ops import it).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["Backends", "Target", "sm_count", "triton_kernels_for", "triton_runs_on"]


@dataclass(frozen=True)
class Target:
    """Where and on what a backend would run: the model's device and dtype and its
    attention shapes (None where the caller does not know them)."""

    device: torch.device
    dtype: torch.dtype | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None


Check = Callable[[Target], "str | None"]


@dataclass(frozen=True)
class Backends:
    """The backends of one op.

    Attributes:
        label: the op in messages (``"unknown {label} backend"``).
        functions: name (what users pass, ``attention="triton"``) -> the backend, all
            with the op's signature.
        auto: device type -> the names ``"auto"`` tries in order (``"other"``: any other type).
        unavailable: name -> ``(target) -> reason or None``: why it cannot run on ``target``,
            phrased to follow ``attention='<name>'`` and ending with the fix. A name
            missing here runs anywhere (pure torch).
        nondeterministic: name -> ``(target) -> reason or None``: why it cannot run
            deterministically (:mod:`dtree.ops.determinism`); missing: it always can.
        option: the runtime option that names the backend, in messages.
    """

    label: str
    functions: dict[str, Callable]
    auto: dict[str, tuple[str, ...]]
    unavailable: dict[str, Check] = field(default_factory=dict)
    nondeterministic: dict[str, Check] = field(default_factory=dict)
    option: str = "attention"

    def names(self) -> tuple[str, ...]:
        """The backend names, in registration order."""
        return tuple(self.functions)

    def function(self, name: str) -> Callable:
        """The function of backend ``name`` (ValueError listing the names if unknown)."""
        if name not in self.functions:
            raise ValueError(f"unknown {self.label} backend {name!r}; choose one of {self.names()}")
        return self.functions[name]

    def why_not(self, name: str, target: Target, deterministic: bool = False) -> str | None:
        """Why backend ``name`` cannot run on ``target`` (deterministically) (None: it runs)."""
        check = self.unavailable.get(name)
        reason = None if check is None else check(target)
        if reason is None and deterministic and name in self.nondeterministic:
            why = self.nondeterministic[name](target)
            reason = None if why is None else f"is not deterministic here: it {why}"
        return reason

    def resolve(
        self,
        name: str,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        deterministic: bool = False,
    ) -> str:
        """The backend to run on ``device`` for ``name``.

        ``"auto"``: the first of the op's preferences (per device type) that runs here:
        the fused kernels first, ``sdpa`` last. A backend name: that name, if it runs here.
        The dtype and shapes refine the checks where a backend depends on them (Triton's
        dtypes and head dims, the ``flash`` probe). ``deterministic`` (deterministic mode,
        :mod:`dtree.ops.determinism`): ``"auto"`` skips backends that cannot run
        deterministically; a named one raises the way torch does.

        Raises:
            ValueError: an unknown name (listing the choices), or a backend that cannot
                run on this target (saying why and what to use instead).
        """
        target = Target(torch.device(device), dtype, num_heads, num_kv_heads, head_dim)
        if name == "auto":
            for candidate in self.auto.get(target.device.type, self.auto["other"]):
                if self.why_not(candidate, target, deterministic) is None:
                    return candidate
            raise AssertionError(f"no {self.label} backend runs on {target.device}")  # every op has a portable one
        if name not in self.functions:
            raise ValueError(f"{self.option} must be 'auto' or one of {self.names()}, got {name!r}")
        reason = self.why_not(name, target)
        if reason is not None:
            raise ValueError(f"{self.option}={name!r} {reason}")
        if deterministic:
            why = self.why_not(name, target, deterministic=True)
            if why is not None:
                from .determinism import alert_nondeterministic

                alert_nondeterministic(
                    f"{self.option}={name!r}",
                    f"it {why.removeprefix('is not deterministic here: it ')}; use {self.option}='auto'",
                )
        return name


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_KERNEL_MODULES: dict = {}  # (package, device, dtype) -> triton_kernels module or None


def triton_kernels_for(x: torch.Tensor, package: str):
    """The ``triton_kernels`` module of op package ``package`` when ``x`` runs there (a
    kernel dtype, and the module's ``runs_on``: CUDA, or CPU under the Triton interpreter),
    else None: the op's torch kernels (also when Triton is missing). Looked up once per
    package, device and dtype (the ops ask at every call: the import machinery's lookup
    cost 12 ms per step of memory="low" on the 64k tree, H100 host)."""
    key = (package, x.device, x.dtype)
    if key not in _KERNEL_MODULES:
        _KERNEL_MODULES[key] = _kernels_module(package, x.device, x.dtype)
    return _KERNEL_MODULES[key]


def _kernels_module(package: str, device: torch.device, dtype: torch.dtype):
    if dtype not in KERNEL_DTYPES:
        return None
    try:
        module = importlib.import_module(".triton_kernels", package)
    except ImportError:
        return None
    return module if module.runs_on(device) else None


_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device``, read once per device (the kernels size
    their grids by it at every launch; ``torch.cuda.get_device_properties`` costs host time)."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_CAPABLE: dict = {}


def triton_runs_on(device: torch.device) -> bool:
    """Whether the elementwise Triton kernels run on ``device``: CUDA of compute capability
    >= 7.0 (read once per device: the ops ask at every call), or any device under the
    Triton interpreter (``TRITON_INTERPRET=1`` set before import)."""
    if _TRITON_INTERPRET:
        return True
    if device.type != "cuda":
        return False
    if device not in _CAPABLE:
        _CAPABLE[device] = torch.cuda.get_device_capability(device)[0] >= 7
    return _CAPABLE[device]
