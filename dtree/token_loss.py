"""TokenLoss: a loss written per token on the linearized (sequence, token) layout, its
reductions and their counts (:class:`Normalization`), and the metric averaging.

The semantics (positions, ``loss_mask``, the reductions, gradient accumulation,
metrics) are described in :mod:`dtree.losses`, the namespace users read, which
re-exports everything here with the policy losses and the sequence losses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import numpy as np
import torch

from .aggregation import TRL_LOSS_TYPES, VERL_LOSS_AGG_MODES
from .ops.logprobs import OutputHead, token_logprobs
from .tree import Forest

if TYPE_CHECKING:  # annotations only: sequence_loss builds on this module
    from .sequence_loss import SequenceLoss

__all__ = [
    "PART_WEIGHT",
    "REDUCTIONS",
    "LossPart",
    "Normalization",
    "TokenLoss",
    "add_metric_sums",
    "check_loss_settings",
    "local_normalization",
    "masked_metric_sums",
    "metric_means",
    "nll",
    "prediction_mask",
    "reduction_weights",
    "weighted_terms",
]

REDUCTIONS = ("sum", "token_mean", "sequence_mean", "seq_mean_token_sum")

PerTokenFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
# the field that carries a loss part's [N] weights through a step (TokenLoss.prepare)
PART_WEIGHT = "part_weight/"


@dataclass(frozen=True)
class Normalization:
    """The counts a reduction divides by.

    By default a step uses its own forest's counts. For gradient accumulation over
    micro-batches, or data parallelism over ranks, pass the counts of the whole
    optimizer step (:meth:`from_forests`, or summed over ranks) to every
    ``forward_backward(..., normalization=...)``: the accumulated gradient then equals
    that of one step over the whole batch (DAPO's global token normalization is
    ``token_mean`` with these counts).

    Attributes:
        loss_tokens: sum of the loss mask over all predictions.
        loss_sequences: sequences with a non-zero mask sum.
        num_sequences: all sequences, including those without a loss token (what
            ``count_empty_sequences=True`` divides by). None: unknown, and a reduction
            that needs it raises.
    """

    loss_tokens: float
    loss_sequences: float
    num_sequences: float | None = None

    def __post_init__(self) -> None:
        for name in ("loss_tokens", "loss_sequences", "num_sequences"):
            value = getattr(self, name)
            if value is None and name == "num_sequences":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"Normalization.{name} must be a number, got {type(value).__name__}")
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(
                    f"Normalization.{name} must be a finite count >= 0, got {value}: a reduction divides by it "
                    "(Normalization.from_forests builds the counts of several micro-batches)"
                )
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_forests(cls, forests: Iterable[Forest], loss: "TokenLoss | SequenceLoss | None" = None) -> "Normalization":
        """The counts of several forests together (the micro-batches of one optimizer
        step), with ``loss``'s choice of mask (``use_loss_mask``)."""
        use_mask = True if loss is None else loss.use_loss_mask
        total = cls(0.0, 0.0, 0.0)
        for forest in forests:
            total = total + local_normalization(forest, use_mask)
        return total

    def __add__(self, other: "Normalization") -> "Normalization":
        known = self.num_sequences is not None and other.num_sequences is not None
        seqs = self.num_sequences + other.num_sequences if known else None
        return Normalization(self.loss_tokens + other.loss_tokens, self.loss_sequences + other.loss_sequences, seqs)


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
    return Normalization(
        loss_tokens=float(mask.sum()),
        loss_sequences=float(np.count_nonzero(per_seq)),
        num_sequences=float(forest.num_sequences),
    )


def reduction_weights(
    forest: Forest,
    reduction: str,
    *,
    scale: float = 1.0,
    use_loss_mask: bool = True,
    count_empty_sequences: bool = False,
    norm: Normalization | None = None,
) -> np.ndarray:
    """[N] float64 weight of each linearized token's loss term (0 where not predicted):
    ``loss = sum_k weights[k] * l[k]`` is the reduction (see module docstring)."""
    mask = prediction_mask(forest, use_loss_mask)
    norm = norm or local_normalization(forest, use_loss_mask)
    if reduction == "sum":
        w = mask
    elif reduction == "token_mean":
        _check_divisor("loss_tokens", norm.loss_tokens, mask)
        w = mask / norm.loss_tokens if norm.loss_tokens > 0 else np.zeros_like(mask)
    else:  # the mean over sequences of a per-sequence token mean or token sum
        if count_empty_sequences and norm.num_sequences is None:
            raise ValueError(
                "count_empty_sequences=True needs Normalization.num_sequences (the number of all sequences); "
                "build the Normalization with Normalization.from_forests"
            )
        num_seqs = norm.num_sequences if count_empty_sequences else norm.loss_sequences
        _check_divisor("num_sequences" if count_empty_sequences else "loss_sequences", num_seqs, mask)
        w = np.zeros_like(mask)
        if num_seqs > 0:
            if reduction == "sequence_mean":
                per_seq = np.add.reduceat(mask, forest.seq_offsets[:-1])
                per_tok = np.repeat(per_seq, forest.sequence_lengths())
                ok = per_tok > 0
                w[ok] = mask[ok] / (per_tok[ok] * num_seqs)
            else:  # seq_mean_token_sum
                w = mask / num_seqs
    return w * scale


