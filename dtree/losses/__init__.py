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

Reductions (``m`` the mask, ``n_s = sum_t m_{s,t}`` a sequence's loss tokens):

* ``sum``: ``sum_{s,t} m_{s,t} * l_{s,t}``
* ``token_mean``: the sum divided by ``sum_{s,t} m_{s,t}`` over the whole batch
  (TRL ``bnpo``/``dapo``, verl ``token-mean``)
* ``sequence_mean``: the mean over sequences of each sequence's masked token mean
  ``sum_t m l / n_s`` (TRL ``grpo``, verl ``seq-mean-token-mean``)
* ``seq_mean_token_sum``: the mean over sequences of each sequence's masked token
  sum (verl ``seq-mean-token-sum``; with ``scale=1/max_completion_length`` and
  ``count_empty_sequences=True``, TRL ``dr_grpo``)

The sequence-level reductions leave sequences with ``n_s = 0`` out of the number of
sequences they divide by (verl's ``agg_loss`` called alone); ``count_empty_sequences=True``
counts them (TRL clamps ``n_s`` to 1 and divides by the number of rows; verl's trainer
divides by ``global_batch_size``, every row). Every reduction is then
multiplied by ``scale``. :func:`aggregation` gives the arguments for each of TRL's
``loss_type`` and verl's ``loss_agg_mode`` by name.

Gradient accumulation: the counts a reduction divides by are a
:class:`Normalization`, by default the forest's own. To split one optimizer step
into micro-batches (or ranks) and get the gradient of the whole batch, build it from
all of them, ``Normalization.from_forests(micro_batches, loss)``, and pass it to every
``forward_backward(..., normalization=norm)``.

Loss parts: a :class:`LossPart` is a further term of a ``TokenLoss`` with a reduction of
its own (verl's SAPO: policy term ``seq-mean-token-mean``, KL and entropy under
``loss_agg_mode``); one ``forward_backward`` computes all parts.

Metrics: a loss may have ``metrics(logp, fields) -> {name: [M] per-token values}``;
the runtime averages them over the loss tokens, weighted by the loss mask
(:func:`masked_metric_sums`, :func:`metric_means`), and reports them in
``StepOutput.metrics`` under the names TRL logs (``clip_ratio/low_mean``, ``kl``, ...).

A loss that is not a sum of per-token terms goes through the two-pass path:
pass any callable ``fn(logprobs: list[Tensor], forest) -> Tensor`` to
``TreeRuntime.forward_backward`` (see :mod:`dtree.engine.runtime`); :class:`SequenceLoss`
(and :func:`gspo`, GSPO's sequence-level ratio) is such a callable with the
reductions above.
"""

from __future__ import annotations

from .policy_losses import (
    KL_ESTIMATORS,
    TRL_LOSS_TYPES,
    VERL_LOSS_AGG_MODES,
    aggregation,
    cispo,
    kl_penalty,
    ppo_clip,
    sapo,
)
from .reduction import (
    REDUCTIONS,
    LossPart,
    Normalization,
    PerTokenFn,
    local_normalization,
    prediction_mask,
    reduction_weights,
)
from .sequence_loss import LogprobLoss, SequenceBatch, SequenceLoss, gspo
from .token_loss import (
    PART_WEIGHT,
    MetricsFn,
    TokenLoss,
    add_metric_sums,
    masked_metric_sums,
    means_of_sums,
    metric_means,
    nll,
    weighted_terms,
)

__all__ = [
    "TokenLoss",
    "LossPart",
    "PART_WEIGHT",
    "Normalization",
    "SequenceLoss",
    "SequenceBatch",
    "LogprobLoss",
    "nll",
    "ppo_clip",
    "cispo",
    "sapo",
    "gspo",
    "kl_penalty",
    "aggregation",
    "masked_metric_sums",
    "add_metric_sums",
    "means_of_sums",
    "metric_means",
    "weighted_terms",
    "REDUCTIONS",
    "KL_ESTIMATORS",
    "TRL_LOSS_TYPES",
    "VERL_LOSS_AGG_MODES",
    "local_normalization",
    "prediction_mask",
    "reduction_weights",
    "PerTokenFn",
    "MetricsFn",
]
