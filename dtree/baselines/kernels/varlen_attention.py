"""Causal attention over packed variable-length sequences: the linearized baseline's op.

Several sequences are concatenated along the token axis with no padding. Sequence
``i`` holds rows ``[cu_seqlens[i], cu_seqlens[i+1])`` and attends causally within
itself only. This is what "remove padding" trainers (verl, OpenRLHF, TRL) run through
flash-attn's varlen kernel.

Backends, all with the signature of :func:`dtree.baselines.kernels.varlen_interface.varlen_attention`:

* ``reference``: pure torch, float32 math, one sequence at a time. The ground truth.
* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` per sequence. Any device.
* ``flash``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen inside),
  one kernel for the whole pack. CUDA, float16/bfloat16. Its signature changed between
  torch releases (2.10/2.11: ``is_causal=True``, no ``scale``/``enable_gqa``; 2.12+:
  ``window_size=(-1, 0)`` for causal, ``scale``, ``enable_gqa``); both are supported.
* ``flash-attn``: the flash-attn package's ``flash_attn_varlen_func``
  (:mod:`dtree.baselines.kernels.varlen_attention_flash`), as verl and OpenRLHF call it, when it is
  installed. CUDA, float16/bfloat16.

The per-sequence math is the one of :mod:`dtree.ops.stack_attention` with no prefix
(``attend_math`` / ``attend_sdpa``), so the baselines and dtree share it.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

from ...device.transfer import upload
from ...ops.backends import Target
from ...ops.stack_attention.attention_math import attend_math, attend_sdpa
from ...ops.stack_attention.options import check_packed_qkv

__all__ = [
    "VarlenLayout",
    "flash_attn_available",
    "flash_attn_impl",
    "flash_attn_unavailable",
    "flash_available",
    "flash_unavailable",
    "installed_flash_attn",
    "varlen_attention_flash",
    "varlen_attention_reference",
    "varlen_attention_sdpa",
]

FLASH_DTYPES = (torch.float16, torch.bfloat16)


class VarlenLayout:
    """Sequence boundaries of one packed call (host side, plus a cached device copy).

    Args:
        cu_seqlens: [S+1] row offsets: 0 first, strictly increasing (no empty sequence).
    """

    def __init__(self, cu_seqlens) -> None:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and hold at least 2 offsets, got {cu.tolist()}")
        lengths = np.diff(cu)
        if np.any(lengths <= 0):
            i = int(np.flatnonzero(lengths <= 0)[0])
            raise ValueError(f"cu_seqlens must be strictly increasing: sequence {i} has {int(lengths[i])} tokens")
        self.cu_seqlens = cu
        self.max_len = int(lengths.max())
        self._device: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_lengths(cls, lengths) -> "VarlenLayout":
        return cls(np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]))

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def device_offsets(self, device: torch.device) -> torch.Tensor:
        """[S+1] int32 ``cu_seqlens`` on ``device``, copied once (asynchronously) and cached."""
        if device not in self._device:
            self._device[device] = upload(self.cu_seqlens.astype(np.int32), device)
        return self._device[device]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout) -> None:
    check_packed_qkv(q, k, v, layout.num_tokens, "cu_seqlens")


def _per_sequence(q, k, v, layout: VarlenLayout, scale: float, core) -> torch.Tensor:
    _check(q, k, v, layout)
    cu = layout.cu_seqlens.tolist()
    outs = [core(q[a:b], k[a:b], v[a:b], scale) for a, b in zip(cu[:-1], cu[1:])]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float
) -> torch.Tensor:
    """Pure-torch packed causal attention, float32 math (float64 for float64 inputs).

    Args:
        q: [T, Hq, D] packed queries; k, v: [T, Hkv, D] (``Hq`` a multiple of ``Hkv``).
        layout: the sequences' row offsets.
        scale: softmax scale.

    Returns:
        [T, Hq, D] in ``q.dtype``; row ``r`` of sequence ``i`` attends to rows
        ``cu_seqlens[i] .. r``.
    """
    return _per_sequence(q, k, v, layout, scale, attend_math)


def varlen_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float
) -> torch.Tensor:
    """``scaled_dot_product_attention(is_causal=True)`` per sequence; shapes as
    :func:`varlen_attention_reference`."""
    return _per_sequence(q, k, v, layout, scale, attend_sdpa)


@functools.lru_cache(maxsize=None)
def _varlen_api():
    """(varlen_attn, names of its parameters), or None when this torch has no varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float
) -> torch.Tensor:
    """One FlashAttention-2 varlen kernel over the whole pack; shapes as
    :func:`varlen_attention_reference`. CUDA tensors in float16/bfloat16."""
    _check(q, k, v, layout)
    api = _varlen_api()
    if api is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10); "
            "use attention='sdpa'"
        )
    if q.device.type != "cuda" or q.dtype not in FLASH_DTYPES:
        raise ValueError(
            f"the flash varlen backend needs CUDA float16/bfloat16 tensors, got {q.dtype} on {q.device}; "
            "use attention='sdpa'"
        )
    varlen_attn, params = api
    return _call_varlen(varlen_attn, params, q, k, v, layout, scale)


