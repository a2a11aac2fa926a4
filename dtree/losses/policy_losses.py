"""The per-token policy-gradient losses RL trainers use, under their names.

Each builder returns a :class:`dtree.losses.TokenLoss` (re-exported from
:mod:`dtree.losses`). With ``r = exp(logp - old_logprobs)`` and ``A = advantages``:

==============  =====================================================================
``ppo_clip``    ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`` (PPO / GRPO / DAPO
                clip-higher), with TRL's ``delta`` (``r`` capped at ``delta`` before the
                min, INTELLECT-2) or verl's dual clip ``clip_ratio_c`` (for ``A < 0``,
                the loss is capped at ``-A*clip_ratio_c``); the two agree whenever the
                cap is at least ``1 + eps_high``
``cispo``       ``-sg(clip(r, ratio_min, ratio_max)) * A * logp`` (MiniMax-M1; ``sg`` =
                stop-gradient). TRL: ``ratio_max = epsilon_high`` and no lower bound;
                verl: ``ratio_min = 1 - clip_ratio_low``, ``ratio_max = 1 + clip_ratio_high``
``sapo``        ``-(4/tau) * sigmoid(tau*(r-1)) * A``, ``tau = tau_pos if A > 0 else tau_neg``
==============  =====================================================================

Every one adds, per token, ``+ kl_coef * KL(logp, ref_logprobs)`` (estimator
``kl_estimator``, times ``r`` with ``kl_bias_correction`` as TRL's
``use_bias_correction_kl``) and ``- entropy_coef * entropy``. Every one has metrics
(mask-weighted means over the loss tokens, named as TRL logs them):
``clip_ratio/low_mean`` (``r < 1-eps_low`` and ``A < 0``), ``clip_ratio/high_mean``
(``r > 1+eps_high`` and ``A > 0``), ``clip_ratio/region_mean`` (either),
``ratio/mean`` (mean ``r``), ``kl`` (with ``kl_coef``), ``entropy`` (with
``entropy_coef`` or ``log_entropy``).

verl clamps ``logp - old_logprobs`` to ``[-20, 20]`` before ``exp`` in its vanilla,
CISPO and SAPO losses: pass ``log_ratio_clip=20.0`` to match it bit for bit (it only
differs for ratios beyond ``e^20``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .aggregation import TRL_LOSS_TYPES, VERL_LOSS_AGG_MODES, aggregation
from .reduction import LossPart
from .token_loss import TokenLoss

__all__ = [
    "KL_ESTIMATORS",
    "TRL_LOSS_TYPES",
    "VERL_LOSS_AGG_MODES",
    "aggregation",
    "cispo",
    "clip_bounds",
    "clipped_surrogate",
    "kl_penalty",
    "ppo_clip",
    "sapo",
]

# Schulman's estimators of KL(pi || ref) from samples of pi, named as TRL / verl name
# them. ``low_var_kl`` is verl's clamped k3 (verl calls it "k3" too); a trailing "+"
# keeps the estimator's value but takes k2's gradient (verl's straight-through trick:
# k2's gradient is the unbiased gradient of KL).
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k2+", "k3+", "low_var_kl+", "abs+")

Fields = Mapping[str, torch.Tensor]


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi.

    ``k1 = logp - ref``; ``k2 = (logp - ref)^2 / 2``; ``k3 = exp(ref - logp) - (ref -
    logp) - 1`` (unbiased, always >= 0; TRL's); ``low_var_kl``: k3 with ``ref - logp``
    clamped to [-20, 20] and the result to [-10, 10] (verl's ``low_var_kl`` / ``k3``);
    ``abs = |logp - ref|``. ``<name>+``: the value of ``<name>``, the gradient of k2
    (``k2+`` is ``k2``; verl accepts it).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    base = estimator.rstrip("+")
    log_ratio = logp - ref_logp
    if base == "k1":
        value = log_ratio
    elif base == "k2":
        value = 0.5 * log_ratio.square()
    elif base == "k3":
        value = torch.exp(-log_ratio) + log_ratio - 1.0
    elif base == "low_var_kl":
        d = torch.clamp(-log_ratio, -20.0, 20.0)
        value = torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
    else:  # abs
        value = log_ratio.abs()
    if not estimator.endswith("+"):
        return value
    k2 = 0.5 * log_ratio.square()
    return k2 - k2.detach() + value.detach()


def _ratio(logp: torch.Tensor, old: torch.Tensor, log_ratio_clip: float | None) -> torch.Tensor:
    log_ratio = logp - old
    if log_ratio_clip is not None:
        log_ratio = torch.clamp(log_ratio, -log_ratio_clip, log_ratio_clip)
    return torch.exp(log_ratio)


class _Regularizers:
    """What every policy loss adds per token: the KL to a reference and the entropy bonus.

    ``aggregation``: None adds them to the policy term (one reduction for all); else the
    reduction keywords of a :class:`LossPart` that holds them (verl's SAPO)."""

    def __init__(
        self,
        kl_coef: float,
        kl_estimator: str,
        kl_bias_correction: bool,
        entropy_coef: float,
        log_entropy: bool,
        aggregation: Mapping[str, Any] | None = None,
    ) -> None:
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
        self.kl_coef, self.kl_estimator, self.kl_bias_correction = kl_coef, kl_estimator, kl_bias_correction
        self.entropy_coef = entropy_coef
        self.needs_entropy = entropy_coef != 0 or log_entropy
        self.required = ("ref_logprobs",) if kl_coef else ()
        self.aggregation = None if aggregation is None else dict(aggregation)
        if self.aggregation is not None:
            unknown = set(self.aggregation) - {"reduction", "scale", "count_empty_sequences"}
            if unknown:
                raise ValueError(
                    f"regularizer_aggregation takes reduction, scale and count_empty_sequences (what "
                    f"dtree.losses.aggregation returns), got {sorted(unknown)}"
                )

    def kl(self, logp: torch.Tensor, ratio: torch.Tensor, fields: Fields) -> torch.Tensor:
        kl = kl_penalty(logp, fields["ref_logprobs"], self.kl_estimator)
        # TRL's use_bias_correction_kl: the importance ratio (differentiable) makes the
        # KL gradient the unbiased reverse-KL gradient off-policy
        return kl * ratio if self.kl_bias_correction else kl

    def terms(self, logp: torch.Tensor, ratio: torch.Tensor, fields: Fields) -> torch.Tensor:
        """[M] ``kl_coef * KL - entropy_coef * H`` (0 when both are off)."""
        out = torch.zeros_like(logp)
        if self.kl_coef:
            out = out + self.kl_coef * self.kl(logp, ratio, fields)
        if self.entropy_coef:
            out = out - self.entropy_coef * fields["entropy"]
        return out

    def add(self, loss: torch.Tensor, logp: torch.Tensor, ratio: torch.Tensor, fields: Fields) -> torch.Tensor:
        """The policy term with the regularizers, unless they are a part of their own."""
        if self.aggregation is not None or not (self.kl_coef or self.entropy_coef):
            return loss
        return loss + self.terms(logp, ratio, fields)

    def part(self, log_ratio_clip: float | None) -> dict[str, LossPart] | None:
        """The loss's ``parts``: the regularizers under their own reduction, or None."""
        if self.aggregation is None or not (self.kl_coef or self.entropy_coef):
            return None

        def per_token(logp: torch.Tensor, fields: Fields) -> torch.Tensor:
            return self.terms(logp, _ratio(logp, fields["old_logprobs"], log_ratio_clip), fields)

        return {"regularizers": LossPart(per_token, **self.aggregation)}

    def metrics(self, logp: torch.Tensor, ratio: torch.Tensor, fields: Fields) -> dict[str, torch.Tensor]:
        out = {"ratio/mean": ratio}
        if self.kl_coef:
            out["kl"] = self.kl(logp, ratio, fields)
        if "entropy" in fields:
            out["entropy"] = fields["entropy"]
        return out


def _policy_loss(
    name: str,
    per_token: Callable,
    metrics: Callable,
    reg: _Regularizers,
    reduction: str,
    scale: float,
    temperature: float,
    count_empty_sequences: bool,
    log_ratio_clip: float | None = None,
) -> TokenLoss:
    """The :class:`TokenLoss` of a policy loss: it reads the advantages and the old
    log-probs, plus what its regularizers need (a part of their own when they have
    their own reduction)."""
    return TokenLoss(
        per_token,
        reduction=reduction,
        scale=scale,
        required_fields=("advantages", "old_logprobs") + reg.required,
        name=name,
        temperature=temperature,
        needs_entropy=reg.needs_entropy,
        metrics=metrics,
        count_empty_sequences=count_empty_sequences,
        parts=reg.part(log_ratio_clip),
    )


def _check_bound(name: str, value: float | None, low: float) -> None:
    if value is not None and not value > low:
        raise ValueError(f"{name} must be > {low}, got {value}")


def ppo_clip(
    clip_eps: float = 0.2,
    reduction: str = "token_mean",
    *,
    clip_eps_high: float | None = None,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    delta: float | None = None,
    clip_ratio_c: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_bias_correction: bool = False,
    entropy_coef: float = 0.0,
    log_entropy: bool = False,
    temperature: float = 1.0,
    log_ratio_clip: float | None = None,
    scale: float = 1.0,
    count_empty_sequences: bool = False,
) -> TokenLoss:
    """PPO/GRPO clipped surrogate, per token:
    ``l = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) + kl_coef*KL - entropy_coef*H``.

    Args:
        clip_eps: both clip bounds, unless ``epsilon_low`` / ``epsilon_high`` set one
            (TRL ``epsilon``, verl ``clip_ratio``).
        epsilon_low, epsilon_high: asymmetric bounds (DAPO's clip-higher: 0.2 / 0.28;
            TRL ``epsilon`` / ``epsilon_high``, verl ``clip_ratio_low`` / ``clip_ratio_high``).
            ``clip_eps_high`` is an older name of ``epsilon_high``.
        delta: TRL's ``delta`` (two-sided clipping, INTELLECT-2): ``r`` is capped at
            ``delta`` inside the min. Must be > 1 (TRL recommends > 1 + eps_high).
        clip_ratio_c: verl's dual clip: for ``A < 0`` the loss is at most
            ``-A * clip_ratio_c``. Must be > 1 (verl: 3.0 when enabled).
        kl_coef, kl_estimator: ``+ kl_coef * KL`` against the field ``ref_logprobs``
            (TRL ``beta`` with ``k3``; verl ``kl_loss_coef`` / ``kl_loss_type``).
        kl_bias_correction: multiply the KL by ``r`` (TRL ``use_bias_correction_kl``, on
            by default in TRL 1.x).
        entropy_coef: ``- entropy_coef * entropy`` per token, under this loss's
            reduction (verl ``entropy_coeff``); TreeRuntime and the baselines pass the entropy.
        log_entropy: report the mean entropy as a metric (also needs the entropy).
        temperature: the sampling temperature (see :class:`TokenLoss`).
        log_ratio_clip: clamp ``logp - old_logprobs`` to ``[-c, c]`` before ``exp``
            (verl: 20).
        scale, count_empty_sequences: see :class:`TokenLoss`.
    """
    if clip_eps_high is not None and epsilon_high is not None:
        raise ValueError("pass epsilon_high or clip_eps_high (its older name), not both")
    high_given = epsilon_high if epsilon_high is not None else clip_eps_high
    low, high = clip_bounds(clip_eps, epsilon_low, high_given)
    _check_bound("delta", delta, 1.0)
    _check_bound("clip_ratio_c", clip_ratio_c, 1.0)
    reg = _Regularizers(kl_coef, kl_estimator, kl_bias_correction, entropy_coef, log_entropy)
    surrogate = _PPOClip(low, high, delta, clip_ratio_c, log_ratio_clip, reg)
    return _policy_loss(
        "ppo_clip", surrogate.per_token, surrogate.metrics, reg, reduction, scale, temperature, count_empty_sequences
    )


def clip_bounds(epsilon: float, epsilon_low: float | None, epsilon_high: float | None) -> tuple[float, float]:
    """``(low, high)``: ``epsilon`` for each bound not given; both must be >= 0."""
    low = epsilon if epsilon_low is None else epsilon_low
    high = epsilon if epsilon_high is None else epsilon_high
    if low < 0 or high < 0:
        raise ValueError(f"clip bounds must be non-negative, got low={low}, high={high}")
    return low, high


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, delta: float | None
) -> torch.Tensor:
    """``-min(min(r, delta)*A, clip(r, 1-low, 1+high)*A)`` elementwise (PPO's clipped
    objective, negated; ``delta``: TRL's cap of ``r`` inside the min, or None)."""
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.minimum(capped * adv, torch.clamp(ratio, 1.0 - low, 1.0 + high) * adv)


