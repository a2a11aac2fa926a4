"""A SwiGLU MLP in a checkpointed layer's re-run, its gate and up computed in row chunks in the
backward: ``down(silu(gate(x)) * up(x))`` where nothing reads the output (:mod:`dtree.ops.rerun`:
the re-run's outputs only carry its graph).

Contract, for ``x`` [..., H] and plain linear projections ``(weight [N, K], bias [N] or None)``
(HF's ``LlamaMLP``/``Qwen2MLP`` with ``hidden_act="silu"``, in the model dtype)::

    forward:   a zero view [..., H_out]: the value is not computed (no matmul)
    backward:  dx, and every projection's weight and bias gradient, of
               y = down(p),  p = cast(cast(silu(float32(g))) * u),  g = gate(x),  u = up(x)

Why: :class:`dtree.ops.swiglu.SwiGLUDownFunction` in a re-run keeps the re-run's ``gate`` and
``up`` (two ``[T, I]`` tensors, 0.41 GiB for a 12k-token call of qwen2.5-1.5b in bf16) from the
forward to the backward, and ``memory="low"`` peaks in that backward (session S). Here the
forward keeps ``x`` only, and the backward takes :data:`RERUN_CHUNK_ROWS` rows at a time:
``g`` and ``u`` for the chunk (the same matmuls as the forward's, per chunk), ``dp = dy @ W_down``,
the SwiGLU backward written over ``g``, ``u`` and ``dp`` (:mod:`dtree.ops.swiglu.interface`:
dgate, dup, the product), then ``dx`` and the weight gradients of the chunk; the weight
gradients are summed over chunks in float32 and rounded once. Its peak is one chunk's three
``[rows, I]`` tensors and the float32 sums, for the same matmul FLOPs as the forward and backward
it replaces. With one chunk (``T <= RERUN_CHUNK_ROWS``) the values are the other path's bit for bit
but the bias gradients (summed in float32 by torch here, by a Triton kernel there on CUDA).

Reference: :func:`rerun_mlp_reference` (HF's ops in autograd, the output computed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .interface import _backward_in_place

__all__ = ["RERUN_CHUNK_ROWS", "RerunMLPFunction", "rerun_mlp", "rerun_mlp_reference"]

RERUN_CHUNK_ROWS = 4096  # [4096, 1536] x [1536, 8960] still fills an H100; three [4096, I] bf16 buffers: 0.2 GiB
Projection = tuple[torch.Tensor, "torch.Tensor | None"]


def rerun_mlp_reference(x: torch.Tensor, gate: Projection, up: Projection, down: Projection) -> torch.Tensor:
    """HF's ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` as plain autograd ops (the output computed)."""
    return F.linear(F.silu(F.linear(x, *gate)) * F.linear(x, *up), *down)


class _Sums:
    """Float32 sums of per-chunk gradients (none kept for one chunk: its part is the gradient)."""

    def __init__(self, chunks: int) -> None:
        self.chunks, self.sums = chunks, {}

    def add(self, name: str, part: torch.Tensor) -> None:
        if self.chunks == 1:
            self.sums[name] = part
        elif name in self.sums:
            self.sums[name] += part
        else:
            self.sums[name] = part.to(torch.promote_types(part.dtype, torch.float32))

    def get(self, name: str, like: torch.Tensor | None) -> torch.Tensor | None:
        part = self.sums.get(name)
        return None if part is None or like is None else part.to(like.dtype)


class RerunMLPFunction(torch.autograd.Function):
    """Arguments: ``x``, then gate's, up's and down's weight and bias (None where absent)."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, w_down, b_down):
        ctx.save_for_backward(x, w_gate, b_gate, w_up, b_up, w_down, b_down)
        return x.new_zeros(()).expand(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_gate, b_gate, w_up, b_up, w_down, b_down = ctx.saved_tensors
        need = ctx.needs_input_grad
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1]).to(x.dtype)
        total = x2.shape[0]
        sums = _Sums(max(1, -(-total // RERUN_CHUNK_ROWS)))
        dx = torch.empty_like(x2) if need[0] else None
        wd = w_down.to(x.dtype)
        for start in range(0, total, RERUN_CHUNK_ROWS):
            rows = slice(start, min(start + RERUN_CHUNK_ROWS, total))
            xc, dyc = x2[rows], dy2[rows]
            g, u = F.linear(xc, w_gate, b_gate), F.linear(xc, w_up, b_up)
            dp = dyc.mm(wd)
            _backward_in_place(dp, g, u)  # g, u: dgate, dup; dp: the product
            if need[5]:
                sums.add("w_down", dyc.t().mm(dp))
            if dx is not None:
                torch.mm(g, w_gate.to(g.dtype), out=dx[rows]).addmm_(u, w_up.to(u.dtype))
            for name, grad, wanted in (("w_gate", g, need[1]), ("w_up", u, need[3])):
                if wanted:
                    sums.add(name, grad.t().mm(xc))
            for name, grad, wanted in (("b_gate", g, need[2]), ("b_up", u, need[4]), ("b_down", dyc, need[6])):
                if wanted:
                    sums.add(name, grad.sum(0, dtype=torch.promote_types(grad.dtype, torch.float32)))
        return (None if dx is None else dx.view(x.shape), sums.get("w_gate", w_gate), sums.get("b_gate", b_gate),
                sums.get("w_up", w_up), sums.get("b_up", b_up), sums.get("w_down", w_down), sums.get("b_down", b_down))


def rerun_mlp(x: torch.Tensor, gate: Projection, up: Projection, down: Projection) -> torch.Tensor:
    """The MLP of a checkpointed layer's re-run (see the module docstring): ``x`` [..., H], the
    projections' ``(weight, bias or None)`` -> a zero view [..., H_out]; keeps ``x`` and the
    weights. Call it only where nothing reads the output's value.

    Raises:
        ValueError: the projections' shapes do not chain (gate and up [I, H], down [H_out, I]).
    """
    (wg, bg), (wu, bu), (wd, bd) = gate, up, down
    if wg.shape != wu.shape or wg.shape[1] != x.shape[-1] or wd.shape[1] != wg.shape[0]:
        raise ValueError(f"rerun_mlp: gate {tuple(wg.shape)}, up {tuple(wu.shape)} and down {tuple(wd.shape)} "
                         f"do not chain from an input of width {x.shape[-1]}")
    return RerunMLPFunction.apply(x, wg, bg, wu, bu, wd, bd)
