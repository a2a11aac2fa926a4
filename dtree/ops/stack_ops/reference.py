"""The KV-stack ops as plain torch ops: the fallback of the CUDA extension (``csrc/``),
with the same contract, and the reference its tests compare it with.

Every function here mirrors one op of ``csrc/stack_ops.cpp`` (``torch.ops.dtree_stack``)
except that slot offsets are host ints (the extension reads them from device memory).
Shapes: a layer's slots are ``[capacity, heads, dim]`` (``KVStack.k[layer]``,
``KVStack.grad_k[layer]``); a call's rows are ``[rows, heads, dim]``, any strides.

Rounding, which the extension reproduces bit for bit: rotary runs in the op-math dtype
(float32 for 16-bit keys) with one rounding to the stack's dtype; gradients are added in
the slots' dtype (float32) and rounded once to the K/V dtype; the segmented reduction
adds each slot's rows one at a time, in row order, starting from the slot's value. No
op here depends on the order of concurrent float adds: all are deterministic.
"""

from __future__ import annotations

import torch

__all__ = ["gather_slots", "push_kv", "rotary", "seed_grad", "segment_add", "zero_slots"]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` on the first ``R = cos.shape[-1]`` dims of
    ``x`` [rows, heads, dim] (the rest pass through), in the dtype of ``cos``/``sin``
    [rows, R] (the op-math dtype of ``x``: float32 for 16-bit ``x``)."""
    r = cos.shape[-1]
    xr = x[..., :r].to(cos.dtype)
    x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    out = xr * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:].to(cos.dtype)), dim=-1)


def push_kv(
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    lo: int,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    """``k_slots[lo : lo + T] = rotary(k)`` (``k`` as it is without ``cos``/``sin``) and
    ``v_slots[lo : lo + T] = v``, converted to the slots' dtype."""
    rows = k.shape[0]
    k_slots[lo : lo + rows].copy_(k if cos is None else rotary(k, cos, sin))
    v_slots[lo : lo + rows].copy_(v)


def seed_grad(
    grad_k_slots: torch.Tensor,
    grad_v_slots: torch.Tensor,
    lo: int,
    gk: torch.Tensor | None,
    gv: torch.Tensor | None,
    rows: int,
    k_dtype: torch.dtype,
    v_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_k_slots[lo : lo + rows] + gk).to(k_dtype)`` and the same for V; a missing
    ``gk`` / ``gv`` adds nothing. New tensors, ``[rows, heads, dim]``."""
    sk, sv = grad_k_slots[lo : lo + rows], grad_v_slots[lo : lo + rows]
    out_k = sk.to(k_dtype) if gk is None else (sk + gk).to(k_dtype)
    out_v = sv.to(v_dtype) if gv is None else (sv + gv).to(v_dtype)
    return out_k, out_v


def zero_slots(grad_k: torch.Tensor, grad_v: torch.Tensor, lo: int, rows: int) -> None:
    """Clear slots ``[lo, lo + rows)`` of every layer of ``grad_k`` / ``grad_v``
    ``[layers, capacity, heads, dim]``."""
    grad_k[:, lo : lo + rows].zero_()
    grad_v[:, lo : lo + rows].zero_()


def segment_add(
    grad_k_slots: torch.Tensor,
    grad_v_slots: torch.Tensor,
    index: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    rank_rows: tuple[torch.Tensor, ...] | None = None,
) -> None:
    """``grad_slots[index[j]] += d[j]`` for every row ``j`` of ``dk`` / ``dv`` (repeated
    slots allowed), each slot's rows added one at a time in row order.

    ``rank_rows``: the rows grouped by occurrence (the first row of every slot, then the
    second, ...), each a LongTensor of rows with distinct slots: one ``index_add_`` per
    group, in order, sums every slot in row order. None: one ``index_add_`` on CPU (serial
    in row order), one sort-based ``index_put_(accumulate=True)`` on CUDA (stable: row order)."""
    dk = dk.to(grad_k_slots.dtype)
    dv = dv.to(grad_v_slots.dtype)
    if rank_rows is None:
        if grad_k_slots.device.type == "cuda":
            grad_k_slots.index_put_((index,), dk, accumulate=True)
            grad_v_slots.index_put_((index,), dv, accumulate=True)
        else:
            grad_k_slots.index_add_(0, index, dk)
            grad_v_slots.index_add_(0, index, dv)
        return
    for rows in rank_rows:
        if rows.shape[0] == index.shape[0]:  # every slot once: no row gather
            grad_k_slots.index_add_(0, index, dk)
            grad_v_slots.index_add_(0, index, dv)
        else:
            grad_k_slots.index_add_(0, index[rows], dk[rows])
            grad_v_slots.index_add_(0, index[rows], dv[rows])


def gather_slots(
    k_slots: torch.Tensor, v_slots: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_slots[index], v_slots[index])``: new ``[n, heads, dim]`` tensors."""
    return k_slots[index], v_slots[index]
