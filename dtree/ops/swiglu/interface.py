"""The SwiGLU activation ``silu(gate) * up`` and the down projection after it, keeping
neither the SiLU output nor the product for backward.

Contract (transformers' ``LlamaMLP``/``Qwen2MLP``/``MistralMLP``/``Qwen3MLP`` with
``hidden_act="silu"``), in the model dtype with HF's roundings::

    p = cast(cast(silu(float32(gate))) * up)            [..., I]
    y = p @ down_weight.T + down_bias                   [..., H]

HF's eager MLP keeps four ``[T, I]`` tensors per layer for backward: ``gate`` (SiLU's
input), its SiLU, ``up``, and the product (the down projection's input): 8 bytes per
intermediate element in bf16, 71.7 KB per token per layer on qwen2.5-1.5b.
:class:`SiluMulFunction` keeps ``gate`` and ``up`` (Liger's SwiGLU does the same; the
product is still kept by the down projection after it); :class:`SwiGLUDownFunction`
owns the down projection too and keeps ``gate``, ``up`` and the weight only: it
recomputes the product in backward (one elementwise pass, no matmul), 4 bytes per
intermediate element, 35.8 KB per token per layer.

Backward, with ``s = silu(gate)``, ``sig = sigmoid(gate)`` (float32) and ``dp`` the
product's gradient::

    dup   = cast(dp * cast(s))
    dgate = cast(float32(cast(dp * up)) * sig * (1 + gate * (1 - sig)))

Where the saved ``gate`` and ``up`` are read by this backward only, which runs once
(``inputs_owned``: a step's graph, :mod:`dtree.ops.backward_once`, the lean MLP's default in
one chunk; ``output_unused``: a checkpointed layer's re-run, :mod:`dtree.ops.rerun`), the
backward writes ``dgate`` and ``dup`` over them and takes the rows in chunks of
``chunk_rows`` (:data:`CONSUMING_CHUNK_ROWS` unless given), each chunk's ``dp`` in one reused
``[rows, I]`` buffer that then holds its product for the weight gradient (summed over chunks in float32: on
CUDA inside the matmul, :func:`sum_chunk_in_matmul`). During a step the down projection's weight gradient
is added into ``param.grad`` inside its matmul, or the chunks' sum rounded into it once
(:mod:`dtree.ops.weight_grads`).
Its peak is ``gate``, ``up``, one chunk and (past one chunk) the float32 sum, where the
other backward holds four ``[T, I]`` tensors: ``memory="low"`` peaks in the top layer's
re-run of a 12k-token call on qwen2.5-1.5b, and peaked 0.26 GiB lower with this
(8.75 -> 8.49 GiB, ``benchmarks/results/h200/session_s``). A single chunk gives the
same bits as the other backward.

Tiers: :func:`silu_mul_reference` (plain autograd, HF's ops), the autograd functions,
whose elementwise kernels run in Triton on CUDA (:mod:`dtree.ops.swiglu.triton_kernels`) and in
torch elsewhere (:func:`silu_mul_forward_torch`, :func:`silu_mul_backward_torch`), and
:func:`silu_mul` / :func:`swiglu_down`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends import triton_kernels_for
from ..weight_grads import grad_target, product_grad, summed_grad

__all__ = [
    "CONSUMING_CHUNK_ROWS",
    "SiluMulFunction",
    "SwiGLUDownFunction",
    "silu_mul",
    "silu_mul_backward_in_place_torch",
    "silu_mul_backward_torch",
    "silu_mul_forward_torch",
    "silu_mul_reference",
    "sum_chunk_in_matmul",
    "swiglu_down",
    "swiglu_down_reference",
]


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's ``act_fn(gate_proj(x)) * up_proj(x)`` as plain autograd ops."""
    return F.silu(gate) * up


