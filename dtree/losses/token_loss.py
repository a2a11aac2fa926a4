"""TokenLoss: a loss written per token on the linearized (sequence, token) layout, and
the metric averaging. Its reductions and their counts (:class:`Normalization`) are in
:mod:`dtree.losses.reduction`, re-exported here.

The semantics (positions, ``loss_mask``, the reductions, gradient accumulation,
metrics) are described in :mod:`dtree.losses`, the namespace users read, which
re-exports everything here with the policy losses and the sequence losses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from ..forest.forest import Forest
from ..ops.logprobs import OutputHead, token_logprobs
from .reduction import (
    REDUCTIONS,
    LossPart,
    Normalization,
    PerTokenFn,
    check_loss_settings,
    local_normalization,
    prediction_mask,
    reduction_weights,
)

__all__ = [
    "PART_WEIGHT",
    "REDUCTIONS",
    "LossPart",
    "MetricsFn",
    "Normalization",
    "PerTokenFn",
    "TokenLoss",
    "add_metric_sums",
    "check_loss_settings",
    "local_normalization",
    "masked_metric_sums",
    "means_of_sums",
    "metric_means",
    "nll",
    "prediction_mask",
    "reduction_weights",
    "weighted_terms",
]

MetricsFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
# the field that carries a loss part's [N] weights through a step (TokenLoss.prepare)
PART_WEIGHT = "part_weight/"


@dataclass
class TokenLoss:
    """A per-token loss with a reduction.

    Args:
        per_token: ``fn(logp [M], fields: name -> [M]) -> [M]`` loss of each prediction
            before masking and reduction. ``logp`` is ``log p(s[t] | s[:t])`` (of the
            distribution ``softmax(logits / temperature)``).
        reduction: one of :data:`REDUCTIONS` (see the module docstring).
        scale: multiplies the reduced loss.
        required_fields: fields ``per_token`` reads; checked before any compute.
        name: shown in errors and reports.
        use_loss_mask: weight terms by the ``loss_mask`` field (when the forest has one).
        temperature: log-probs (and entropies) are those of ``logits / temperature``,
            the distribution rollouts were sampled from (TRL ``temperature``, verl
            ``rollout.temperature``).
        needs_entropy: ``per_token`` or ``metrics`` read ``fields["entropy"]`` [M], the
            entropy of the predictive distribution at that token (differentiable).
        metrics: ``fn(logp [M], fields) -> {name: [M]}`` per-token values that the
            runtime averages over the loss tokens (mask-weighted) into
            ``StepOutput.metrics``; called without grad.
        count_empty_sequences: sequence-level reductions count sequences without a loss
            token in the number of sequences (TRL, verl's trainer); default: leave them
            out (verl's ``agg_loss`` without ``global_batch_size``).
        parts: name -> :class:`LossPart`, further terms with reductions of their own
            (``reduction``, ``scale`` and ``count_empty_sequences`` above apply to
            ``per_token`` alone). A runtime evaluates them all in the same pass
            (:meth:`prepare`, :meth:`evaluate`).
    """

    per_token: PerTokenFn
    reduction: str = "token_mean"
    scale: float = 1.0
    required_fields: tuple[str, ...] = ()
    name: str = "custom"
    use_loss_mask: bool = True
    temperature: float = 1.0
    needs_entropy: bool = False
    metrics: MetricsFn | None = None
    count_empty_sequences: bool = False
    parts: Mapping[str, LossPart] | None = None

    def __post_init__(self) -> None:
        check_loss_settings(self.reduction, self.scale, self.temperature)
        for name, part in (self.parts or {}).items():
            if not isinstance(part, LossPart):
                raise TypeError(f"loss {self.name!r}: part {name!r} must be a dtree.losses.LossPart, got {part!r}")

    @property
    def field_names(self) -> tuple[str, ...]:
        """The fields a step uploads for :meth:`evaluate`: ``required_fields``, plus each
        part's weights (which :meth:`prepare` adds to the forest)."""
        if not self.parts:
            return self.required_fields
        return self.required_fields + tuple(PART_WEIGHT + n for n in ("", *self.parts))

    def check_fields(
        self, forest: Forest, *, supports_temperature: bool = False, supports_entropy: bool = False
    ) -> None:
        """Raise before any compute if ``forest`` lacks a field this loss reads, or if the
        caller cannot compute what the loss needs: a runtime passes
        ``supports_temperature`` / ``supports_entropy`` once it computes temperature-scaled
        log-probs / the entropy (so such a loss never silently gets something else)."""
        if self.temperature != 1.0 and not supports_temperature:
            raise ValueError(
                f"loss {self.name!r} has temperature={self.temperature}, but this trainer computes log-probs at "
                "temperature 1 only; use temperature=1.0, or dtree.TreeRuntime (or its baselines), which support "
                "the sampling temperature"
            )
        if self.needs_entropy and not supports_entropy:
            raise ValueError(
                f"loss {self.name!r} reads the entropy (entropy_coef or an entropy metric), which this trainer does "
                "not compute; use entropy_coef=0 and log_entropy=False, or dtree.TreeRuntime (or its baselines), "
                "which compute it"
            )
        missing = [f for f in self.required_fields if f not in forest.fields]
        if missing:
            raise ValueError(
                f"loss {self.name!r} needs per-token fields {missing}; pass them to Forest.from_sequences(..., "
                + ", ".join(f"{m}=[...]" for m in missing)
                + ") or Forest.with_fields"
            )

    def weights(self, forest: Forest, norm: Normalization | None = None) -> np.ndarray:
        """[N] float64 weight of each linearized token's loss term (0 where not predicted).

        ``loss = sum_k weights[k] * per_token(...)[k]`` over linearized tokens ``k``
        (the loss's ``parts`` have weights of their own: :meth:`prepare`).
        """
        return self._reduced(self, forest, norm)

    def _reduced(self, spec: "TokenLoss | LossPart", forest: Forest, norm: Normalization | None) -> np.ndarray:
        """[N] weights of ``spec``'s reduction (this loss's or a part's) under this loss's mask."""
        return reduction_weights(
            forest,
            spec.reduction,
            scale=spec.scale,
            use_loss_mask=self.use_loss_mask,
            count_empty_sequences=spec.count_empty_sequences,
            norm=norm,
        )

    def prepare(self, forest: Forest, norm: Normalization | None = None) -> tuple[Forest, np.ndarray]:
        """What a step trains on: ``(forest, [N] weights)`` with ``loss = sum_k weights[k]
        * evaluate(...)[k]``. Without parts, the forest as given and :meth:`weights`;
        with parts, the forest with each part's weights as a field, and weights 1 on
        every term any part weighs (:meth:`evaluate` applies the parts' own)."""
        main = self.weights(forest, norm)
        if not self.parts:
            return forest, main
        by_part = {PART_WEIGHT: main}
        by_part.update({PART_WEIGHT + name: self._reduced(part, forest, norm) for name, part in self.parts.items()})
        any_weight = np.logical_or.reduce([w != 0 for w in by_part.values()]).astype(np.float64)
        return dataclasses.replace(forest, fields={**forest.fields, **by_part}), any_weight

    def evaluate(self, logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[M] what a step multiplies by :meth:`prepare`'s weights: ``per_token``, or,
        with parts, every part's terms times its own weights (fields of :meth:`prepare`)."""
        if not self.parts:
            return self.per_token(logp, fields)
        out = self.per_token(logp, fields) * fields[PART_WEIGHT]
        for name, part in self.parts.items():
            out = out + part.per_token(logp, fields) * fields[PART_WEIGHT + name]
        return out

    def metric_mask(self, forest: Forest, at: np.ndarray | None = None) -> np.ndarray:
        """[N] float64 weight of each linearized token in the metric averages: its loss
        mask (0 at each sequence's first token), as TRL and verl average metrics; with
        ``at`` ([E] linearized indices), only those entries."""
        return prediction_mask(forest, self.use_loss_mask, at)

    def recording(self, sink: list) -> PerTokenFn:
        """:meth:`evaluate`, which also appends ``metrics(logp, fields)`` (detached) to
        ``sink`` on every call: how a runtime collects metrics without a second
        LM-head pass (it pairs each entry with the terms' :meth:`metric_mask`)."""
        if self.metrics is None:
            return self.evaluate
        metrics, per_token = self.metrics, self.evaluate

        def recorded(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
            with torch.no_grad():
                sink.append(metrics(logp.detach(), {k: v.detach() for k, v in fields.items()}))
            return per_token(logp, fields)

        return recorded


def masked_metric_sums(values: Mapping[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mask-weighted sums of per-token metric values, to add up across model calls,
    micro-batches and ranks (all-reduce SUM) before :func:`metric_means`.

    Args:
        values: name -> [M] per-token values; mask: [M] weights (the loss mask).

    Returns:
        name -> 0-d ``sum(mask * value)``, and ``"_weight"`` -> 0-d ``sum(mask)`` (on the
        device: no sync).
    """
    mask = mask.detach()
    out = {name: (v.detach().to(mask.dtype) * mask).sum() for name, v in values.items()}
    out["_weight"] = mask.sum()
    return out


def add_metric_sums(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Key-wise sum of two :func:`masked_metric_sums` results (either may be empty)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def metric_means(sums: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``{name: sum / weight}`` from :func:`masked_metric_sums` (one host sync); NaN for
    every metric when no token had weight."""
    if not sums:
        return {}
    names = list(sums)
    return means_of_sums(dict(zip(names, torch.stack([sums[k].double() for k in names]).cpu().tolist())))


def means_of_sums(sums: Mapping[str, float]) -> dict[str, float]:
    """:func:`metric_means` of sums already on the host (``"_weight"`` among them)."""
    weight = sums["_weight"]
    return {k: (v / weight if weight != 0 else float("nan")) for k, v in sums.items() if k != "_weight"}


def nll(reduction: str = "token_mean", scale: float = 1.0, *, temperature: float = 1.0) -> TokenLoss:
    """Negative log-likelihood (SFT): ``l = -logp``."""

    def per_token(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return -logp

    return TokenLoss(per_token, reduction=reduction, scale=scale, name="nll", temperature=temperature)


def weighted_terms(
    per_token: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor],
    hidden: torch.Tensor,
    pred_hidden_row: torch.Tensor | None,
    labels: torch.Tensor,
    loss_pred: torch.Tensor,
    weights: torch.Tensor,
    fields: Mapping[str, torch.Tensor],
    output_layer: OutputHead | tuple[torch.Tensor, torch.Tensor | None],
    logprob_chunk: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    keep_logits: bool = False,
) -> torch.Tensor:
    """Weighted loss terms of one model call, the same in dtree and its baselines.

    Args:
        hidden: [T, H] final hidden states of the call.
        pred_hidden_row, labels: [P] rows whose hidden states go through the LM head, and
            the token each predicts (the names of :class:`dtree.plan.loss_terms.LossTerms`);
            ``pred_hidden_row`` None: ``hidden`` holds those rows already ([P, H]).
        loss_pred: [E] which prediction each loss term reads (terms that share a unique
            token share its prediction).
        weights, fields: [E] the terms' weights (reduction and mask folded in) and fields.
        output_layer: the LM head (an :class:`~dtree.ops.logprobs.OutputHead`, or (weight [V, H], bias [V] or None)).
        temperature: log-probs (and entropies) of ``softmax(logits / temperature)``.
        with_entropy: pass ``fields["entropy"]`` [E], the differentiable entropy of each
            term's predictive distribution, computed in the same chunked LM-head pass.
        keep_logits: the call's backward follows its loss at once (a leaf call, a call
            re-run in the backward, a baseline's call): the LM head keeps its logits for it
            where the rows fit one chunk (:func:`~dtree.ops.logprobs.token_logprobs`).

    Returns:
        [E] ``per_token(logp, fields) * weights``; their sum is the call's loss.
    """
    rows = hidden if pred_hidden_row is None else hidden[pred_hidden_row]
    logp, ent = token_logprobs(
        rows, output_layer, labels, logprob_chunk, temperature=temperature, with_entropy=with_entropy,
        keep_logits=keep_logits,
    )
    logp = logp[loss_pred]
    if with_entropy:
        fields = {**fields, "entropy": ent[loss_pred]}
    per = per_token(logp, fields)
    if per.shape != logp.shape:
        raise ValueError(f"per-token loss returned shape {tuple(per.shape)}, expected {tuple(logp.shape)}")
    return per * weights
