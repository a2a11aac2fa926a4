"""Losses written per token on the linearized (sequence, token) layout.

A user's loss here looks like the one they have today: a function of each predicted
token's log-prob and that (sequence, token)'s fields, and a reduction. The runtime
evaluates it on the tree, where every linearized token gathers its log-prob from the
unique token it maps to, so the value and the gradient equal those of linearized
training.

Conventions (the same as ``Forest``):

* the value at position ``t`` of a per-token field belongs to the prediction of
  ``s[t]`` from ``s[:t]``; position 0 is never predicted and never counts;
* ``loss_mask`` (default: all ones) weights each prediction; a 0 removes it from
  the loss and from the normalization counts.

Reductions:

* ``sum``: ``sum_{s,t} m_{s,t} * l_{s,t}``
* ``token_mean``: the sum divided by ``sum_{s,t} m_{s,t}`` over the whole batch
* ``sequence_mean``: the mean over sequences of each sequence's masked token mean;
  sequences whose mask sums to 0 are left out of the mean

Every reduction is then multiplied by ``scale`` (use it for a fixed-constant
normalization, e.g. ``reduction="sum", scale=1/4096``).

A loss that is not a sum of per-token terms goes through the two-pass path:
pass any callable ``fn(logprobs: list[Tensor], forest) -> Tensor`` to
``TreeRuntime.forward_backward`` (see :mod:`dtree.runtime`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from .ops.logprobs import OutputHead, token_logprobs
from .tree import Forest

__all__ = ["TokenLoss", "Normalization", "nll", "ppo_clip", "weighted_terms", "REDUCTIONS"]

REDUCTIONS = ("sum", "token_mean", "sequence_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class Normalization:
    """Counts a reduction divides by. Defaults to the local forest's; distributed
    training passes the global counts (summed over ranks) here."""

    loss_tokens: float  # sum of loss_mask over all predictions
    loss_sequences: float  # sequences with a non-zero mask sum


def prediction_mask(forest: Forest, use_loss_mask: bool = True) -> np.ndarray:
    """[N] float64 loss-mask of every linearized token, 0 at each sequence's first token."""
    if use_loss_mask and "loss_mask" in forest.fields:
        mask = forest.fields["loss_mask"].copy()
    else:
        mask = np.ones(forest.num_linearized_tokens)
    mask[forest.seq_offsets[:-1]] = 0.0
    return mask


def local_normalization(forest: Forest, use_loss_mask: bool = True) -> Normalization:
    """This forest's counts (what a single-process step divides by)."""
    mask = prediction_mask(forest, use_loss_mask)
    per_seq = np.add.reduceat(mask, forest.seq_offsets[:-1])
    return Normalization(loss_tokens=float(mask.sum()), loss_sequences=float(np.count_nonzero(per_seq)))


@dataclass
class TokenLoss:
    """A per-token loss with a reduction.

    Args:
        per_token: ``fn(logp [M], fields: name -> [M]) -> [M]`` loss of each prediction
            before masking and reduction. ``logp`` is ``log p(s[t] | s[:t])``.
        reduction: one of ``sum``, ``token_mean``, ``sequence_mean``.
        scale: multiplies the reduced loss.
        required_fields: fields ``per_token`` reads; checked before any compute.
        name: shown in errors and reports.
        use_loss_mask: weight terms by the ``loss_mask`` field (when the forest has one).
    """

    per_token: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
    reduction: str = "token_mean"
    scale: float = 1.0
    required_fields: tuple[str, ...] = ()
    name: str = "custom"
    use_loss_mask: bool = True

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")

    def check_fields(self, forest: Forest) -> None:
        missing = [f for f in self.required_fields if f not in forest.fields]
        if missing:
            raise ValueError(
                f"loss {self.name!r} needs per-token fields {missing}; pass them to Forest.from_sequences(..., "
                + ", ".join(f"{m}=[...]" for m in missing)
                + ")"
            )

    def weights(self, forest: Forest, norm: Normalization | None = None) -> np.ndarray:
        """[N] float64 weight of each linearized token's loss term (0 where not predicted).

        ``loss = sum_k weights[k] * per_token(...)[k]`` over linearized tokens ``k``.
        """
        mask = prediction_mask(forest, self.use_loss_mask)
        norm = norm or local_normalization(forest, self.use_loss_mask)
        if self.reduction == "sum":
            w = mask
        elif self.reduction == "token_mean":
            w = mask / norm.loss_tokens if norm.loss_tokens > 0 else np.zeros_like(mask)
        else:  # sequence_mean
            per_seq = np.add.reduceat(mask, forest.seq_offsets[:-1])
            per_tok = np.repeat(per_seq, forest.sequence_lengths())
            w = np.zeros_like(mask)
            ok = per_tok > 0
            if norm.loss_sequences > 0:
                w[ok] = mask[ok] / (per_tok[ok] * norm.loss_sequences)
        return w * self.scale


