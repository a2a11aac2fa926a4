"""The one registry of attention backends: per op, name -> implementation, where it
runs, and what ``"auto"`` picks on each device type.

Ops and their backends (each backend has the signature of its op's dispatcher):

* ``stack_attention`` (:func:`dtree.ops.stack_attention.stack_attention`, dtree's
  attention over the KV stack): ``reference``, ``sdpa``, ``triton``, ``flash-attn``.
* ``varlen_attention`` (:func:`dtree.ops.varlen_attention.varlen_attention`, the
  linearized baseline): ``reference``, ``sdpa``, ``flash``, ``flash-attn``.
* ``tree_mask_attention`` (:func:`dtree.ops.tree_mask_attention.tree_mask_attention`,
  the tree-mask baseline): ``sdpa``, ``flex``.
* ``linear_recurrence`` (:func:`dtree.ops.linear_recurrence.linear_recurrence`, the
  recurrent layers of hybrid models): ``reference``, ``chunked``, ``fla``.

Implementations and their availability checks are named ``"module:function"`` inside
:mod:`dtree.ops` and imported at the call: the registry imports no op module (the ops
import the registry, never the reverse, and no op imports another's backend) and an
optional dependency (Triton, flash-attn) is only imported where it is asked for. :func:`resolve_backend` turns ``"auto"`` or a name into
the name of a backend that runs on a device, or raises a ValueError naming the fix;
the runtime and the baselines call it once per placement, the ops' dispatchers call
:func:`implementation` per call.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["STACK_ATTENTION_PREFERS_FLASH_ATTN", "Backend", "Target", "backend_names", "implementation",
           "resolve_backend"]

# Whether "auto" stack attention on CUDA tries the flash-attn backend (flash-attn-4's
# regions: Hopper or newer, flash-attn-4 installed, 16-bit) before Triton. The 64k
# agentic step of H100 kernel session 4 decides (benchmarks/PERF_NOTES.md); the
# prediction there keeps Triton.
STACK_ATTENTION_PREFERS_FLASH_ATTN = False


@dataclass(frozen=True)
class Target:
    """Where and on what a backend would run: the model's device and dtype and its
    attention shapes (None where the caller does not know them)."""

    device: torch.device
    dtype: torch.dtype | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True)
class Backend:
    """One backend of one op.

    Attributes:
        name: what users pass (``attention="triton"``).
        function: ``"module:function"`` inside :mod:`dtree.ops`, imported at the call.
        unavailable: ``"module:function"`` of its check ``(target: Target) -> reason
            or None``: why it cannot run on ``target``, phrased to follow
            ``attention='<name>'`` and ending with the fix (None: it runs). None: the
            backend runs anywhere (pure torch).
        nondeterministic: ``"module:function"`` of its check ``(target) -> reason or
            None``: why it cannot run deterministically (:mod:`dtree.ops.determinism`);
            None: it always can.
    """

    name: str
    function: str
    unavailable: str | None = None
    nondeterministic: str | None = None


@dataclass(frozen=True)
class _Op:
    label: str  # in messages: "unknown {label} backend"
    backends: dict[str, Backend]
    auto: dict[str, tuple[str, ...]]  # device type -> preference order ("other": any other type)
    option: str = "attention"  # the runtime option that names the backend, in messages


def _op(label: str, backends: list[Backend], auto: dict[str, tuple[str, ...]], option: str = "attention") -> _Op:
    return _Op(label, {b.name: b for b in backends}, auto, option)


_OPS: dict[str, _Op] = {
    "stack_attention": _op(
        "attention",
        [
            Backend("reference", "stack_attention:stack_attention_reference"),
            Backend("sdpa", "stack_attention:stack_attention_sdpa"),
            Backend(
                "triton",
                "stack_attention_triton:stack_attention_triton",
                "stack_attention:triton_unavailable",
                "stack_attention:triton_nondeterministic",
            ),
            Backend(
                "flash-attn", "stack_attention_flash4:stack_attention_flash4", "stack_attention_flash4:flash4_unavailable"
            ),
        ],
        {"cuda": ("flash-attn",) * STACK_ATTENTION_PREFERS_FLASH_ATTN + ("triton", "sdpa"), "other": ("sdpa",)},
    ),
    "varlen_attention": _op(
        "varlen attention",
        [
            Backend("reference", "varlen_attention:varlen_attention_reference"),
            Backend("sdpa", "varlen_attention:varlen_attention_sdpa"),
            Backend("flash", "varlen_attention:varlen_attention_flash", "varlen_attention:flash_unavailable"),
            Backend(
                "flash-attn",
                "varlen_attention_flash:varlen_attention_flash_attn",
                "varlen_attention:flash_attn_unavailable",
            ),
        ],
        # the checks reject CPU themselves; one order everywhere, as the baseline always chose
        {"other": ("flash-attn", "flash", "sdpa")},
    ),
    "tree_mask_attention": _op(
        "tree-mask attention",
        [
            Backend("sdpa", "tree_mask_attention:tree_mask_attention_sdpa"),
            Backend("flex", "tree_mask_attention:tree_mask_attention_flex", "tree_mask_attention:flex_unavailable"),
        ],
        {"other": ("flex", "sdpa")},
    ),
    "linear_recurrence": _op(
        "recurrence",
        [
            Backend("reference", "linear_recurrence:recurrence_reference"),
            Backend("chunked", "linear_recurrence_chunked:recurrence_chunked"),
            Backend(
                "fla",
                "linear_recurrence_fla:recurrence_fla",
                "linear_recurrence_fla:fla_unavailable",
                "linear_recurrence_fla:fla_nondeterministic",
            ),
        ],
        {"cuda": ("fla", "chunked"), "other": ("reference",)},
        option="recurrence",
    ),
}


def _op_of(op: str) -> _Op:
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {tuple(_OPS)}")
    return _OPS[op]


def backend_names(op: str) -> tuple[str, ...]:
    """The backend names of ``op``, in registration order."""
    return tuple(_op_of(op).backends)


def _load(function: str) -> Callable:
    """``"module:function"`` inside :mod:`dtree.ops`, looked up now (a patched module
    attribute is the one that runs)."""
    module, name = function.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def implementation(op: str, name: str) -> Callable:
    """The function of backend ``name`` of ``op`` (its module imported now)."""
    spec = _op_of(op)
    if name not in spec.backends:
        raise ValueError(f"unknown {spec.label} backend {name!r}; choose one of {backend_names(op)}")
    return _load(spec.backends[name].function)


def _unavailable(backend: Backend, target: Target, deterministic: bool = False) -> str | None:
    reason = None if backend.unavailable is None else _load(backend.unavailable)(target)
    if reason is None and deterministic and backend.nondeterministic is not None:
        why = _load(backend.nondeterministic)(target)
        reason = None if why is None else f"is not deterministic here: it {why}"
    return reason


def resolve_backend(
    op: str,
    name: str,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    deterministic: bool = False,
) -> str:
    """The backend of ``op`` to run on ``device`` for ``name``.

    ``"auto"``: the first of the op's preferences (per device type) that runs here:
    the fused kernels first, ``sdpa`` last (stack attention takes Triton only on CUDA,
    not under the interpreter on CPU). A backend name: that name, if it
    runs here. The dtype and shapes refine the checks where a backend depends on them
    (Triton's dtypes and head dims, the ``flash`` probe). ``deterministic`` (deterministic
    mode, :mod:`dtree.ops.determinism`): ``"auto"`` skips backends that cannot run
    deterministically; a named one raises the way torch does.

    Raises:
        ValueError: an unknown name (listing the choices), or a backend that cannot
            run on this target (saying why and what to use instead).
    """
    spec = _op_of(op)
    target = Target(torch.device(device), dtype, num_heads, num_kv_heads, head_dim)
    if name == "auto":
        for candidate in spec.auto.get(target.device.type, spec.auto["other"]):
            if _unavailable(spec.backends[candidate], target, deterministic) is None:
                return candidate
        raise AssertionError(f"no {spec.label} backend runs on {target.device}")  # every op has a portable one
    if name not in spec.backends:
        raise ValueError(f"{spec.option} must be 'auto' or one of {backend_names(op)}, got {name!r}")
    reason = _unavailable(spec.backends[name], target)
    if reason is not None:
        raise ValueError(f"{spec.option}={name!r} {reason}")
    if deterministic:
        why = _unavailable(spec.backends[name], target, deterministic=True)
        if why is not None:
            from .determinism import alert_nondeterministic

            alert_nondeterministic(
                f"{spec.option}={name!r}",
                f"it {why.removeprefix('is not deterministic here: it ')}; use {spec.option}='auto'",
            )
    return name
