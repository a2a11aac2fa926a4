"""The KV stack's ops: the CUDA extension (``csrc/``, ``torch.ops.dtree_stack``) where it
is built and the tensors are on a GPU; else, on a GPU, the Triton kernels of
:mod:`.stack_ops_triton` for the push and the seed (one launch each); else the torch ops
of :mod:`.stack_ops_torch`. All three have the same contract and give the same bits.

Ops (a layer's slots ``[capacity, heads, dim]``; a call's rows ``[rows, heads, dim]``):

* :func:`push_kv`: a call's K (rotary applied when ``cos``/``sin`` are given) and V
  written into its slots: one kernel for both (two copies, plus the rotary's ops, in torch).
* :func:`seed_grad`: the slots' float32 gradients added to the call's incoming dK/dV and
  rounded to their dtype: one kernel (four ops in torch).
* :func:`zero_slots`: a call's gradient slots cleared in every layer: one kernel (two).
* :func:`segment_add`: rows of dK/dV added into (possibly repeated) slots by a fixed-order
  segmented reduction, no float atomics: deterministic, in one kernel for K and V.
* :func:`gather_slots`: slots read into a new tensor for K and V: one kernel (two).

*Device-side slot offsets.* The extension reads a call's first slot from a one-element
int64 tensor (``device_lo``) instead of baking it into the launch, so a call's stack ops
can be captured in a CUDA graph once and replayed at other offsets by writing that tensor.

*Loading.* ``pip install`` compiles the extension when CUDA torch and nvcc are present
(``setup.py``); importing dtree only imports it, never compiles. When it is missing the
torch ops run (deterministic too, with more launches): :func:`note_missing_extension`
says so once when determinism was asked for. ``DTREE_STACK_OPS=torch`` or
:func:`extension_disabled` turn the extension off (benchmarks and tests compare both).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ...device.transfer import upload
from . import reference as stack_ops_torch

__all__ = [
    "BUILD_COMMAND",
    "SlotRows",
    "extension_disabled",
    "extension_error",
    "gather_slots",
    "note_missing_extension",
    "push_kv",
    "seed_grad",
    "segment_add",
    "uses_extension",
    "zero_slots",
]

BUILD_COMMAND = "pip install --no-build-isolation .  (with a CUDA torch and nvcc; README: 'The CUDA extension')"
_MODULE = "dtree._stack_ops_cuda"
_state = {"loaded": None, "error": None, "tried": False, "disabled": 0, "noted": False}


def _load() -> None:
    _state["tried"] = True
    if os.environ.get("DTREE_STACK_OPS", "").strip().lower() == "torch":
        _state["error"] = "DTREE_STACK_OPS=torch"
        return
    try:
        _state["loaded"] = importlib.import_module(_MODULE)
    except ImportError as e:  # not built (CPU wheel, DTREE_SKIP_CUDA_BUILD, isolated build) or a torch mismatch
        _state["error"] = f"{_MODULE} is not importable ({e})"


def extension_error() -> str | None:
    """Why the extension is not in use (None: it is loaded and enabled)."""
    if not _state["tried"]:
        _load()
    if _state["loaded"] is None:
        return _state["error"]
    return "disabled by extension_disabled()" if _state["disabled"] else None


def uses_extension(t: torch.Tensor) -> bool:
    """Whether the stack ops on ``t``'s device run the extension."""
    return t.is_cuda and extension_error() is None


@contextlib.contextmanager
def extension_disabled():
    """Run the torch ops inside (the extension's comparisons: tests, benchmarks)."""
    _state["disabled"] += 1
    try:
        yield
    finally:
        _state["disabled"] -= 1


def note_missing_extension(device: torch.device | str) -> None:
    """Warn once per process that determinism was asked for on a GPU without the extension
    (the stack ops then run as torch ops: deterministic, but more launches)."""
    if _state["noted"] or torch.device(device).type != "cuda" or extension_error() is None:
        return
    _state["noted"] = True
    warnings.warn(
        f"dtree: deterministic mode without the KV-stack CUDA extension ({extension_error()}): the stack ops run as "
        f"torch ops with the same deterministic results and more launches; to build it: {BUILD_COMMAND}",
        stacklevel=3,
    )


def _ops():
    return torch.ops.dtree_stack