@dataclass(frozen=True)
class _PPOClip:
    """The per-token terms and metrics of :func:`ppo_clip` (its checked options)."""

    low: float
    high: float
    delta: float | None
    clip_ratio_c: float | None
    log_ratio_clip: float | None
    reg: _Regularizers

    def per_token(self, logp: torch.Tensor, fields: Fields) -> torch.Tensor:
        adv = fields["advantages"]
        ratio = _ratio(logp, fields["old_logprobs"], self.log_ratio_clip)
        loss = clipped_surrogate(ratio, adv, self.low, self.high, self.delta)
        if self.clip_ratio_c is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -adv * self.clip_ratio_c), loss)
        return self.reg.add(loss, logp, ratio, fields)

    def metrics(self, logp: torch.Tensor, fields: Fields) -> dict[str, torch.Tensor]:
        adv = fields["advantages"]
        ratio = _ratio(logp, fields["old_logprobs"], self.log_ratio_clip)
        r = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)  # TRL reports the capped ratio's
        low, high = self.low, self.high
        is_low, is_high = (r < 1.0 - low) & (adv < 0), (r > 1.0 + high) & (adv > 0)
        out = {
            "clip_ratio/low_mean": is_low.float(),
            "clip_ratio/high_mean": is_high.float(),
            "clip_ratio/region_mean": (is_low | is_high).float(),
        }
        if self.clip_ratio_c is not None:  # verl's pg_clipfrac_lower: the dual clip is the active branch
            surrogate_ratio = torch.maximum(r, torch.clamp(r, 1.0 - low, 1.0 + high))
            out["clip_ratio/dual_mean"] = ((surrogate_ratio > self.clip_ratio_c) & (adv < 0)).float()
        return {**out, **self.reg.metrics(logp, ratio, fields)}


