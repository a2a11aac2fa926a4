"""TRL's ``GRPOTrainer`` loss settings as dtree losses: which ``loss_type`` /
``importance_sampling_level`` pairs map exactly (the rest fall back to TRL's own
path), the loss and normalization of one micro-batch (:func:`grpo_trainer_loss`),
and TRL's two rewrites of a loss: on-policy ratios (:func:`on_policy`) and its entropy
bonus (:func:`with_entropy_bonus`). Imports no TRL: the trainer is read by attribute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..forest.forest import Forest
from ..losses import (
    Normalization,
    SequenceLoss,
    TokenLoss,
    aggregation,
    cispo,
    gspo,
    local_normalization,
    ppo_clip,
    prediction_mask,
    sapo,
)

__all__ = [
    "CLIP_METRIC_TYPES",
    "GLOBAL_COUNTS",
    "SEQUENCE_LOSS_TYPES",
    "TOKEN_LOSS_TYPES",
    "grpo_trainer_loss",
    "on_policy",
    "with_entropy_bonus",
]

# TRL loss types dtree maps exactly, per token and at sequence level
TOKEN_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
SEQUENCE_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
GLOBAL_COUNTS = ("dapo", "cispo")  # normalized by the generation batch's loss tokens
CLIP_METRIC_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def grpo_trainer_loss(
    trainer: Any, forest: Forest, inputs: dict, accumulation: int
) -> tuple[TokenLoss | SequenceLoss, Normalization | None]:
    """The dtree loss equal to ``GRPOTrainer._compute_loss``'s policy and KL terms for
    this micro-batch of ``trainer`` (a ``GRPOTrainer``: its ``args``, ``loss_type``,
    ``beta``, ``epsilon_low``/``epsilon_high``, ``temperature``,
    ``importance_sampling_level``, ``max_completion_length``, ``accelerator``), with the
    counts it divides by (None: the forest's own). ``inputs``: the micro-batch's inputs
    (``num_items_in_batch``); ``accumulation``: the gradient accumulation steps of this
    window."""
    args, loss_type = trainer.args, trainer.loss_type
    agg = aggregation(loss_type, max_completion_length=trainer.max_completion_length if loss_type == "dr_grpo" else None)
    norm = None
    if loss_type in GLOBAL_COUNTS:
        # TRL: num_items_in_batch spans the generation batch and all ranks; rescaled to
        # one accumulation window of this rank
        items = float(inputs["num_items_in_batch"].clamp(min=1.0))
        local = local_normalization(forest)
        norm = dataclasses.replace(
            local, loss_tokens=items / trainer.accelerator.num_processes * accumulation / args.steps_per_generation
        )
    else:
        agg["scale"] = agg.get("scale", 1.0) / accumulation
    kl = dict(
        kl_coef=trainer.beta, kl_bias_correction=bool(trainer.beta and args.use_bias_correction_kl),
        temperature=trainer.temperature,
    )
    if trainer.importance_sampling_level == "sequence":
        loss = gspo(trainer.epsilon_low, epsilon_high=trainer.epsilon_high, delta=args.delta, log_entropy=True, **kl, **agg)
        return loss.with_normalization(norm), None
    if loss_type == "cispo":
        return cispo(ratio_max=trainer.epsilon_high, log_entropy=True, **kl, **agg), norm
    if loss_type == "sapo":
        return sapo(args.sapo_temperature_pos, args.sapo_temperature_neg, log_entropy=True, **kl, **agg), norm
    return ppo_clip(trainer.epsilon_low, epsilon_high=trainer.epsilon_high, delta=args.delta, log_entropy=True, **kl, **agg), norm


def on_policy(loss: TokenLoss | SequenceLoss) -> TokenLoss | SequenceLoss:
    """``loss`` with ``old_logprobs`` = the current log-probs, detached: ratio 1, and the
    surrogate's gradient (what GRPOTrainer does when the batch is used once)."""
    required = tuple(f for f in loss.required_fields if f != "old_logprobs")
    if isinstance(loss, SequenceLoss):
        per_token, metrics = loss.per_token, loss.metrics

        def with_old(b):
            return dataclasses.replace(b, fields={**b.fields, "old_logprobs": b.logp.detach()})

        return dataclasses.replace(
            loss,
            per_token=lambda b: per_token(with_old(b)),
            metrics=None if metrics is None else (lambda b: metrics(with_old(b))),
            required_fields=required,
        )
    per_token, metrics = loss.per_token, loss.metrics
    return dataclasses.replace(
        loss,
        per_token=lambda logp, f: per_token(logp, {**f, "old_logprobs": logp.detach()}),
        metrics=None if metrics is None else (lambda logp, f: metrics(logp, {**f, "old_logprobs": logp})),
        required_fields=required,
    )


def with_entropy_bonus(
    loss: TokenLoss, forest: Forest, norm: Normalization | None, coef: float, accumulation: int
) -> tuple[TokenLoss, Forest]:
    """``loss - coef * H`` where ``H`` is TRL's bonus: the mask-weighted mean entropy of
    the micro-batch divided by the accumulation steps, whatever the loss's reduction.

    The loss's reduction weighs each term by ``w``; the bonus needs ``m / (sum(m) * GA)``,
    so each term's entropy gets the field ``entropy_scale = m / (sum(m) * GA) / w``."""
    w = loss.weights(forest, norm)
    mask = prediction_mask(forest)
    target = mask / max(mask.sum(), 1.0) / accumulation
    scale = np.divide(target, w, out=np.zeros_like(w), where=w != 0)
    bounds = forest.seq_offsets
    forest = forest.with_fields(entropy_scale=[scale[bounds[s] : bounds[s + 1]] for s in range(forest.num_sequences)])
    per_token = loss.per_token

    def with_bonus(logp: torch.Tensor, fields) -> torch.Tensor:
        return per_token(logp, fields) - coef * fields["entropy"] * fields["entropy_scale"]

    bonus = dataclasses.replace(
        loss, per_token=with_bonus, required_fields=loss.required_fields + ("entropy_scale",), needs_entropy=True
    )
    return bonus, forest