def swiglu_down_reference(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """HF's ``down_proj(act_fn(gate) * up)`` as plain autograd ops."""
    return F.linear(silu_mul_reference(gate, up), weight, bias)


def silu_mul_forward_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul_backward_torch(
    dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in the model dtype (see the module docstring; the math in float32,
    or float64 for float64 inputs, as torch's SiLU)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(acc)
    sig = torch.sigmoid(g)
    dup = dp * F.silu(gate)
    dgate = ((dp * up).to(acc) * sig * (1 + g * (1 - sig))).to(gate.dtype)
    return dgate, dup


CONSUMING_CHUNK_ROWS = 4096  # rows per chunk of a re-run's backward: [4096, 1536] x [1536, 8960] still fills an H100


def silu_mul_backward_in_place_torch(dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """``dp``, ``gate``, ``up`` overwritten with (the product, dgate, dup): the torch
    twin of the in-place Triton kernel (with temporaries)."""
    product = silu_mul_forward_torch(gate, up)
    dgate, dup = silu_mul_backward_torch(dp, gate, up)
    dp.copy_(product)
    gate.copy_(dgate)
    up.copy_(dup)


def _kernels(x: torch.Tensor):
    """The Triton module when ``x`` runs there, else None (the torch kernels)."""
    return triton_kernels_for(x, __package__)


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    kernels = _kernels(gate)
    if kernels is not None and gate.dtype == up.dtype and gate.is_contiguous() and up.is_contiguous():
        return kernels.silu_mul_forward(gate, up)
    return silu_mul_forward_torch(gate, up)


def _backward(
    dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, owned: bool = False, spare: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup). ``owned``: the caller made ``dp`` and the Triton kernel may write
    ``dgate`` over it; ``spare``: a ``[..., I]`` buffer it no longer needs, for ``dup``."""
    kernels = _kernels(gate)
    if kernels is not None and gate.dtype == up.dtype == dp.dtype and all(
        t.is_contiguous() for t in (dp, gate, up)
    ):
        return kernels.silu_mul_backward(dp, gate, up, reuse_dp=owned, spare=spare)
    return silu_mul_backward_torch(dp, gate, up)


def _backward_in_place(dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    kernels = _kernels(gate)
    if kernels is not None:
        kernels.silu_mul_backward_in_place(dp, gate, up)
    else:
        silu_mul_backward_in_place_torch(dp, gate, up)


def _consumable(dy2: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    return gate.dtype == up.dtype == dy2.dtype and gate.is_contiguous() and up.is_contiguous()


def _consuming_backward(
    dy2: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, need_w: bool,
    chunk_rows: int | None = None, target: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dgate, dup, dweight) with dgate and dup written over ``gate`` and ``up``
    (contiguous, [..., I]); ``dy2`` [T, H]. Rows in chunks of ``chunk_rows`` (0: one chunk;
    None: :data:`CONSUMING_CHUNK_ROWS`; see the module docstring). ``target``: the forward's
    weight where its gradient may be added into its ``.grad`` (:mod:`dtree.ops.weight_grads`;
    dweight is then None)."""
    g2, u2 = gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
    total = g2.shape[0]
    rows = CONSUMING_CHUNK_ROWS if chunk_rows is None else (chunk_rows or max(1, total))
    w = weight.to(dy2.dtype)
    buffer = g2.new_empty((min(rows, total), g2.shape[1]))
    dw = None
    chunked = need_w and not 0 < total <= rows
    acc = torch.promote_types(weight.dtype, torch.float32)
    in_matmul = chunked and _sums_in_matmul(dy2, acc)
    summed = None
    if chunked:
        summed = (torch.empty if in_matmul else torch.zeros)(weight.shape, dtype=acc, device=weight.device)
    for start in range(0, total, rows):
        stop = min(start + rows, total)
        dp = torch.mm(dy2[start:stop], w, out=buffer[: stop - start])
        _backward_in_place(dp, g2[start:stop], u2[start:stop])  # dp now holds the product
        if not need_w:
            continue
        if in_matmul:
            sum_chunk_in_matmul(summed, dy2[start:stop].t(), dp, first=start == 0)
        elif summed is None:
            dw = product_grad(dy2[start:stop].t(), dp, weight.dtype, target)
        else:
            summed += dy2[start:stop].t().mm(dp)
    if summed is not None:
        dw = summed_grad(summed, weight.dtype, target)
    return gate, up, dw


def _sums_in_matmul(dy2: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether the chunks' weight gradients add into their float32 sum inside the matmul
    (:func:`sum_chunk_in_matmul`): half-precision inputs on CUDA, where torch's matmuls take
    ``out_dtype`` (the CPU has no such kernel; float32 and float64 inputs sum in their own dtype; ROCm
    builds, where it was never run, keep the add)."""
    return (dy2.is_cuda and torch.version.hip is None and acc == torch.float32
            and dy2.dtype in (torch.bfloat16, torch.float16))


def sum_chunk_in_matmul(summed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``summed`` ([M, N] float32) set to (``first``) or increased by ``a @ b`` (half precision,
    [M, K] and [K, N]) in one matmul that accumulates in float32 and adds in its epilogue: no
    half-precision product rounded before the sum, no zero fill and no separate add kernel per
    chunk (a re-run's backward takes 3-4 chunks per layer on 12k-16k-token calls). Tested
    against the float64 sum of the same products (``tests/test_swiglu.py``)."""
    if first:
        torch.mm(a, b, out_dtype=torch.float32, out=summed)
    else:
        torch.addmm(summed, a, b, out_dtype=torch.float32, out=summed)


class SiluMulFunction(torch.autograd.Function):
    """``silu(gate) * up`` keeping ``gate`` and ``up`` (not the SiLU output)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dp: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = _backward(dp.contiguous(), gate, up)
        return dgate, dup


class SwiGLUDownFunction(torch.autograd.Function):
    """``linear(silu(gate) * up, weight, bias)`` keeping ``gate``, ``up`` and ``weight``;
    the product is recomputed in backward (for ``weight``'s gradient): in its own pass, or,
    where the inputs are owned, in the pass that writes their gradients over them."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, output_unused: bool = False, chunk_rows: int | None = None,
                inputs_owned: bool = False):
        ctx.save_for_backward(gate, up, weight)
        ctx.grad_target = grad_target(weight)
        ctx.has_bias = bias is not None
        ctx.consume_inputs = output_unused or inputs_owned  # only this backward reads gate and up
        ctx.chunk_rows = chunk_rows
        if output_unused:  # a checkpointed layer's re-run (dtree.ops.rerun): only the saved tensors count
            return gate.new_zeros(()).expand(*gate.shape[:-1], weight.shape[0])
        return F.linear(_forward(gate, up), weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_w, need_b = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = db = dgate = dup = None
        if need_b and ctx.has_bias:
            db = dy2.sum(0)
        if ctx.consume_inputs and (need_gate or need_up) and _consumable(dy2, gate, up):
            dgate, dup, dw = _consuming_backward(dy2, gate, up, weight, need_w, ctx.chunk_rows, ctx.grad_target)
            return (dgate if need_gate else None), (dup if need_up else None), dw, db, None, None, None
        product = None
        if need_w:
            product = _forward(gate, up)
            dw = product_grad(dy2.t(), product.reshape(-1, product.shape[-1]), weight.dtype, ctx.grad_target)
        if need_gate or need_up:
            dp = dy2.mm(weight.to(dy2.dtype)).view(gate.shape)
            dgate, dup = _backward(dp, gate, up, owned=True, spare=product)
        return (dgate if need_gate else None), (dup if need_up else None), dw, db, None, None, None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ([..., I] each) that keeps its two inputs only."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return SiluMulFunction.apply(gate, up)


def swiglu_down(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    output_unused: bool = False, chunk_rows: int | None = None, inputs_owned: bool = False,
) -> torch.Tensor:
    """``linear(silu(gate) * up, weight, bias)``: gate, up [..., I], weight [H, I], bias
    [H] or None -> [..., H]; keeps gate, up and the weight only. ``inputs_owned``: ``gate``
    and ``up`` belong to this op's backward, which runs once (:mod:`dtree.ops.backward_once`)
    and writes their gradients over them (pass no tensor anything else reads later),
    ``chunk_rows`` rows at a time (0: all at once; None: :data:`CONSUMING_CHUNK_ROWS`), the
    product over the down projection's input gradient. ``output_unused``: the caller drops the
    output too (a checkpointed layer's re-run, :mod:`dtree.ops.rerun`): the same saved
    tensors, a zero view returned, no matmul; it implies ``inputs_owned``."""
    if chunk_rows is not None and chunk_rows < 0:
        raise ValueError(f"swiglu_down: chunk_rows must be None or >= 0, got {chunk_rows}")
    if gate.shape != up.shape or weight.dim() != 2 or weight.shape[1] != gate.shape[-1]:
        raise ValueError(
            f"swiglu_down: gate {tuple(gate.shape)}, up {tuple(up.shape)} and weight {tuple(weight.shape)} do not match"
        )
    return SwiGLUDownFunction.apply(gate, up, weight, bias, output_unused, chunk_rows, inputs_owned)
