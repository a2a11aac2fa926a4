"""Losses whose per-token terms read per-sequence values of the current policy.

GSPO's importance ratio is one number per sequence, ``s = exp(mean_t(logp - old))``
over the sequence's loss tokens, and it carries gradient to every token of the
sequence: the loss is not a sum of independent per-token terms, so it cannot run in
the runtime's one-pass walk. A :class:`SequenceLoss` is a callable
``loss(logprobs, forest) -> 0-d tensor`` for the runtime's **two-pass** path
(``TreeRuntime.forward_backward(forest, loss)``): the runtime computes every
sequence's log-probs, differentiates this function with respect to them, and runs
one DFS backward seeded with that gradient. The gradient is exact: the loss depends
on the parameters only through the log-probs.

The terms are written on the whole batch, linearized (:class:`SequenceBatch`), and
reduced with the same reductions and :class:`~dtree.losses.Normalization` as a
:class:`~dtree.losses.TokenLoss`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..forest.forest import Forest
from .policy_losses import KL_ESTIMATORS, clip_bounds, clipped_surrogate, kl_penalty
from .reduction import Normalization, check_loss_settings, prediction_mask, reduction_weights

__all__ = ["LogprobLoss", "SequenceBatch", "SequenceLoss", "gspo"]


@dataclass(frozen=True)
class LogprobLoss:
    """Any loss of the per-sequence log-probs, and optionally of the entropies, for the
    two-pass path (:mod:`dtree.engine.two_pass`): ``rt.forward_backward(forest, LogprobLoss(fn, temperature=T))``.

    Args:
        fn: ``fn(logprobs, forest) -> 0-d tensor``, or with ``needs_entropy``
            ``fn(logprobs, forest, entropy) -> 0-d tensor``; ``logprobs`` and ``entropy``
            are what :meth:`TreeRuntime.logprobs_and_entropy` returns (one [len-1]
            tensor per sequence, leaves that carry the gradient). It normalizes itself.
        temperature: log-probs and entropies of ``softmax(logits / temperature)``.
        needs_entropy: ``fn`` reads the entropies, and its gradient with respect to them
            (an entropy bonus) is trained exactly, like the log-probs'.
    """

    fn: Callable[..., torch.Tensor]
    temperature: float = 1.0
    needs_entropy: bool = False

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"LogprobLoss needs a callable fn(logprobs, forest[, entropy]), got {self.fn!r}")
        t = self.temperature
        if not (isinstance(t, (int, float)) and np.isfinite(t) and t > 0):
            raise ValueError(f"temperature must be a positive number (the sampling temperature), got {t!r}")


@dataclass
class SequenceBatch:
    """The batch as a :class:`SequenceLoss` sees it: every token of every sequence, in
    input order (``N`` linearized tokens, ``S`` sequences).

    Attributes:
        logp: [N] ``log p(s[t] | s[:t])``, 0 at each sequence's first token; carries the
            gradient the runtime seeds its backward with.
        fields: name -> [N] the forest's fields the loss reads.
        mask: [N] the loss mask (``loss_mask``, 0 at each sequence's first token).
        seq: [N] int64 sequence of each token.
        num_sequences: ``S``.
        entropy: [N] the entropy of each token's predictive distribution (0 at each
            sequence's first token; no gradient), when the loss ``needs_entropy``.
    """

    logp: torch.Tensor
    fields: dict[str, torch.Tensor]
    mask: torch.Tensor
    seq: torch.Tensor
    num_sequences: int
    entropy: torch.Tensor | None = None

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[N] -> [S] sum over each sequence's tokens (differentiable)."""
        return torch.zeros(self.num_sequences, dtype=x.dtype, device=x.device).index_add(0, self.seq, x)

    def seq_mean(self, x: torch.Tensor) -> torch.Tensor:
        """[N] -> [S] mask-weighted mean over each sequence's loss tokens; the count is
        clamped to 1 (as TRL and verl do), so a sequence without one gives 0."""
        return self.seq_sum(x * self.mask) / self.seq_sum(self.mask).clamp(min=1.0)

    def expand(self, y: torch.Tensor) -> torch.Tensor:
        """[S] -> [N] each sequence's value on every one of its tokens."""
        return y[self.seq]

    def token_average(self, x: torch.Tensor) -> torch.Tensor:
        """0-d mask-weighted mean of [N] values over all loss tokens (NaN without one)."""
        return (x * self.mask).sum() / self.mask.sum()

    def sequence_average(self, y: torch.Tensor, count_empty_sequences: bool = False) -> torch.Tensor:
        """0-d mean of [S] per-sequence values over the sequences with a loss token (or
        over all sequences)."""
        if count_empty_sequences:
            return y.mean()
        has = self.seq_sum(self.mask) > 0
        return y[has].mean()


def _linearize(logprobs: Sequence[torch.Tensor], forest: Forest) -> torch.Tensor:
    """[N] log-probs with a 0 at each sequence's first token, from per-sequence entries
    of ``len - 1`` (prediction-aligned, what ``TreeRuntime.logprobs`` returns) or ``len``
    values (token-aligned; the first value is never a prediction and is replaced by 0)."""
    if len(logprobs) != forest.num_sequences:
        raise ValueError(f"got {len(logprobs)} log-prob tensors for {forest.num_sequences} sequences")
    lengths = forest.sequence_lengths()
    parts = []
    for s, lp in enumerate(logprobs):
        n = int(lengths[s])
        if lp.ndim != 1 or lp.shape[0] not in (n, n - 1):
            raise ValueError(
                f"log-probs of sequence {s} have shape {tuple(lp.shape)}; expected [{n - 1}] or [{n}] "
                f"(the sequence has {n} tokens)"
            )
        parts += [lp.new_zeros(1), lp[lp.shape[0] - (n - 1) :]]
    return torch.cat(parts)


@dataclass
class SequenceLoss:
    """A loss over the whole batch for the two-pass path: ``loss(logprobs, forest)``.

    Args:
        per_token: ``fn(batch: SequenceBatch) -> [N]`` loss of each token; it may read
            per-sequence values of ``batch.logp`` (``batch.seq_mean``, ``batch.expand``).
            Terms are then masked and reduced as a :class:`~dtree.losses.TokenLoss`'s.
        reduction, scale, use_loss_mask, count_empty_sequences: as for ``TokenLoss``.
        required_fields: fields ``per_token`` reads; checked before any compute.
        name: shown in errors.
        temperature: the sampling temperature the log-probs must be computed at (the
            runtime's two-pass path computes them there).
        metrics: ``fn(batch) -> {name: 0-d tensor}`` (no grad), see :meth:`metric_values`.
        needs_entropy: ``metrics`` read ``batch.entropy`` (the runtime computes it in the
            log-prob pass; it carries no gradient, so no loss term may use it).
        normalization: the counts the reduction divides by (default: the forest's own);
            set it here (:meth:`with_normalization`) or pass
            ``forward_backward(..., normalization=...)``, for gradient accumulation.
    """

    per_token: Callable[[SequenceBatch], torch.Tensor]
    reduction: str = "sequence_mean"
    scale: float = 1.0
    required_fields: tuple[str, ...] = ()
    name: str = "sequence_loss"
    use_loss_mask: bool = True
    temperature: float = 1.0
    metrics: Callable[[SequenceBatch], dict[str, torch.Tensor]] | None = None
    count_empty_sequences: bool = False
    normalization: Normalization | None = None
    needs_entropy: bool = False

    def __post_init__(self) -> None:
        check_loss_settings(self.reduction, self.scale, self.temperature)

    def with_normalization(self, normalization: Normalization | None) -> "SequenceLoss":
        """A copy that divides by ``normalization`` (e.g. ``Normalization.from_forests``
        over the micro-batches of one optimizer step)."""
        return dataclasses.replace(self, normalization=normalization)

    def check_fields(self, forest: Forest) -> None:
        missing = [f for f in self.required_fields if f not in forest.fields]
        if missing:
            raise ValueError(f"loss {self.name!r} needs per-token fields {missing}; add them with Forest.with_fields")

    def batch(
        self, logprobs: Sequence[torch.Tensor], forest: Forest, entropy: Sequence[torch.Tensor] | None = None
    ) -> SequenceBatch:
        """The :class:`SequenceBatch` of ``logprobs`` (one [len-1] or [len] tensor per
        sequence, differentiable) over ``forest``, with ``entropy`` (same layout) when given."""
        logp = _linearize(logprobs, forest)
        if self.needs_entropy and entropy is None:
            raise ValueError(
                f"loss {self.name!r} reads the entropy: pass entropy=rt.entropy(forest, temperature=...) "
                "(TreeRuntime.forward_backward does)"
            )

        def dev(a: np.ndarray) -> torch.Tensor:  # a copy: the forest's arrays are read-only
            return torch.tensor(a, dtype=logp.dtype, device=logp.device)

        seq = np.repeat(np.arange(forest.num_sequences), forest.sequence_lengths())
        return SequenceBatch(
            logp=logp,
            fields={n: dev(forest.fields[n]) for n in self.required_fields},
            mask=dev(prediction_mask(forest, self.use_loss_mask)),
            seq=torch.as_tensor(seq, device=logp.device),
            num_sequences=forest.num_sequences,
            entropy=None if entropy is None else _linearize([e.detach() for e in entropy], forest),
        )

    def __call__(
        self,
        logprobs: Sequence[torch.Tensor],
        forest: Forest,
        *,
        temperature: float = 1.0,
        entropy: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """0-d loss. ``temperature``: what the caller computed ``logprobs`` at (the
        runtime's two-pass path computes them at the loss's temperature); it must equal
        the loss's. ``entropy``: per sequence, as ``logprobs`` (read by metrics only)."""
        if temperature != self.temperature:
            raise ValueError(
                f"loss {self.name!r} needs log-probs at temperature {self.temperature}, but they were computed at "
                f"temperature {temperature}"
            )
        self.check_fields(forest)
        b = self.batch(logprobs, forest, entropy)
        terms = self.per_token(b)
        if terms.shape != b.logp.shape:
            raise ValueError(f"per-token loss returned shape {tuple(terms.shape)}, expected {tuple(b.logp.shape)}")
        w = torch.as_tensor(
            reduction_weights(
                forest,
                self.reduction,
                scale=self.scale,
                use_loss_mask=self.use_loss_mask,
                count_empty_sequences=self.count_empty_sequences,
                norm=self.normalization,
            ),
            dtype=terms.dtype,
            device=terms.device,
        )
        # tokens with weight 0 (prompts, first tokens) never reach the sum, even as 0 * inf
        return (torch.where(w != 0, terms, torch.zeros_like(terms)) * w).sum()

    @torch.no_grad()
    def metric_values(
        self, logprobs: Sequence[torch.Tensor], forest: Forest, entropy: Sequence[torch.Tensor] | None = None
    ) -> dict[str, float]:
        """The loss's metrics on this batch (what a runtime reports in ``StepOutput.metrics``)."""
        if self.metrics is None:
            return {}
        values = self.metrics(self.batch([lp.detach() for lp in logprobs], forest, entropy))
        return {k: float(v) for k, v in values.items()}


def gspo(
    epsilon: float = 3e-4,
    reduction: str = "sequence_mean",
    *,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    delta: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_bias_correction: bool = False,
    temperature: float = 1.0,
    log_ratio_max: float | None = None,
    scale: float = 1.0,
    count_empty_sequences: bool = False,
    normalization: Normalization | None = None,
    log_entropy: bool = False,
    ratio_gradient: str = "sequence",
) -> SequenceLoss:
    """GSPO: PPO's clip on the sequence-level importance ratio.

    ``s = exp(sum_t m_t (logp_t - old_t) / max(sum_t m_t, 1))`` per sequence, and per
    token ``l = -min(s*A, clip(s, 1-eps_low, 1+eps_high)*A) + kl_coef*KL`` (``A`` per
    token, usually the sequence's advantage), reduced by ``reduction``. The ratio needs
    the whole sequence's log-probs, so this runs through the two-pass path:
    ``rt.forward_backward(forest, gspo(...))``.

    ``ratio_gradient`` says how ``s`` is differentiated:

    * ``"sequence"`` (TRL, the GSPO paper's GSPO): through the mean, so every loss
      token's gradient carries the advantages of all the tokens of its sequence;
    * ``"token"`` (verl's ``compute_policy_loss_gspo``, the paper's GSPO-token): per
      token ``s_t = sg(s) * exp(logp_t - sg(logp_t))``, equal to ``s`` in value, so each
      token's gradient carries its own advantage.

    The two agree when the advantage is the same on every token of a sequence (GRPO),
    and differ with per-token advantages.

    TRL: ``importance_sampling_level="sequence"`` with ``loss_type="grpo"`` is
    ``gspo(epsilon, epsilon_high=..., count_empty_sequences=True)`` (``delta``,
    ``beta`` -> ``kl_coef``, ``use_bias_correction_kl`` -> ``kl_bias_correction`` as in
    :func:`~dtree.losses.ppo_clip`; other ``loss_type`` values take their reduction from
    :func:`~dtree.losses.aggregation`); verl: below. The GSPO paper uses
    ``epsilon_low=3e-4``, ``epsilon_high=4e-4``.

    Metrics, as TRL logs them at sequence level: ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``ratio/mean`` per sequence,
    averaged over all sequences (one without a loss token has ratio 1); ``kl``
    (mask-weighted token mean), with ``kl_coef``; ``entropy`` (mask-weighted token mean),
    with ``log_entropy`` (the runtime then computes the entropy in its log-prob pass; an
    entropy bonus is not available on the two-pass path).

    verl ``loss_mode="gspo"``: ``gspo(clip_ratio_low, epsilon_high=clip_ratio_high,
    log_ratio_max=10.0, ratio_gradient="token", **aggregation(loss_agg_mode))`` (verl
    0.9.1 applies ``loss_agg_mode``; older releases always used ``seq-mean-token-mean``).
    """
    if ratio_gradient not in ("sequence", "token"):
        raise ValueError(f"ratio_gradient must be 'sequence' (TRL) or 'token' (verl), got {ratio_gradient!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    low, high = clip_bounds(epsilon, epsilon_low, epsilon_high)
    if delta is not None and not delta > 1.0:
        raise ValueError(f"delta must be > 1, got {delta}")
    terms = _GSPOTerms(
        low, high, delta, kl_coef, kl_estimator, kl_bias_correction, log_ratio_max, log_entropy, ratio_gradient
    )
    return SequenceLoss(
        terms.per_token,
        reduction=reduction,
        scale=scale,
        required_fields=("advantages", "old_logprobs") + (("ref_logprobs",) if kl_coef else ()),
        name="gspo",
        temperature=temperature,
        metrics=terms.metrics,
        count_empty_sequences=count_empty_sequences,
        normalization=normalization,
        needs_entropy=log_entropy,
    )


@dataclass(frozen=True)
class _GSPOTerms:
    """The per-token terms and metrics of :func:`gspo` (its checked options)."""

    low: float
    high: float
    delta: float | None
    kl_coef: float
    kl_estimator: str
    kl_bias_correction: bool
    log_ratio_max: float | None
    log_entropy: bool
    ratio_gradient: str = "sequence"

    def sequence_ratio(self, b: SequenceBatch) -> torch.Tensor:
        """[S] ``exp`` of each sequence's masked mean of ``logp - old``."""
        log_s = b.seq_mean(b.logp - b.fields["old_logprobs"])
        if self.log_ratio_max is not None:
            log_s = torch.clamp(log_s, max=self.log_ratio_max)
        return torch.exp(log_s)

    def token_ratio(self, b: SequenceBatch) -> torch.Tensor:
        """[N] the ratio each token's surrogate reads: ``s`` of its sequence, with the
        gradient of :attr:`ratio_gradient`."""
        if self.ratio_gradient == "sequence":
            return b.expand(self.sequence_ratio(b))
        log_s = b.expand(b.seq_mean(b.logp - b.fields["old_logprobs"]).detach())
        log_s = b.logp - b.logp.detach() + log_s
        if self.log_ratio_max is not None:
            log_s = torch.clamp(log_s, max=self.log_ratio_max)
        return torch.exp(log_s)

    def kl(self, b: SequenceBatch, ratio: torch.Tensor) -> torch.Tensor:
        value = kl_penalty(b.logp, b.fields["ref_logprobs"], self.kl_estimator)
        return value * ratio if self.kl_bias_correction else value

    def per_token(self, b: SequenceBatch) -> torch.Tensor:
        ratio = self.token_ratio(b)  # [N]
        loss = clipped_surrogate(ratio, b.fields["advantages"], self.low, self.high, self.delta)
        if self.kl_coef:
            loss = loss + self.kl_coef * self.kl(b, ratio)
        return loss

    def metrics(self, b: SequenceBatch) -> dict[str, torch.Tensor]:
        s = self.sequence_ratio(b)
        r = b.expand(s if self.delta is None else torch.clamp(s, max=self.delta))
        adv = b.fields["advantages"]
        is_low = ((r < 1.0 - self.low) & (adv < 0)).to(r.dtype)
        is_high = ((r > 1.0 + self.high) & (adv > 0)).to(r.dtype)

        def per_sequence(x: torch.Tensor) -> torch.Tensor:
            # TRL averages sequence-level metrics over every row, a row without a loss
            # token included (its ratio is exp(0) = 1: never clipped)
            return b.sequence_average(b.seq_mean(x), count_empty_sequences=True)

        out = {
            "clip_ratio/low_mean": per_sequence(is_low),
            "clip_ratio/high_mean": per_sequence(is_high),
            "clip_ratio/region_mean": per_sequence(torch.maximum(is_low, is_high)),
            "ratio/mean": b.sequence_average(s, count_empty_sequences=True),
        }
        if self.kl_coef:
            out["kl"] = b.token_average(self.kl(b, b.expand(s)))
        if self.log_entropy:
            out["entropy"] = b.token_average(b.entropy)
        return out