def _device_lo(lo: int, device_lo: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if device_lo is not None:
        return device_lo
    return upload(np.array([lo], dtype=np.int64), device)


def _check_range(what: str, lo: int, rows: int, capacity: int) -> None:
    if lo < 0 or lo + rows > capacity:
        raise ValueError(f"{what}: slots [{lo}, {lo + rows}) are outside the stack's capacity {capacity}")


def push_kv(
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    lo: int,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    device_lo: torch.Tensor | None = None,
) -> None:
    """Write ``k`` [T, heads, Dk] (rotated by ``cos``/``sin`` [T, R], R even <= Dk, HF's
    ``rotate_half`` convention, when given) and ``v`` [T, heads, Dv] into slots
    ``[lo, lo + T)`` of ``k_slots`` / ``v_slots``. ``device_lo``: ``lo`` as a one-element
    int64 tensor on the GPU (read there by the extension)."""
    rows = k.shape[0]
    _check_range("push_kv", lo, rows, k_slots.shape[0])
    if v.shape[0] != rows:
        raise ValueError(f"push_kv: k has {rows} rows and v {v.shape[0]}")
    if (cos is None) != (sin is None):
        raise ValueError("push_kv: give both cos and sin, or neither")
    if cos is not None:
        r = cos.shape[-1]
        if cos.shape != (rows, r) or sin.shape != cos.shape or r % 2 or r > k.shape[-1]:
            raise ValueError(
                f"push_kv: cos and sin must be [{rows}, R] with R even and <= {k.shape[-1]}, got "
                f"{tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        opmath = torch.float64 if k.dtype == torch.float64 else torch.float32
        cos, sin = cos.to(opmath), sin.to(opmath)
    if uses_extension(k_slots) and k.dtype == v.dtype == k_slots.dtype == v_slots.dtype:
        if cos is not None:
            cos, sin = cos.contiguous(), sin.contiguous()
        _ops().push_kv(k_slots, v_slots, _device_lo(lo, device_lo, k.device), _unit_last(k), _unit_last(v), cos, sin)
        return
    if cos is None and k.dtype == k_slots.dtype and v.dtype == v_slots.dtype and _triton_runs(k_slots, v_slots, k, v):
        from . import triton_kernels as stack_ops_triton

        stack_ops_triton.push_kv(k_slots[lo : lo + rows], v_slots[lo : lo + rows], k, v)
        return
    stack_ops_torch.push_kv(k_slots, v_slots, lo, k, v, cos, sin)


def _triton_runs(*tensors: torch.Tensor | None) -> bool:
    """Whether the Triton tier serves these tensors: on a GPU without the extension (or
    under ``TRITON_INTERPRET=1``, the tests), unless the torch ops were asked for
    (``DTREE_STACK_OPS=torch``, :func:`extension_disabled`)."""
    if _state["disabled"] or os.environ.get("DTREE_STACK_OPS", "").strip().lower() == "torch":
        return False
    try:
        from . import triton_kernels as stack_ops_triton
    except ImportError:  # no Triton on this platform
        return False
    present = [t for t in tensors if t is not None]
    return all(stack_ops_triton.runs_on(t) for t in present) and all(t.numel() for t in present)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def seed_grad(
    grad_k_slots: torch.Tensor,
    grad_v_slots: torch.Tensor,
    lo: int,
    gk: torch.Tensor | None,
    gv: torch.Tensor | None,
    rows: int,
    k_dtype: torch.dtype,
    v_dtype: torch.dtype,
    *,
    device_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_k_slots[lo : lo + rows] + gk).to(k_dtype)`` and the same for V (a missing
    ``gk``/``gv`` adds nothing): the call's K/V gradients with what its descendants left
    in the slots. The sum is formed in the slots' dtype and rounded once."""
    _check_range("seed_grad", lo, rows, grad_k_slots.shape[0])
    for name, g, dtype in (("gk", gk, k_dtype), ("gv", gv, v_dtype)):
        if g is not None and g.shape[0] != rows:
            raise ValueError(f"seed_grad: {name} has {g.shape[0]} rows for {rows} slots")
    if uses_extension(grad_k_slots) and _seed_supported(grad_k_slots, grad_v_slots, gk, gv, k_dtype, v_dtype):
        device = grad_k_slots.device
        gk = None if gk is None else _unit_last(gk)
        gv = None if gv is None else _unit_last(gv)
        return _ops().seed_grad(
            grad_k_slots, grad_v_slots, _device_lo(lo, device_lo, device), gk, gv, rows, k_dtype, v_dtype
        )
    sk, sv = grad_k_slots[lo : lo + rows], grad_v_slots[lo : lo + rows]
    if sk.dtype == sv.dtype == torch.float32 and _triton_runs(sk, sv, gk, gv):
        from . import triton_kernels as stack_ops_triton

        return stack_ops_triton.fold_seed(sk, sv, gk, gv, (k_dtype, v_dtype))
    return stack_ops_torch.seed_grad(grad_k_slots, grad_v_slots, lo, gk, gv, rows, k_dtype, v_dtype)


def _seed_supported(sk, sv, gk, gv, k_dtype, v_dtype) -> bool:
    """The dtype combinations the kernel has (the model's: float32 slots under 16/32-bit
    K/V, float64 slots under float64)."""
    wide = torch.float64 if k_dtype == torch.float64 else torch.float32
    return (
        k_dtype == v_dtype
        and sk.dtype == sv.dtype == wide
        and all(g is None or g.dtype == k_dtype for g in (gk, gv))
    )


def zero_slots(
    grad_k: torch.Tensor, grad_v: torch.Tensor, lo: int, rows: int, *, device_lo: torch.Tensor | None = None
) -> None:
    """Clear gradient slots ``[lo, lo + rows)`` of every layer (``[layers, capacity, heads, dim]``)."""
    _check_range("zero_slots", lo, rows, grad_k.shape[1])
    if uses_extension(grad_k) and grad_k.dtype == grad_v.dtype:
        _ops().zero_slots(grad_k, grad_v, _device_lo(lo, device_lo, grad_k.device), rows)
        return
    stack_ops_torch.zero_slots(grad_k, grad_v, lo, rows)


@dataclass(frozen=True)
class SlotRows:
    """The slots that rows of dK/dV are added into, in the order the reduction sums them.

    Attributes:
        index: [n] int64, the slot of each row (repeats allowed).
        sorted_slots, order: [n] int64, ``index`` sorted stably and the rows in that order
            (the extension's segments: one slot's rows are consecutive, in row order).
        rank_rows: per occurrence rank, the rows holding a slot's first, second, ...
            occurrence (the torch fallback's fixed order); None when built on the device.
    """

    index: torch.Tensor
    sorted_slots: torch.Tensor
    order: torch.Tensor
    rank_rows: tuple[torch.Tensor, ...] | None

    @classmethod
    def from_numpy(cls, slots: np.ndarray, device: torch.device | str) -> "SlotRows":
        """From host slots (built once per layout, then reused by every layer)."""
        slots = np.asarray(slots, dtype=np.int64)
        order = np.argsort(slots, kind="stable")
        sorted_slots = slots[order]
        starts = np.flatnonzero(np.r_[True, sorted_slots[1:] != sorted_slots[:-1]]) if len(slots) else np.zeros(0, int)
        run_start = np.repeat(starts, np.diff(np.r_[starts, len(slots)]))
        rank = np.empty(len(slots), dtype=np.int64)
        rank[order] = np.arange(len(slots)) - run_start
        ranks = int(rank.max()) + 1 if len(slots) else 0
        rank_rows = tuple(np.flatnonzero(rank == r) for r in range(ranks))
        packed = upload(np.concatenate([slots, sorted_slots, order, *rank_rows]), device)
        cuts = np.cumsum([len(slots)] * 3 + [len(r) for r in rank_rows])[:-1]
        parts = torch.tensor_split(packed, cuts.tolist())
        return cls(parts[0], parts[1], parts[2], tuple(parts[3:]))

    @classmethod
    def from_tensor(cls, index: torch.Tensor) -> "SlotRows":
        """From device slots (a stable sort there, no host sync)."""
        index = index.to(torch.int64)
        sorted_slots, order = torch.sort(index, stable=True)
        return cls(index, sorted_slots, order, None)


def segment_add(
    grad_k_slots: torch.Tensor, grad_v_slots: torch.Tensor, rows: SlotRows, dk: torch.Tensor, dv: torch.Tensor
) -> None:
    """``grad_slots[rows.index[j]] += d[j]`` for every row ``j`` of ``dk`` [n, heads, Dk] /
    ``dv`` [n, heads, Dv], each slot's rows summed one after another in row order, in the
    slots' dtype: the same bits in every run, with or without the extension."""
    n = rows.index.shape[0]
    if dk.shape[0] != n or dv.shape[0] != n:
        raise ValueError(f"segment_add: {dk.shape[0]} and {dv.shape[0]} rows of dK/dV for {n} slots")
    if uses_extension(grad_k_slots) and grad_k_slots.dtype == grad_v_slots.dtype and dk.dtype == dv.dtype and (
        grad_k_slots.dtype == torch.float64 or (grad_k_slots.dtype == torch.float32 and dk.dtype != torch.float64)
    ):
        _ops().segment_add(grad_k_slots, grad_v_slots, rows.sorted_slots, rows.order, _unit_last(dk), _unit_last(dv))
        return
    stack_ops_torch.segment_add(grad_k_slots, grad_v_slots, rows.index, dk, dv, rows.rank_rows)


def gather_slots(
    k_slots: torch.Tensor, v_slots: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_slots[index], v_slots[index])`` for an int64 ``index`` [n] on the slots' device."""
    if uses_extension(k_slots) and k_slots.dtype == v_slots.dtype and index.dtype == torch.int64:
        return _ops().gather_slots(k_slots, v_slots, index.contiguous())
    return stack_ops_torch.gather_slots(k_slots, v_slots, index)
