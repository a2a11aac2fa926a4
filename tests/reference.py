"""Ground truth: a transformers model run on each sequence on its own (linearized
training), with per-token losses written here independently of dtree.losses."""

from __future__ import annotations

import torch


def path_logprobs(model, seq: list[int]) -> torch.Tensor:
    """[len-1] log p(s[t] | s[:t]) from a plain HF forward over the one sequence."""
    x = torch.tensor([seq], device=next(model.parameters()).device)
    logits = model(input_ids=x).logits[0, :-1]
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits.to(dt), -1).gather(-1, x[0, 1:, None]).squeeze(-1)


def per_token_loss(kind: str, lp: torch.Tensor, f: dict, **kw) -> torch.Tensor:
    if kind == "nll":
        return -lp
    if kind == "ppo":
        eps = kw.get("clip_eps", 0.2)
        hi = kw.get("clip_eps_high") or eps
        adv = f["advantages"]
        ratio = torch.exp(lp - f["old_logprobs"])
        loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + hi) * adv)
        if kw.get("kl_coef"):
            d = f["ref_logprobs"] - lp
            loss = loss + kw["kl_coef"] * (torch.exp(d) - d - 1)
        return loss
    raise ValueError(kind)


def linearized_step(model, sequences, fields=None, kind="nll", reduction="token_mean", scale=1.0, **kw):
    """Accumulate the linearized loss's gradient into ``model``'s params.

    Returns (loss value, per-sequence log-prob tensors)."""
    fields = fields or {}
    masks, per_seq_terms, lps = [], [], []
    for s, seq in enumerate(sequences):
        lp = path_logprobs(model, list(seq))
        lps.append(lp.detach())
        f = {n: torch.as_tensor(v[s][1:], dtype=lp.dtype, device=lp.device) for n, v in fields.items()}
        m = f.get("loss_mask", torch.ones_like(lp))
        masks.append(m)
        per_seq_terms.append(per_token_loss(kind, lp, f, **kw) * m)
    total_mask = float(sum(m.sum() for m in masks))
    if reduction == "sum":
        loss = sum(t.sum() for t in per_seq_terms)
    elif reduction == "token_mean":
        loss = sum(t.sum() for t in per_seq_terms) / total_mask if total_mask else 0.0 * sum(t.sum() for t in per_seq_terms)
    elif reduction == "sequence_mean":
        active = [(t, m) for t, m in zip(per_seq_terms, masks) if float(m.sum()) > 0]
        loss = sum(t.sum() / m.sum() for t, m in active) / len(active) if active else 0.0 * sum(t.sum() for t in per_seq_terms)
    elif reduction == "seq_mean_token_sum":
        active = [t for t, m in zip(per_seq_terms, masks) if float(m.sum()) > 0]
        loss = sum(t.sum() for t in active) / len(active) if active else 0.0 * sum(t.sum() for t in per_seq_terms)
    else:
        raise ValueError(reduction)
    loss = loss * scale
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    return float(loss.detach() if isinstance(loss, torch.Tensor) else loss), lps


def grad_errors(model, ref_model) -> dict[str, float]:
    """Relative error ||g - g_ref|| / ||g_ref|| of every parameter's gradient.

    The denominator has a floor of 1% of the largest reference gradient norm. Without
    it, a gradient that is nearly 0 by symmetry (q/k of sequences of one repeated
    token: equal value rows make the attention weights irrelevant) turns float32
    rounding noise into a large "relative" error. A real bug moves a gradient by about
    its own size, far above 1e-5 of the floor."""
    ref = dict(ref_model.named_parameters())
    scale = max((r.grad.norm().item() for r in ref.values() if r.grad is not None), default=0.0)
    out = {}
    for name, p in model.named_parameters():
        g, r = p.grad, ref[name].grad
        if g is None and r is None:
            out[name] = 0.0
            continue
        g = torch.zeros_like(p) if g is None else g
        r = torch.zeros_like(p) if r is None else r
        diff = (g - r).norm().item()
        denom = max(r.norm().item(), 1e-2 * scale)
        out[name] = diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))
    return out