def cispo(
    ratio_max: float,
    reduction: str = "token_mean",
    *,
    ratio_min: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_bias_correction: bool = False,
    entropy_coef: float = 0.0,
    log_entropy: bool = False,
    temperature: float = 1.0,
    log_ratio_clip: float | None = None,
    scale: float = 1.0,
    count_empty_sequences: bool = False,
) -> TokenLoss:
    """CISPO (MiniMax-M1): ``l = -sg(clip(r, ratio_min, ratio_max)) * A * logp`` (+ KL,
    entropy as in :func:`ppo_clip`). The clipped importance weight carries no gradient,
    so every token keeps its policy gradient.

    TRL (``loss_type="cispo"``): ``cispo(ratio_max=epsilon_high)`` (ScaleRL recommends
    5.0), no lower bound, ``token_mean`` with the global counts. verl
    (``loss_mode="cispo"``): ``cispo(ratio_min=1-clip_ratio_low,
    ratio_max=1+clip_ratio_high, log_ratio_clip=20.0)``.

    Metrics: ``cispo_clip_ratio`` (TRL: ``r > ratio_max`` and ``A > 0``),
    ``clip_ratio/low_mean`` / ``clip_ratio/high_mean`` (the weight is clipped from
    below / above, whatever ``A``; verl's ``pg_clipfrac`` is their sum), ``ratio/mean``.
    """
    _check_bound("ratio_max", ratio_max, 0.0)
    if ratio_min is not None and not 0 <= ratio_min < ratio_max:
        raise ValueError(f"ratio_min must be in [0, ratio_max), got {ratio_min}")
    reg = _Regularizers(kl_coef, kl_estimator, kl_bias_correction, entropy_coef, log_entropy)

    def per_token(logp: torch.Tensor, fields: Fields) -> torch.Tensor:
        ratio = _ratio(logp, fields["old_logprobs"], log_ratio_clip)
        weight = torch.clamp(ratio, min=ratio_min, max=ratio_max).detach()
        return reg.add(-weight * fields["advantages"] * logp, logp, ratio, fields)

    def metrics(logp: torch.Tensor, fields: Fields) -> dict[str, torch.Tensor]:
        ratio = _ratio(logp, fields["old_logprobs"], log_ratio_clip)
        below = ratio < ratio_min if ratio_min is not None else torch.zeros_like(ratio, dtype=torch.bool)
        out = {
            "cispo_clip_ratio": ((ratio > ratio_max) & (fields["advantages"] > 0)).float(),
            "clip_ratio/low_mean": below.float(),
            "clip_ratio/high_mean": (ratio > ratio_max).float(),
        }
        return {**out, **reg.metrics(logp, ratio, fields)}

    return _policy_loss(
        "cispo", per_token, metrics, reg, reduction, scale, temperature, count_empty_sequences
    )


