"""The KV stack's glue around each attention layer of a model call, one launch each.

Per layer and call, besides the attention kernels, dtree's own work is:

* **push**: the call's K and V (strided views of the model's ``[1, Hkv, T, D]``
  projections) copied into their stack slots (``KVStack.slots``): two ``copy_`` launches
  (``KVStack.store_kv``), one here;
* **seed**: in backward, the stack's float32 gradient slots of the call folded into
  its dK and dV and cast to the model dtype (``(slot + dk).to(dtype)`` for K and V):
  four launches, one here.

That is 4 fewer launches per layer per call (112 per call on a 28-layer model, of the
~3,400 an eager call launches; the 64k-token agentic step of issue 17 launched 29,291
kernels in all). Kept as two small functions, :func:`push_kv` and :func:`fold_seed`,
so a compiled extension can take them over; their torch references,
:func:`push_kv_torch` and :func:`fold_seed_torch`, run off CUDA and are what the
Triton versions are tested against (``tests/test_stack_glue.py``, under the
interpreter).
"""

from __future__ import annotations

import torch

__all__ = ["fold_seed", "fold_seed_torch", "push_kv", "push_kv_torch"]


def push_kv_torch(k_slots: torch.Tensor, v_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Copy ``k`` [T, Hkv, Dk] and ``v`` [T, Hkv, Dv] (any strides) into the stack slices
    ``k_slots`` and ``v_slots`` (contiguous, the same shapes)."""
    k_slots.copy_(k)
    v_slots.copy_(v)


def fold_seed_torch(
    k_slots: torch.Tensor, v_slots: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_slots + gk).to(dtypes[0])``, the same for V (a None gradient adds nothing):
    the float32 sum rounded once."""
    dk = k_slots.to(dtypes[0]) if gk is None else (k_slots + gk).to(dtypes[0])
    dv = v_slots.to(dtypes[1]) if gv is None else (v_slots + gv).to(dtypes[1])
    return dk, dv


def _triton(*tensors: torch.Tensor):
    """The Triton module when every tensor is on a device it runs on, else None."""
    try:
        from . import stack_glue_triton
    except ImportError:
        return None
    ok = all(t is None or stack_glue_triton.runs_on(t) for t in tensors)
    return stack_glue_triton if ok else None


def push_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """:func:`push_kv_torch`, one launch on CUDA."""
    if k.shape != k_slots.shape or v.shape != v_slots.shape:
        raise ValueError(f"K/V of shapes {tuple(k.shape)}, {tuple(v.shape)} for slots {tuple(k_slots.shape)}, "
                         f"{tuple(v_slots.shape)}")
    kernels = _triton(k_slots, v_slots, k, v)
    if kernels is None or k.dtype != k_slots.dtype or v.dtype != v_slots.dtype or k.shape[0] == 0:
        push_kv_torch(k_slots, v_slots, k, v)
    else:
        kernels.push_kv(k_slots, v_slots, k, v)


def fold_seed(
    k_slots: torch.Tensor, v_slots: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fold_seed_torch`, one launch on CUDA."""
    kernels = _triton(k_slots, v_slots, gk, gv)
    if kernels is None or k_slots.numel() == 0 or v_slots.numel() == 0:
        return fold_seed_torch(k_slots, v_slots, gk, gv, dtypes)
    return kernels.fold_seed(k_slots, v_slots, gk, gv, dtypes)
