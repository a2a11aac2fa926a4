"""Ground truth for the RL losses: HF run on every sequence on its own, the per-token
losses and aggregations written the way TRL (GRPOTrainer._compute_loss) writes them,
and verl's names through verl's own code (tests/verl_reference.py: ``core_algos`` when
verl is installed, its written copy otherwise), on padded [S, T] tensors, independently
of dtree. verl's whole actor loss is tests/test_losses_verl.py's."""

from __future__ import annotations

import torch
from reference import path_logprobs
from verl_reference import agg_loss as verl_agg_loss
from verl_reference import kl_penalty as verl_kl_penalty

VERL_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def padded(rows: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """[S, T] right-padded stack of 1-D tensors (keeps autograd)."""
    width = max(1, max(len(r) for r in rows))
    return torch.stack([torch.cat([r, r.new_full((width - len(r),), value)]) for r in rows])


def path_logprobs_entropy(model, seq: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([len-1] log-probs, [len-1] entropies) of ``softmax(logits / temperature)``, one HF
    forward over the one sequence; both differentiable."""
    x = torch.tensor([seq], device=next(model.parameters()).device)
    logits = model(input_ids=x).logits[0, :-1]
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp_all = torch.log_softmax(logits.to(dt) / temperature, -1)
    return logp_all.gather(-1, x[0, 1:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def batch_tensors(model, seqs, fields, temperature: float | None = None):
    """Per-path HF log-probs and the fields as padded [S, T] prediction-aligned tensors
    (column j is the prediction of token j + 1); ``mask`` is the loss mask there. With
    ``temperature``, log-probs and ``entropy`` are those of ``logits / temperature``."""
    if temperature is None:
        lps, ents = [path_logprobs(model, list(s)) for s in seqs], None
    else:
        lps, ents = zip(*(path_logprobs_entropy(model, list(s), temperature) for s in seqs))
    dt = lps[0].dtype

    def field(name, default=None):
        if name not in fields:
            return None if default is None else padded([torch.full((len(s) - 1,), default, dtype=dt) for s in seqs])
        return padded([torch.as_tensor(v, dtype=dt)[1:] for v in fields[name]])

    lp = padded(lps)
    real = padded([torch.ones(len(s) - 1, dtype=dt) for s in seqs])
    mask = field("loss_mask", 1.0) * real
    return dict(
        lp=lp, mask=mask, adv=field("advantages"), old=field("old_logprobs"), ref=field("ref_logprobs"),
        entropy=padded(list(ents)) if ents is not None else None,
    )


def kl_estimate(lp, ref, estimator):
    """dtree's kl_estimator names: "k3" (and "k3+") is TRL's unclamped estimator,
    written out; every other name is verl's, through verl's kl_penalty (verl's own
    "k3" is dtree's "low_var_kl")."""
    if estimator.rstrip("+") != "k3":
        return verl_kl_penalty(lp, ref, estimator)
    value = torch.exp(ref - lp) - (ref - lp) - 1
    if not estimator.endswith("+"):
        return value
    back = 0.5 * (lp - ref).square()
    return back - back.detach() + value.detach()


def loss_matrix(t: dict, variant: str, **kw) -> torch.Tensor:
    """[S, T] per-token loss of ``variant`` (TRL's ppo, cispo_trl, sapo, gspo)."""
    lp, old, adv, mask = t["lp"], t["old"], t["adv"], t["mask"]
    log_ratio = lp - old
    if kw.get("log_ratio_clip"):
        log_ratio = torch.clamp(log_ratio, -kw["log_ratio_clip"], kw["log_ratio_clip"])
    if variant == "gspo":  # TRL, importance_sampling_level="sequence"
        log_w = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        coef_1 = torch.exp(log_w).unsqueeze(-1)
    else:
        coef_1 = torch.exp(log_ratio)
    lo, hi = kw.get("eps_low", 0.2), kw.get("eps_high", kw.get("eps_low", 0.2))
    if variant in ("ppo", "gspo"):  # TRL (verl's vanilla and gspo: tests/test_losses_verl.py)
        coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
        c1 = torch.clamp(coef_1, max=kw["delta"]) if kw.get("delta") else coef_1
        per_token = -torch.min(c1 * adv, coef_2 * adv)
    elif variant == "cispo_trl":
        per_token = -torch.clamp(coef_1, max=kw["eps_high"]).detach() * adv * lp
    elif variant == "sapo":
        temps = torch.where(adv > 0, kw.get("tau_pos", 1.0), kw.get("tau_neg", 1.05))
        per_token = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * adv
    else:
        raise ValueError(variant)
    if kw.get("beta"):
        kl = kl_estimate(lp, t["ref"], kw.get("kl", "k3"))
        if kw.get("bias_correction"):
            kl = kl * coef_1
        per_token = per_token + kw["beta"] * kl
    if kw.get("entropy_coef"):
        per_token = per_token - kw["entropy_coef"] * t["entropy"]
    return per_token


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, name: str, constant: float | None = None) -> torch.Tensor:
    """TRL loss_type / verl loss_agg_mode aggregation of an [S, T] loss, written as they do."""
    if name in ("grpo", "sapo"):  # TRL
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if name in ("bnpo", "dapo", "cispo"):  # TRL (dapo/cispo: the global count; one batch here)
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if name == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * constant)
    if name == "luspo":
        return (per_token * mask).sum(-1).mean()
    if name in VERL_MODES:  # as verl's trainer calls it: global_batch_size = every row
        return verl_agg_loss(per_token, mask, name, global_batch_size=per_token.size(0), loss_scale_factor=constant)
    raise ValueError(name)


def reference_step(model, seqs, fields, variant, aggregation, constant=None, temperature=None, **kw) -> float:
    """Accumulate the reference loss's gradient into ``model``; returns the loss."""
    t = batch_tensors(model, seqs, fields, temperature)
    loss = aggregate(loss_matrix(t, variant, **kw), t["mask"], aggregation, constant)
    loss.backward()
    return float(loss.detach())