def _call_varlen(varlen_attn, params: frozenset[str], q, k, v, layout: VarlenLayout, scale: float) -> torch.Tensor:
    """Call ``varlen_attn`` through whichever signature this torch has (``params``: the
    names of its parameters)."""
    kwargs = {}
    if "window_size" in params:  # torch >= 2.12: causal is the window (-1 left, 0 right)
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:  # torch 2.10 / 2.11
        kwargs["is_causal"] = True
    else:
        raise RuntimeError(f"unrecognised varlen_attn signature in torch {torch.__version__}: {sorted(params)}")
    head_dim = q.shape[-1]
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale != head_dim**-0.5:  # older kernels always use 1/sqrt(D): fold the difference into q
        q = q * (scale * head_dim**0.5)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older kernels: give every query head its own K/V copy
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu = layout.device_offsets(q.device)
    return varlen_attn(q, k, v, cu, cu, layout.max_len, layout.max_len, **kwargs)


_PROBED: dict[tuple, bool] = {}


def flash_available(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the ``flash`` backend runs here for these shapes: CUDA, float16/bfloat16,
    a torch with ``varlen_attn``, and one tiny forward + backward that succeeds (the
    kernel also needs a supported GPU and head_dim). Cached per argument tuple."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in FLASH_DTYPES or _varlen_api() is None:
        return False
    key = (device, dtype, num_heads, num_kv_heads, head_dim)
    if key not in _PROBED:
        try:
            q = torch.randn(5, num_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(5, num_kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(5, num_kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
            varlen_attention_flash(q, k, v, VarlenLayout([0, 2, 5]), head_dim**-0.5).sum().backward()
            _PROBED[key] = True
        except (RuntimeError, ValueError):
            _PROBED[key] = False
    return _PROBED[key]


@functools.lru_cache(maxsize=None)
def installed_flash_attn():
    """(implementation name, flash_attn_varlen_func) of the installed flash-attn, or None."""
    try:
        from flash_attn import flash_attn_varlen_func

        return "flash-attn-2", flash_attn_varlen_func
    except ImportError:
        pass
    try:
        from flash_attn.cute import flash_attn_varlen_func

        return "flash-attn-4", flash_attn_varlen_func
    except ImportError:
        return None


def flash_attn_impl() -> str | None:
    """``"flash-attn-2"``, ``"flash-attn-4"`` or None: which flash-attn this process can import."""
    found = installed_flash_attn()
    return None if found is None else found[0]


def flash_attn_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the ``flash-attn`` backend runs here: the flash-attn package importable,
    CUDA, float16/bfloat16, head dims up to 256."""
    if torch.device(device).type != "cuda" or dtype not in FLASH_DTYPES or head_dim > 256:
        return False
    return flash_attn_impl() is not None


def flash_unavailable(target: Target) -> str | None:
    """Why the ``flash`` backend cannot run on ``target`` (None: it runs; see
    :func:`flash_available`)."""
    shapes = (target.num_heads, target.num_kv_heads, target.head_dim)
    if target.dtype is not None and None not in shapes and flash_available(target.device, target.dtype, *shapes):
        return None
    return (
        f"needs torch.nn.attention.varlen.varlen_attn (torch >= 2.10) on a CUDA GPU it supports, with a "
        f"float16/bfloat16 model; this one is {target.dtype} on {target.device} (torch {torch.__version__}). "
        "Use attention='sdpa'"
    )


def flash_attn_unavailable(target: Target) -> str | None:
    """Why the ``flash-attn`` backend cannot run on ``target`` (None: it runs; see
    :func:`flash_attn_available`)."""
    if target.dtype is not None and target.head_dim is not None:
        if flash_attn_available(target.device, target.dtype, target.head_dim):
            return None
    return (
        f"needs the flash-attn package (pip install flash-attn) and a CUDA model in float16/bfloat16; this one is "
        f"{target.dtype} on {target.device}. Use attention='auto' or 'sdpa'"
    )
