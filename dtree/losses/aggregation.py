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
# verl 0.9.1 actor.loss_agg_mode (verl/trainer/ppo/core_algos.py, agg_loss), as its
# trainer calls it: the sequence modes divide by global_batch_size = ppo_mini_batch_size
# * rollout.n, every row of the mini-batch, a row whose response_mask is all 0 included
# (count_empty_sequences=True); token-mean by the mini-batch's loss tokens.
VERL_LOSS_AGG_MODES: dict[str, dict[str, Any]] = {
    "token-mean": dict(reduction="token_mean"),
    "token-sum": dict(reduction="sum"),
    "seq-mean-token-mean": dict(reduction="sequence_mean", count_empty_sequences=True),
    "seq-mean-token-sum": dict(reduction="seq_mean_token_sum", count_empty_sequences=True),
    "seq-mean-token-sum-norm": dict(reduction="seq_mean_token_sum", count_empty_sequences=True),
}
# the names that divide by a constant the caller gives
_CONSTANT = {"dr_grpo": "max_completion_length", "seq-mean-token-sum-norm": "loss_scale_factor"}


def aggregation(
    name: str, *, max_completion_length: int | None = None, loss_scale_factor: float | None = None
) -> dict[str, Any]:
    """Loss keyword arguments (``reduction``, ``count_empty_sequences``, ``scale``) equal
    to a trainer's named aggregation: a TRL ``loss_type`` or a verl ``loss_agg_mode``::

        dtree.losses.ppo_clip(0.2, **dtree.losses.aggregation("dr_grpo", max_completion_length=1024))

    ``dr_grpo`` (TRL) divides by ``max_completion_length``; verl's
    ``seq-mean-token-sum-norm`` is ``seq-mean-token-sum`` divided by
    ``loss_scale_factor`` (verl's ``actor.loss_scale_factor``; when it is unset verl
    divides by the padded response width of the micro-batch: pass that number). Each
    takes either keyword.

    Over several micro-batches, TRL's ``grpo``/``sapo``/``bnpo``/``dr_grpo``/``luspo``
    normalize each micro-batch by its own counts and divide by
    ``gradient_accumulation_steps`` (multiply ``scale`` by ``1/steps``);
    ``dapo``/``cispo``/``vespo`` use the counts of the whole step
    (``Normalization.from_forests``). For equal-size micro-batches ``grpo`` and
    ``dr_grpo`` give the same either way; ``bnpo`` does not.

    verl 0.9.1 always normalizes by the mini-batch's global counts (its engine passes
    ``batch_num_tokens`` and ``global_batch_size`` to every micro-batch's loss):
    ``Normalization.from_forests`` over the micro-batches, whose ``num_sequences`` is
    every row (verl's ``global_batch_size``). Notes on verl's other versions and calls:

    * ``agg_loss`` called without ``global_batch_size`` (outside the trainer) leaves rows
      without a loss token out of the sequence modes' count: ``count_empty_sequences=False``.
    * Older verl releases (``agg_loss`` before it took ``global_batch_size``) computed
      ``seq-mean-token-sum-norm`` as the masked token sum divided by the padded width
      only, without dividing by the number of rows (``reduction="sum",
      scale=1/width``, what dtree mapped it to before), and GSPO there always used
      ``seq-mean-token-mean``; ``kl_loss_type="k3+"`` needs verl 0.9.1's suffix handling.
    * verl multiplies each rank's loss by ``dp_size`` because FSDP averages gradients over
      ranks; dtree's distributed trainer sums them, so no factor is needed there.
    """
    if name in TRL_LOSS_TYPES:
        kw = dict(TRL_LOSS_TYPES[name][0])
    elif name in VERL_LOSS_AGG_MODES:
        kw = dict(VERL_LOSS_AGG_MODES[name])
    else:
        raise ValueError(
            f"unknown aggregation {name!r}; TRL loss_type: {sorted(TRL_LOSS_TYPES)}, "
            f"verl loss_agg_mode: {sorted(VERL_LOSS_AGG_MODES)}"
        )
    if max_completion_length is not None and loss_scale_factor is not None:
        raise ValueError("pass max_completion_length or loss_scale_factor (two names of the same constant), not both")
    constant = max_completion_length if max_completion_length is not None else loss_scale_factor
    if name in _CONSTANT:
        if not constant or constant <= 0:
            raise ValueError(f"aggregation {name!r} divides by a constant: pass {_CONSTANT[name]}=<tokens>")
        kw["scale"] = 1.0 / constant
    return kw
