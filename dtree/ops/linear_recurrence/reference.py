"""The torch references of the linear recurrence (the math of
:mod:`dtree.ops.linear_recurrence.interface`'s docstring): :func:`recurrence_naive`, one
token at a time, what everything is tested against, and :func:`recurrence_reference`,
the ``reference`` backend; the state dtype and the q/k L2 norm every backend shares.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["l2norm", "recurrence_naive", "recurrence_reference", "state_dtype"]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recurrent states and their math: float32, or float64 for float64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (transformers' and FLA's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrence_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    initial: torch.Tensor | None,
    scale: float,
    qk_l2norm: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token, in float32 (or ``dtype``: the all-bf16 form is the
    low-precision reference a fast kernel is held to).

    Args:
        q, k: [T, Hk, K]; v: [T, H, V] with ``H`` a multiple of ``Hk`` (query/key head
            ``h`` serves value heads ``h * H/Hk ...``, as transformers' grouped value heads).
        g: [T, H] or [T, H, K] log decay (<= 0).
        beta: [T, H] delta-rule strengths, or None.
        initial: [H, K, V] or None (zeros).
        scale: multiplies q (after the optional L2 normalization of q and k).

    Returns:
        ([T, H, V] outputs, [H, K, V] final state) in the compute dtype: float32 (float64
        for float64 inputs) unless ``dtype`` says."""
    heads, dtype = v.shape[1], dtype or state_dtype(v.dtype)
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    if q.shape[1] != heads:
        q, k = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (q, k))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    state = v.new_zeros(heads, k.shape[2], v.shape[2]) if initial is None else initial.to(dtype)
    decay = g.exp()
    decay = decay[..., None, None] if g.dim() == 2 else decay[..., None]
    out = []
    for t in range(v.shape[0]):
        state = state * decay[t]
        kt = k[t].unsqueeze(-1)
        if beta is None:
            state = state + kt * v[t].unsqueeze(-2)
        else:
            delta = (v[t] - (state * kt).sum(-2)) * beta[t].to(dtype).unsqueeze(-1)
            state = state + kt * delta.unsqueeze(-2)
        out.append((state * q[t].unsqueeze(-1)).sum(-2))
    return torch.stack(out) if out else v.new_zeros(0, heads, v.shape[2]), state


def recurrence_reference(
    q, k, v, g, beta, cu_seqlens: np.ndarray, initial: torch.Tensor, scale: float, qk_l2norm: bool, dtype=None
):
    """The ``reference`` backend: :func:`recurrence_naive` per sequence of a varlen call
    (``dtype``: its compute dtype).

    ``cu_seqlens`` [N+1] (host), ``initial`` [N, H, K, V]; returns ([T, H, V] in
    ``v.dtype``, [N, H, K, V] in :func:`state_dtype`)."""
    outs, finals = [], []
    for n in range(len(cu_seqlens) - 1):
        a, b = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        o, s = recurrence_naive(
            q[a:b], k[a:b], v[a:b], g[a:b], None if beta is None else beta[a:b], initial[n], scale, qk_l2norm, dtype
        )
        outs.append(o)
        finals.append(s)
    return torch.cat(outs).to(v.dtype), torch.stack(finals)