def sapo(
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    reduction: str = "sequence_mean",
    *,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_bias_correction: bool = False,
    entropy_coef: float = 0.0,
    log_entropy: bool = False,
    temperature: float = 1.0,
    log_ratio_clip: float | None = None,
    scale: float = 1.0,
    count_empty_sequences: bool = False,
    regularizer_aggregation: Mapping[str, Any] | None = None,
) -> TokenLoss:
    """SAPO (soft adaptive policy optimization): a smooth gate instead of the clip,
    ``l = -(4/tau) * sigmoid(tau * (r - 1)) * A`` with ``tau = tau_pos`` where ``A > 0``
    and ``tau_neg`` elsewhere (+ KL, entropy as in :func:`ppo_clip`).

    TRL ``loss_type="sapo"`` (``sapo_temperature_pos`` / ``_neg``) aggregates like
    ``grpo`` (``count_empty_sequences=True``), KL and entropy included. verl
    ``loss_mode="sapo"`` (``tau_pos`` / ``tau_neg``, ``log_ratio_clip=20.0``) aggregates
    the policy term with ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says, and its
    KL and entropy terms with ``loss_agg_mode``::

        sapo(tau_pos, tau_neg, log_ratio_clip=20.0, **aggregation("seq-mean-token-mean"),
             regularizer_aggregation=aggregation(loss_agg_mode), kl_coef=..., entropy_coef=...)

    ``regularizer_aggregation``: the reduction keywords (``reduction``, ``scale``,
    ``count_empty_sequences``, as :func:`aggregation` returns them) of the KL and entropy
    terms, a :class:`~dtree.losses.LossPart` of their own; None: the same reduction as
    the policy term. One ``forward_backward`` computes both.
    """
    _check_bound("tau_pos", tau_pos, 0.0)
    _check_bound("tau_neg", tau_neg, 0.0)
    reg = _Regularizers(kl_coef, kl_estimator, kl_bias_correction, entropy_coef, log_entropy, regularizer_aggregation)

    def per_token(logp: torch.Tensor, fields: Fields) -> torch.Tensor:
        adv = fields["advantages"]
        ratio = _ratio(logp, fields["old_logprobs"], log_ratio_clip)
        tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
        return reg.add(-torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, logp, ratio, fields)

    def metrics(logp: torch.Tensor, fields: Fields) -> dict[str, torch.Tensor]:
        return reg.metrics(logp, _ratio(logp, fields["old_logprobs"], log_ratio_clip), fields)

    return _policy_loss(
        "sapo", per_token, metrics, reg, reduction, scale, temperature, count_empty_sequences, log_ratio_clip
    )