def nll(reduction: str = "token_mean", scale: float = 1.0) -> TokenLoss:
    """Negative log-likelihood (SFT): ``l = -logp``."""

    def per_token(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return -logp

    return TokenLoss(per_token, reduction=reduction, scale=scale, name="nll")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    # k3: exp(ref - logp) - (ref - logp) - 1, unbiased and always >= 0
    return torch.exp(-log_ratio) + log_ratio - 1.0


def ppo_clip(
    clip_eps: float = 0.2,
    reduction: str = "token_mean",
    *,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    scale: float = 1.0,
) -> TokenLoss:
    """PPO/GRPO clipped surrogate: ``l = -min(r*A, clip(r, 1-eps, 1+eps_high)*A) + kl_coef*KL``.

    ``r = exp(logp - old_logprobs)``, ``A = advantages``. ``clip_eps_high`` defaults to
    ``clip_eps`` (set it for DAPO's asymmetric clip). With ``kl_coef > 0`` the loss
    adds a KL estimate against ``ref_logprobs``.
    """
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError("clip_eps and clip_eps_high must be non-negative")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    required = ("advantages", "old_logprobs") + (("ref_logprobs",) if kl_coef else ())

    def per_token(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        adv = fields["advantages"]
        ratio = torch.exp(logp - fields["old_logprobs"])
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv)
        loss = -surrogate
        if kl_coef:
            loss = loss + kl_coef * kl_penalty(logp, fields["ref_logprobs"], kl_estimator)
        return loss

    return TokenLoss(per_token, reduction=reduction, scale=scale, required_fields=required, name="ppo_clip")


def logprob_grad_surrogate() -> TokenLoss:
    """``l = logp * g`` with ``g`` the field ``_logprob_grad``: its gradient w.r.t. each
    log-prob is ``g``. The second pass of the two-pass path runs this loss."""

    def per_token(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return logp * fields["_logprob_grad"]

    return TokenLoss(
        per_token, reduction="sum", required_fields=("_logprob_grad",), name="logprob_grad", use_loss_mask=False
    )


def weighted_terms(
    per_token: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor],
    hidden: torch.Tensor,
    pred_rows: torch.Tensor,
    labels: torch.Tensor,
    term_pred: torch.Tensor,
    weights: torch.Tensor,
    fields: Mapping[str, torch.Tensor],
    output_layer: OutputHead | tuple[torch.Tensor, torch.Tensor | None],
    logprob_chunk: int,
) -> torch.Tensor:
    """Weighted loss terms of one model call, the same in dtree and its baselines.

    Args:
        hidden: [T, H] final hidden states of the call.
        pred_rows, labels: [P] rows that go through the LM head and the token each predicts.
        term_pred: [E] which prediction each loss term reads (terms that share a unique
            token share its prediction).
        weights, fields: [E] the terms' weights (reduction and mask folded in) and fields.
        output_layer: the LM head (an :class:`~dtree.ops.logprobs.OutputHead`, or (weight [V, H], bias [V] or None)).

    Returns:
        [E] ``per_token(logp, fields) * weights``; their sum is the call's loss.
    """
    logp = token_logprobs(hidden[pred_rows], output_layer, labels, logprob_chunk)[0][term_pred]
    per = per_token(logp, fields)
    if per.shape != logp.shape:
        raise ValueError(f"per-token loss returned shape {tuple(per.shape)}, expected {tuple(logp.shape)}")
    return per * weights