def _check_divisor(name: str, count: float, mask: np.ndarray) -> None:
    """A count of 0 that a reduction divides by, while the forest has loss terms, would
    give loss 0 and no gradient without a word: refuse it."""
    if count == 0 and np.any(mask != 0):
        raise ValueError(
            f"the normalization's {name} is 0 but this forest has {int(np.count_nonzero(mask))} loss terms: the "
            "reduction would divide them away (loss 0, no gradient). Pass the counts of the whole optimizer step "
            "(Normalization.from_forests over its micro-batches), or none for this forest's own"
        )


def check_loss_settings(reduction: str, scale: float, temperature: float) -> None:
    """The settings every loss checks when it is built: a known reduction (a trainer's
    name gets a hint), a finite scale, a positive temperature."""
    if reduction not in REDUCTIONS:
        hint = ""
        if reduction in TRL_LOSS_TYPES or reduction in VERL_LOSS_AGG_MODES:
            hint = f"; for the trainer name {reduction!r} pass **dtree.losses.aggregation({reduction!r}, ...)"
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}{hint}")
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


@dataclass(frozen=True)
class LossPart:
    """A term of a :class:`TokenLoss` with a reduction of its own, e.g. verl's SAPO,
    whose policy term is ``seq-mean-token-mean`` while its KL and entropy terms follow
    ``loss_agg_mode``. One ``forward_backward`` computes every part: the step
    evaluates ``sum_k w[k] * l[k] + sum_parts sum_k w_part[k] * part(l)[k]``.

    Args:
        per_token: ``fn(logp [M], fields) -> [M]``, as :attr:`TokenLoss.per_token`.
        reduction, scale, count_empty_sequences: as for :class:`TokenLoss` (the part
            shares the loss's ``use_loss_mask`` and ``normalization``).
    """

    per_token: PerTokenFn
    reduction: str = "token_mean"
    scale: float = 1.0
    count_empty_sequences: bool = False

    def __post_init__(self) -> None:
        check_loss_settings(self.reduction, self.scale, 1.0)


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

    def metric_mask(self, forest: Forest) -> np.ndarray:
        """[N] float64 weight of each linearized token in the metric averages: its loss
        mask (0 at each sequence's first token), as TRL and verl average metrics."""
        return prediction_mask(forest, self.use_loss_mask)

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
    names = [k for k in sums if k != "_weight"]
    host = torch.stack([sums[k].double() for k in names] + [sums["_weight"].double()]).cpu().tolist()
    weight = host[-1]
    return {k: (v / weight if weight != 0 else float("nan")) for k, v in zip(names, host[:-1])}


def nll(reduction: str = "token_mean", scale: float = 1.0, *, temperature: float = 1.0) -> TokenLoss:
    """Negative log-likelihood (SFT): ``l = -logp``."""

    def per_token(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return -logp

    return TokenLoss(per_token, reduction=reduction, scale=scale, name="nll", temperature=temperature)


def weighted_terms(
    per_token: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor],
    hidden: torch.Tensor,
    pred_hidden_row: torch.Tensor,
    labels: torch.Tensor,
    loss_pred: torch.Tensor,
    weights: torch.Tensor,
    fields: Mapping[str, torch.Tensor],
    output_layer: OutputHead | tuple[torch.Tensor, torch.Tensor | None],
    logprob_chunk: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor:
    """Weighted loss terms of one model call, the same in dtree and its baselines.

    Args:
        hidden: [T, H] final hidden states of the call.
        pred_hidden_row, labels: [P] rows whose hidden states go through the LM head, and
            the token each predicts (the names of :class:`dtree.schedule.LossTerms`).
        loss_pred: [E] which prediction each loss term reads (terms that share a unique
            token share its prediction).
        weights, fields: [E] the terms' weights (reduction and mask folded in) and fields.
        output_layer: the LM head (an :class:`~dtree.ops.logprobs.OutputHead`, or (weight [V, H], bias [V] or None)).
        temperature: log-probs (and entropies) of ``softmax(logits / temperature)``.
        with_entropy: pass ``fields["entropy"]`` [E], the differentiable entropy of each
            term's predictive distribution, computed in the same chunked LM-head pass.

    Returns:
        [E] ``per_token(logp, fields) * weights``; their sum is the call's loss.
    """
    logp, ent = token_logprobs(
        hidden[pred_hidden_row], output_layer, labels, logprob_chunk, temperature=temperature, with_entropy=with_entropy
    )
    logp = logp[loss_pred]
    if with_entropy:
        fields = {**fields, "entropy": ent[loss_pred]}
    per = per_token(logp, fields)
    if per.shape != logp.shape:
        raise ValueError(f"per-token loss returned shape {tuple(per.shape)}, expected {tuple(logp.shape)}")
    return per * weights
