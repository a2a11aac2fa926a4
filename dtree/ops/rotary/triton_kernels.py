"""The Triton kernel of :mod:`dtree.ops.rotary`: q and k of one layer rotated in one
launch, forward or backward, with HF's roundings (see the interface's docstring).

One program per (block of ``BLOCK_T`` tokens, head of q or of k, batch row); it reads
both halves of each row and of ``cos``/``sin`` once. Products are rounded to the model
dtype before they are summed, as HF's separate ops round them, and the launch turns off
fused multiply-add so that float32 rounds the same way too. Tests run it under the
Triton interpreter against :func:`dtree.ops.rotary.interface.rotary_torch` (CPU) and
against HF's ops bit for bit in bf16 (GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..backends import triton_runs_on as runs_on
from ..fast_launch import cdiv, fast_launch, next_power_of_2

__all__ = ["rotary_apply", "runs_on", "takes"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_BLOCK_T = 8 if _INTERPRET else 32


def takes(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Both tensors given, on cos's device, unit stride along the head dim everywhere."""
    return (q is not None and k is not None and q.device == k.device == cos.device == sin.device
            and all(t.stride(-1) == 1 for t in (q, k, cos, sin)))


@triton.jit(do_not_specialize=["T"])
def _rotary_kernel(
    Q, K, QO, KO, COS, SIN, T, HQ,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t, sc_b, sc_t, ss_b, ss_t,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BACKWARD: tl.constexpr,
):
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < HALF)
    c = COS + b * sc_b + rows[:, None] * sc_t + cols[None, :]
    s = SIN + b * ss_b + rows[:, None] * ss_t + cols[None, :]
    c1 = tl.load(c, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF, mask=mask, other=0.0).to(tl.float32)
    if head < HQ:
        x = Q + b * sq_b + head * sq_h + rows[:, None] * sq_t + cols[None, :]
        o = QO + b * sqo_b + head * sqo_h + rows[:, None] * sqo_t + cols[None, :]
    else:
        x = K + b * sk_b + (head - HQ) * sk_h + rows[:, None] * sk_t + cols[None, :]
        o = KO + b * sko_b + (head - HQ) * sko_h + rows[:, None] * sko_t + cols[None, :]
    dt = QO.dtype.element_ty
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s2).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) - (x1 * s1).to(dt).to(tl.float32)
    else:
        o1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(o, o1.to(dt), mask=mask)
    tl.store(o + HALF, o2.to(dt), mask=mask)


def rotary_apply(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D] -> (q, k) rotated (forward), or
    their gradients' rotation (``backward``); outputs in the inputs' memory layout."""
    bsz, hq, t, d = q.shape
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if qo.numel() + ko.numel():
        half = d // 2
        fast_launch(
            _rotary_kernel, (cdiv(t, _BLOCK_T), hq + k.shape[1], bsz),
            q, k, qo, ko, cos, sin, t, hq, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            HALF=half, BLOCK_H=next_power_of_2(half), BLOCK_T=_BLOCK_T, BACKWARD=backward,
            num_warps=1 if _INTERPRET else 4, enable_fp_fusion=False,
        )
    return qo, ko
