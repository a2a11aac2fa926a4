"""Log-probabilities of given labels from hidden states, without ``[N, vocab]`` logits.

``token_logprobs`` computes ``log_softmax(hidden @ W.T + b)[i, labels[i]]`` chunk by
chunk: the forward keeps only each row's log-sum-exp, and the backward recomputes a
chunk's logits to form its gradient. Peak memory is O(chunk x vocab) instead of
O(rows x vocab), which for a 152k vocabulary is the difference between 0.6 GB and
tens of GB on a long tree.

Logits are computed in the model dtype (as an HF model's ``lm_head`` does) and
normalized in float32 (float64 for float64 models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["compute_dtype", "token_logprobs", "token_logprobs_reference", "token_entropy"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype log-probs and losses are computed in: float32, or float64 for float64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_logprobs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain version: full logits. hidden [N, H], weight [V, H], labels [N] -> [N]."""
    logits = F.linear(hidden, weight, bias).to(compute_dtype(hidden.dtype))
    return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size: int):
        n = hidden.shape[0]
        cdt = compute_dtype(hidden.dtype)
        out = torch.empty(n, dtype=cdt, device=hidden.device)
        lse = torch.empty(n, dtype=cdt, device=hidden.device)
        for a in range(0, n, chunk_size):
            b = min(n, a + chunk_size)
            logits = F.linear(hidden[a:b], weight, bias).to(cdt)
            lse[a:b] = torch.logsumexp(logits, dim=-1)
            out[a:b] = logits.gather(-1, labels[a:b, None]).squeeze(-1) - lse[a:b]
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        n = hidden.shape[0]
        cdt = lse.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # float32 accumulation across chunks; a single chunk needs no buffer
        grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, cdt), device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=cdt, device=bias.device) if (need_b and bias is not None) else None
        for a in range(0, n, ctx.chunk_size):
            b = min(n, a + ctx.chunk_size)
            logits = F.linear(hidden[a:b], weight, bias).to(cdt)
            # d logp_y / d logits = onehot(y) - softmax
            g = grad_out[a:b].to(cdt)
            dlogits = torch.exp(logits - lse[a:b, None]).mul_(-g[:, None])
            dlogits.scatter_add_(-1, labels[a:b, None], g[:, None])
            d = dlogits.to(hidden.dtype)
            if need_h:
                grad_h[a:b] = d @ weight
            if need_w:
                grad_w += d.t() @ hidden[a:b]
            if grad_b is not None:
                grad_b += dlogits.sum(0)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """``log p(labels[i] | hidden[i])`` in chunks of ``chunk_size`` rows.

    Args:
        hidden: [N, H] final hidden states (after the model's last norm).
        weight: [V, H] output embedding; bias: [V] or None.
        labels: [N] int64 target token ids.

    Returns:
        [N] float32 (float64 for float64 inputs) log-probs, differentiable w.r.t.
        ``hidden``, ``weight`` and ``bias``.
    """
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=compute_dtype(hidden.dtype))
    return _ChunkedLogprobs.apply(hidden, weight, bias, labels, chunk_size)


@torch.no_grad()
def token_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, chunk_size: int = 4096
) -> torch.Tensor:
    """Entropy of the next-token distribution of each row, in chunks: [N, H] -> [N]."""
    cdt = compute_dtype(hidden.dtype)
    out = torch.empty(hidden.shape[0], dtype=cdt, device=hidden.device)
    for a in range(0, hidden.shape[0], chunk_size):
        b = min(hidden.shape[0], a + chunk_size)
        logits = F.linear(hidden[a:b], weight, bias).to(cdt)
        logp = torch.log_softmax(logits, dim=-1)
        out[a:b] = -(logp.exp() * logp).sum(-1)
    return out
