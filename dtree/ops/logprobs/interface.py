"""Log-probabilities (and entropies) of given labels from hidden states, without
``[N, vocab]`` logits.

The LM head is an :class:`OutputHead`: either the fused path, a weight (and bias) that
this op multiplies itself, or the module path, any ``nn.Module`` ``[N, H] -> [N, V]``
(a PEFT ``lora.Linear``, a quantized or hooked linear) that this op calls. Either way
the logits then go through the head's transform and the sampling temperature::

    z = softcap(logit_scale * (hidden @ W.T + b)) / temperature
    softcap(x) = final_softcap * tanh(x / final_softcap)      (when final_softcap is set)
    logp[i] = log_softmax(z[i])[labels[i]],  entropy[i] = -sum_v p[i, v] log p[i, v]

:func:`token_logprobs` runs that chunk by chunk: the forward keeps only each row's
log-sum-exp (and entropy), and the backward recomputes a chunk's logits to form its
gradient (``keep_logits``: a call whose rows fit one chunk keeps them instead). Peak
memory is O(chunk x vocab) instead of O(rows x vocab), which for a 152k vocabulary is
the difference between 0.6 GB and tens of GB on a long tree. On the
module path the backward re-runs the module on the chunk with grad and backpropagates
through it (as reentrant ``torch.utils.checkpoint`` does), so the head's own trainable
parameters (LoRA on ``lm_head``) get their gradients; random ops in the module (LoRA
dropout) replay the forward's draws.

Logits are computed in the model dtype (as an HF model's ``lm_head`` does) and
normalized in float32 (float64 for float64 models).
:func:`token_logprobs_reference` is the plain full-logits version, the tests' ground truth.

Fast path: a fused head (``weight``) in float16/bfloat16 on CUDA runs the fused Triton
op (:func:`dtree.ops.logprobs.fused_head.token_logprobs_triton`: cuBLAS matmuls, one pass
of two Triton kernels over each chunk's logits; 2.07x the chunked torch op at
N = 16,384, H = 1536, V = 151,936 on an H100, 3.24x with entropies, with a quarter of
its memory). The chunked torch op stays the path for module heads, CPU, float32 and
float64, and the reference the fused op is tested against (``impl="torch"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...device import rng
from .transform import LogitTransform, compute_dtype

__all__ = [
    "OutputHead",
    "as_output_head",
    "compute_dtype",
    "fused_head_kernel",
    "token_logprobs",
    "token_logprobs_reference",
]

IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True, eq=False)
class OutputHead:
    """The LM head of a model, and the transform its logits go through.

    Exactly one of:
        weight: [V, H] output embedding (a plain ``nn.Linear``'s weight or a tied
            embedding), with ``bias`` [V] or None: the fused path, multiplied here.
        module: an ``nn.Module`` mapping [N, H] -> [N, V] logits (a LoRA-wrapped or
            quantized linear, a linear with hooks): called chunk by chunk; its
            parameters that require grad get their gradients.

    Then, in this order: ``logits * logit_scale`` (Granite's ``1 / logits_scaling``,
    Cohere's ``logit_scale``), and ``final_softcap * tanh(logits / final_softcap)``
    when ``final_softcap`` is set (Gemma 2).
    """

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    module: torch.nn.Module | None = None
    logit_scale: float = 1.0
    final_softcap: float | None = None

    def __post_init__(self) -> None:
        if (self.weight is None) == (self.module is None):
            raise ValueError("OutputHead takes either weight (and bias) or module, not both and not neither")
        if self.module is not None:
            if not isinstance(self.module, torch.nn.Module):
                raise TypeError(
                    f"OutputHead.module must be an nn.Module (its parameters are what get gradients), "
                    f"got {type(self.module).__name__}"
                )
            if self.bias is not None:
                raise ValueError("OutputHead.bias goes with weight; a module adds its own bias")
        if self.weight is not None and self.weight.ndim != 2:
            raise ValueError(f"OutputHead.weight must be [vocab, hidden], got shape {tuple(self.weight.shape)}")
        if not math.isfinite(self.logit_scale) or self.logit_scale == 0:
            raise ValueError(f"logit_scale must be finite and non-zero, got {self.logit_scale}")
        if self.final_softcap is not None and not (self.final_softcap > 0 and math.isfinite(self.final_softcap)):
            raise ValueError(f"final_softcap must be None or a positive number, got {self.final_softcap}")

    @property
    def fused(self) -> bool:
        return self.module is None

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] logits before the transform, in the model dtype."""
        return F.linear(hidden, self.weight, self.bias) if self.module is None else self.module(hidden)


def as_output_head(layer) -> OutputHead:
    """An :class:`OutputHead` from what ``dtree_output_layer()`` returns: an
    ``OutputHead``, or the older ``(weight, bias)`` tuple."""
    if isinstance(layer, OutputHead):
        return layer
    if isinstance(layer, tuple) and len(layer) == 2 and isinstance(layer[0], torch.Tensor):
        return OutputHead(weight=layer[0], bias=layer[1])
    raise TypeError(
        f"dtree_output_layer() must return a dtree.ops.OutputHead or a (weight, bias) tuple, got {type(layer).__name__}"
    )


def _forward_chunks(raw_logits, hidden, labels, transform: LogitTransform, chunk_size: int, with_entropy: bool):
    """(logp [N], entropy [N] or None, lse [N], the last chunk's transformed logits [n, V]) in
    the compute dtype, chunk by chunk."""
    n = hidden.shape[0]
    cdt = compute_dtype(hidden.dtype)
    logp = torch.empty(n, dtype=cdt, device=hidden.device)
    lse = torch.empty(n, dtype=cdt, device=hidden.device)
    ent = torch.empty(n, dtype=cdt, device=hidden.device) if with_entropy else None
    for a in range(0, n, chunk_size):
        b = min(n, a + chunk_size)
        y = raw_logits(hidden[a:b])
        if y.ndim != 2 or y.shape[0] != b - a:
            raise ValueError(f"the LM head mapped [{b - a}, H] hidden states to shape {tuple(y.shape)}, expected [{b - a}, V]")
        z = transform.apply(y.to(cdt))
        lse[a:b] = torch.logsumexp(z, dim=-1)
        logp[a:b] = z.gather(-1, labels[a:b, None]).squeeze(-1) - lse[a:b]
        if ent is not None:
            ent[a:b] = lse[a:b] - torch.sub(z, lse[a:b, None]).exp_().mul_(z).sum(-1)
    return logp, ent, lse, (z if n else None)


def _dlogits(z, lse, ent, labels, g_lp, g_ent, transform: LogitTransform) -> torch.Tensor:
    """d loss / d raw logits of one chunk, [n, V] compute dtype.

    With p = softmax(z): d logp / dz = onehot(label) - p, and
    d entropy / dz = -p * (z - E_p[z]) where E_p[z] = lse - entropy."""
    dz = torch.sub(z, lse[:, None]).exp_()  # p
    if g_ent is not None:
        w = torch.sub(z, (lse - ent)[:, None]).mul_(g_ent[:, None])
        if g_lp is not None:
            w.add_(g_lp[:, None])
        dz.mul_(w).neg_()
    else:
        dz.mul_(-g_lp[:, None])
    if g_lp is not None:
        dz.scatter_add_(-1, labels[:, None], g_lp[:, None])
    return transform.chain_(dz, z)


def _entropy_output(ctx, ent, like: torch.Tensor) -> torch.Tensor:
    if ent is None:  # not asked for: an empty, non-differentiable placeholder output
        ent = like.new_empty(0)
        ctx.mark_non_differentiable(ent)
    return ent


class _FusedHeadLogprobs(torch.autograd.Function):
    """The fused path: logits = hidden @ weight.T + bias, recomputed per chunk in backward
    (``keep_logits`` and one chunk: the forward's, kept)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform: LogitTransform, chunk_size: int, with_entropy: bool,
                keep_logits: bool):
        logp, ent, lse, last = _forward_chunks(
            lambda h: F.linear(h, weight, bias), hidden, labels, transform, chunk_size, with_entropy
        )
        ctx.logits = last if keep_logits and hidden.shape[0] <= chunk_size else None
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.transform, ctx.chunk_size = transform, chunk_size
        ctx.set_materialize_grads(False)
        return logp, _entropy_output(ctx, ent, logp)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        kept, ctx.logits = ctx.logits, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if ent is None:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_h or need_w or need_b):
            return (None,) * 8
        n, cdt = hidden.shape[0], lse.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        # float32 accumulation across chunks
        grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, cdt), device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=cdt, device=bias.device) if (need_b and bias is not None) else None
        for a in range(0, n, ctx.chunk_size):
            b = min(n, a + ctx.chunk_size)
            z = kept if kept is not None else ctx.transform.apply(F.linear(hidden[a:b], weight, bias).to(cdt))
            dy = _dlogits(
                z, lse[a:b], None if ent is None else ent[a:b], labels[a:b],
                None if g_lp is None else g_lp[a:b].to(cdt), None if g_ent is None else g_ent[a:b].to(cdt),
                ctx.transform,
            )
            d = dy.to(hidden.dtype)
            if need_h:
                grad_h[a:b] = d @ weight
            if need_w:
                grad_w += d.t() @ hidden[a:b]
            if grad_b is not None:
                grad_b += dy.sum(0)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


class _ModuleHeadLogprobs(torch.autograd.Function):
    """The module path: logits = module(hidden chunk). The backward re-runs the module
    on each chunk with grad (replaying the forward's random draws) and backpropagates
    the analytic d loss / d logits through it. ``params`` are the module's parameters
    that require grad, passed as inputs so their gradients go through autograd like
    any other (hooks, ``torch.autograd.grad``, DDP all see them)."""

    @staticmethod
    def forward(ctx, hidden, labels, module, transform: LogitTransform, chunk_size: int, with_entropy: bool, *params):
        states: list[rng.RngState] = []
        replay = any(m.training for m in module.modules())  # only a training module draws (dropout)

        def raw_logits(h):
            if replay:
                states.append(rng.capture(h.device))
            return module(h)

        logp, ent, lse, _ = _forward_chunks(raw_logits, hidden, labels, transform, chunk_size, with_entropy)
        ctx.save_for_backward(hidden, labels, lse, ent)
        ctx.module, ctx.params, ctx.states = module, params, states
        ctx.transform, ctx.chunk_size = transform, chunk_size
        ctx.set_materialize_grads(False)
        return logp, _entropy_output(ctx, ent, logp)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, labels, lse, ent = ctx.saved_tensors
        need_h = ctx.needs_input_grad[0]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[6:]) if need]
        nothing = (None,) * (6 + len(ctx.params))
        if ent is None:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_h or wanted):
            return nothing
        n, cdt = hidden.shape[0], lse.dtype
        params = [ctx.params[i] for i in wanted]
        grad_h = torch.empty_like(hidden) if need_h else None
        # float32 accumulation across chunks, cast to each parameter's dtype at the end
        grad_p = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, cdt), device=p.device) for p in params]
        for c, a in enumerate(range(0, n, ctx.chunk_size)):
            b = min(n, a + ctx.chunk_size)
            with torch.enable_grad(), rng.replaying(ctx.states[c] if ctx.states else None, hidden.device):
                h = hidden[a:b].detach().requires_grad_(need_h)
                y = ctx.module(h)
            z = ctx.transform.apply(y.detach().to(cdt))
            dy = _dlogits(
                z, lse[a:b], None if ent is None else ent[a:b], labels[a:b],
                None if g_lp is None else g_lp[a:b].to(cdt), None if g_ent is None else g_ent[a:b].to(cdt),
                ctx.transform,
            )
            inputs = ([h] if need_h else []) + params
            grads = torch.autograd.grad(y, inputs, dy.to(y.dtype), allow_unused=True)
            if need_h:
                grad_h[a:b] = grads[0] if grads[0] is not None else 0
                grads = grads[1:]
            for acc, g in zip(grad_p, grads):
                if g is not None:
                    acc += g
        out = [None] * len(ctx.params)
        for i, p, acc in zip(wanted, params, grad_p):
            out[i] = acc.to(p.dtype)
        return (grad_h, None, None, None, None, None, *out)


def fused_head_kernel(head: OutputHead, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :func:`token_logprobs` (``impl="auto"``) runs the fused Triton op for
    ``head`` with hidden states of ``dtype`` on ``device``: a fused (``weight``) head,
    float16 or bfloat16, CUDA, Triton importable."""
    if not as_output_head(head).fused or dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.device(device).type != "cuda":
        return False
    try:
        from . import triton_kernels as logprobs_triton  # noqa: F401
    except ImportError:
        return False
    return True


def token_logprobs(
    hidden: torch.Tensor,
    head: OutputHead,
    labels: torch.Tensor,
    chunk_size: int = 4096,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(labels[i] | hidden[i])`` (and the entropy of each row's distribution),
    in chunks of ``chunk_size`` rows.

    Args:
        hidden: [N, H] final hidden states (after the model's last norm).
        head: the LM head (an :class:`OutputHead`; a ``(weight, bias)`` tuple is accepted).
        labels: [N] int64 target token ids.
        temperature: logits are divided by it after the head's transform (the
            sampling temperature of the rollouts).
        with_entropy: also return the entropy of every row's distribution.
        impl: ``"auto"`` (the fused Triton op where :func:`fused_head_kernel` says so,
            else the chunked torch op), ``"torch"``, or ``"triton"`` (fused heads only;
            CUDA, or CPU under ``TRITON_INTERPRET=1``).
        keep_logits: a fused head whose ``N`` rows fit one chunk keeps that chunk's logits
            from the forward to the backward instead of recomputing them there (one
            ``2 N H V``-FLOP matmul less, the same gradients bit for bit); True only where the
            backward follows at once, since the ``[N, V]`` buffer lives until it runs.

    Returns:
        ``(logp [N], entropy [N] or None)``, float32 (float64 for float64 inputs), both
        differentiable w.r.t. ``hidden`` and the head's weight, bias or module parameters.
    """
    head = as_output_head(head)
    transform = LogitTransform.of(head, temperature)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "triton" and not head.fused:
        raise ValueError("impl='triton' needs a fused head (OutputHead(weight=...)); a module head runs impl='torch'")
    if impl == "triton" or (impl == "auto" and fused_head_kernel(head, hidden.dtype, hidden.device)):
        from .fused_head import token_logprobs_triton

        return token_logprobs_triton(
            hidden, head.weight, labels, head.bias, logit_scale=head.logit_scale, softcap=head.final_softcap,
            temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size, impl="triton",
            keep_logits=keep_logits,
        )
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=compute_dtype(hidden.dtype))
        return empty, (empty.clone() if with_entropy else None)
    if head.fused:
        logp, ent = _FusedHeadLogprobs.apply(
            hidden, head.weight, head.bias, labels, transform, chunk_size, with_entropy, keep_logits
        )
    else:
        params = [p for p in head.module.parameters() if p.requires_grad]
        logp, ent = _ModuleHeadLogprobs.apply(hidden, labels, head.module, transform, chunk_size, with_entropy, *params)
    return logp, (ent if with_entropy else None)


def token_logprobs_reference(
    hidden: torch.Tensor,
    head: OutputHead,
    labels: torch.Tensor,
    chunk_size: int = 4096,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain version of :func:`token_logprobs` (same signature; ``chunk_size`` unused):
    full ``[N, V]`` logits, autograd for every gradient."""
    head = as_output_head(head)
    transform = LogitTransform.of(head, temperature)
    z = transform.apply(head.raw_logits(hidden).to(compute_dtype(hidden.dtype)))
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, ent
