"""Trainers' names for how a loss is aggregated, as dtree loss arguments: TRL's
``loss_type`` and verl's ``loss_agg_mode`` (:func:`aggregation`)."""

from __future__ import annotations

from typing import Any

__all__ = ["TRL_LOSS_TYPES", "VERL_LOSS_AGG_MODES", "aggregation"]

# TRL GRPOConfig.loss_type -> how its _compute_loss aggregates (trl 1.16,
# grpo_trainer.py, GRPOTrainer._compute_loss). "local": each micro-batch's own counts,
# the loss divided by gradient_accumulation_steps; "global": the counts of the whole
# accumulated batch (Normalization.from_forests).
TRL_LOSS_TYPES: dict[str, tuple[dict[str, Any], str]] = {
    "grpo": (dict(reduction="sequence_mean", count_empty_sequences=True), "local"),
    "sapo": (dict(reduction="sequence_mean", count_empty_sequences=True), "local"),
    "bnpo": (dict(reduction="token_mean"), "local"),
    "dr_grpo": (dict(reduction="seq_mean_token_sum", count_empty_sequences=True), "local"),
    "luspo": (dict(reduction="seq_mean_token_sum", count_empty_sequences=True), "local"),
    "dapo": (dict(reduction="token_mean"), "global"),
    "cispo": (dict(reduction="token_mean"), "global"),
    "vespo": (dict(reduction="token_mean"), "global"),
}
# verl actor.loss_agg_mode (verl/trainer/ppo/core_algos.py, agg_loss)
VERL_LOSS_AGG_MODES: dict[str, dict[str, Any]] = {
    "token-mean": dict(reduction="token_mean"),
    "seq-mean-token-mean": dict(reduction="sequence_mean"),
    "seq-mean-token-sum": dict(reduction="seq_mean_token_sum"),
    "seq-mean-token-sum-norm": dict(reduction="sum"),
}


def aggregation(name: str, *, max_completion_length: int | None = None) -> dict[str, Any]:
    """Loss keyword arguments (``reduction``, ``count_empty_sequences``, ``scale``) equal
    to a trainer's named aggregation: a TRL ``loss_type`` or a verl ``loss_agg_mode``::

        dtree.losses.ppo_clip(0.2, **dtree.losses.aggregation("dr_grpo", max_completion_length=1024))

    ``dr_grpo`` (TRL) and ``seq-mean-token-sum-norm`` (verl ``loss_scale_factor``) divide
    by a constant: pass it as ``max_completion_length``. Over several micro-batches,
    TRL's ``grpo``/``sapo``/``bnpo``/``dr_grpo``/``luspo`` normalize each micro-batch by
    its own counts and divide by ``gradient_accumulation_steps`` (multiply ``scale`` by
    ``1/steps``); ``dapo``/``cispo``/``vespo`` use the counts of the whole step
    (``Normalization.from_forests``). For equal-size micro-batches ``grpo`` and
    ``dr_grpo`` give the same either way; ``bnpo`` does not. verl's legacy actor
    normalizes per micro-batch (``scale=1/steps``); its new engine uses global counts.
    """
    if name in TRL_LOSS_TYPES:
        kw = dict(TRL_LOSS_TYPES[name][0])
        constant = name == "dr_grpo"
    elif name in VERL_LOSS_AGG_MODES:
        kw = dict(VERL_LOSS_AGG_MODES[name])
        constant = name == "seq-mean-token-sum-norm"
    else:
        raise ValueError(
            f"unknown aggregation {name!r}; TRL loss_type: {sorted(TRL_LOSS_TYPES)}, "
            f"verl loss_agg_mode: {sorted(VERL_LOSS_AGG_MODES)}"
        )
    if constant:
        if not max_completion_length or max_completion_length <= 0:
            raise ValueError(f"aggregation {name!r} divides by a constant: pass max_completion_length=<tokens>")
        kw["scale"] = 1.0 / max_completion_length
    return kw
