"""Rotary position embeddings of q and k, with HF's roundings, in one launch each way.

Contract (transformers' ``apply_rotary_pos_emb`` of Llama, Qwen2, Qwen3 and Mistral with
``unsqueeze_dim=1``): ``q`` [B, Hq, T, D], ``k`` [B, Hk, T, D], ``cos``/``sin`` [B, T, D]
(D even), every product and sum rounded to the model dtype as HF's eager ops round::

    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    out = cast(cast(x * cos) + cast(rotate_half(x) * sin))

and backward, ``g`` the output's gradient (what autograd computes through HF's ops)::

    dx[:D/2] = cast(cast(g[:D/2] * cos[:D/2]) + cast(g[D/2:] * sin[D/2:]))
    dx[D/2:] = cast(cast(g[D/2:] * cos[D/2:]) - cast(g[:D/2] * sin[:D/2]))

HF's eager path runs ~10 kernels forward and ~20 backward per layer for this (products,
negation, concatenation, the slices' zero-filled gradients and their sums), each a host
dispatch; :class:`RotaryFunction` runs one Triton kernel each way on CUDA
(:mod:`dtree.ops.rotary.triton_kernels`) and the same math in torch elsewhere, and
keeps ``cos`` and ``sin`` only (shared by every layer of a model call).

Tiers: :func:`rotary_reference` (HF's ops, plain autograd), :func:`rotary_torch` (the
torch twin of the kernel), :class:`RotaryFunction` / :func:`rotary`.
"""

from __future__ import annotations

import torch

from ..backends import triton_kernels_for

__all__ = ["RotaryFunction", "rotary", "rotary_reference", "rotary_supported", "rotary_torch"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` as plain autograd ops."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """One tensor's rotation ([B, H, T, D]; ``cos``/``sin`` [B, T, D]) with HF's
    roundings: the forward contract, or with ``backward`` the gradient's."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    if backward:
        return torch.cat((x1 * cos[..., :half] + x2 * sin[..., half:], x2 * cos[..., half:] - x1 * sin[..., :half]), -1)
    return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]), -1)


def rotary_supported(q, k, cos, sin) -> bool:
    """Whether :func:`rotary` takes these inputs (else the caller runs HF's own function):
    4-d q and k of one dtype and head dim, 3-d cos/sin of the same shape as one head's
    [B, T, D], D even, no gradient wanted for cos or sin."""
    return (
        q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.shape[-1] % 2 == 0 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]
        and cos.shape == sin.shape == (q.shape[0], q.shape[2], q.shape[3])
        and not (cos.requires_grad or sin.requires_grad)
    )


def _apply(q, k, cos, sin, backward: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    kernels = triton_kernels_for(cos, __package__)
    if kernels is not None and kernels.takes(q, k, cos, sin):
        return kernels.rotary_apply(q, k, cos, sin, backward)
    return tuple(None if x is None else rotary_torch(x, cos, sin, backward) for x in (q, k))


class RotaryFunction(torch.autograd.Function):
    """(q, k, cos, sin) -> (rotated q, rotated k), keeping ``cos`` and ``sin`` only."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _apply(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return (*_apply(dq, dk, cos, sin, backward=True), None, None)


def rotary(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` (module docstring), inputs checked by
    :func:`rotary_supported`."""
    if not rotary_supported(q, k, cos, sin):
        raise ValueError(
            f"rotary takes q [B, Hq, T, D], k [B, Hk, T, D] and cos/sin [B, T, D] of one dtype (D even); got q "
            f"{tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, cos {tuple(cos.shape)} {cos.dtype}, sin "
            f"{tuple(sin.shape)}"
        )
    return RotaryFunction.apply(q, k, cos, sin)
