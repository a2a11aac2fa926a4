"""verl's actor loss settings as dtree losses: which ``policy_loss.loss_mode`` values map
exactly onto dtree's losses (the one-pass fast path of :mod:`dtree.integrations.verl`;
any other setting runs verl's own ``loss_function`` on the two-pass path), and the
counts verl's trainer divides by. Imports no verl: the config is read by attribute, so
a verl ``ActorConfig`` or any object with its field names works.

What each verl 0.9.1 name computes (``verl/trainer/ppo/core_algos.py``,
``verl/workers/utils/losses.py::ppo_loss``) and its dtree equal:

=============  ========================================================================
``vanilla``    ``ppo_clip(clip_ratio_low, epsilon_high=clip_ratio_high, clip_ratio_c=...,
               log_ratio_clip=20)`` (verl's dual clip is always on)
``cispo``      ``cispo(ratio_min=1-clip_ratio_low, ratio_max=1+clip_ratio_high, log_ratio_clip=20)``
``sapo``       ``sapo(tau_pos, tau_neg, log_ratio_clip=20)``, the policy term under
               ``seq-mean-token-mean`` and the KL and entropy under ``loss_agg_mode``
``gspo``       ``gspo(clip_ratio_low, epsilon_high=clip_ratio_high, log_ratio_max=10,
               ratio_gradient="token")`` (two passes; no entropy bonus there)
=============  ========================================================================

plus ``+ kl_loss_coef * KL`` (``use_kl_loss``; :data:`VERL_KL_TYPES`) and ``-
entropy_coeff * H`` (when the entropy is computed), each aggregated with
``loss_agg_mode`` (:func:`dtree.losses.aggregation`).
"""

from __future__ import annotations

from typing import Any

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
    sapo,
)

__all__ = ["FAST_PATH_LOSS_MODES", "VERL_KL_TYPES", "verl_actor_loss", "verl_kl_estimator", "verl_normalization"]

FAST_PATH_LOSS_MODES = ("vanilla", "cispo", "sapo", "gspo")
# verl kl_loss_type -> dtree kl_estimator (verl's "k3" is the clamped estimator dtree
# calls low_var_kl; dtree's "k3" is TRL's unclamped one). A trailing "+" keeps the
# value and takes k2's gradient in both.
VERL_KL_TYPES = {
    "kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "low_var_kl",
}


def verl_kl_estimator(kl_loss_type: str) -> str:
    """dtree's ``kl_estimator`` for verl's ``kl_loss_type`` (ValueError naming the known ones)."""
    plus = kl_loss_type.endswith("+")
    base = kl_loss_type[:-1] if plus else kl_loss_type
    if base not in VERL_KL_TYPES:
        raise ValueError(
            f"verl kl_loss_type {kl_loss_type!r} has no dtree estimator; known: "
            f"{sorted(VERL_KL_TYPES)} and each with a trailing '+'"
        )
    return VERL_KL_TYPES[base] + ("+" if plus else "")


def _policy_mode(config: Any) -> str:
    policy = getattr(config, "policy_loss", None)
    if policy is None:
        return "vanilla"
    return policy.get("loss_mode", "vanilla") if hasattr(policy, "get") else getattr(policy, "loss_mode", "vanilla")


def _clip_bounds(config: Any) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return float(low), float(high)


def verl_normalization(forest: Forest, batch_num_tokens: float | None, global_batch_size: float | None) -> Normalization:
    """The counts verl's ``agg_loss`` divides by: its ``batch_num_tokens`` and
    ``global_batch_size`` when given, else the forest's own."""
    local = local_normalization(forest)
    return Normalization(
        loss_tokens=float(local.loss_tokens if batch_num_tokens is None else batch_num_tokens),
        loss_sequences=local.loss_sequences,
        num_sequences=float(global_batch_size) if global_batch_size is not None else local.num_sequences,
    )


def verl_actor_loss(
    config: Any,
    forest: Forest,
    *,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    dp_size: int = 1,
    response_width: int | None = None,
    with_entropy: bool = False,
    temperature: float = 1.0,
    log_entropy: bool = False,
) -> tuple[TokenLoss | SequenceLoss, Normalization]:
    """The dtree loss equal to verl's ``ppo_loss(config, ...)`` on ``forest`` (one rank's
    batch), and the counts to pass as ``normalization``.

    Args:
        config: verl's actor config (``policy_loss.loss_mode``, ``clip_ratio*``,
            ``clip_ratio_c``, ``tau_pos``/``tau_neg``, ``loss_agg_mode``,
            ``loss_scale_factor``, ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``,
            ``entropy_coeff``).
        forest: this rank's sequences, with ``loss_mask`` (verl's ``response_mask``).
        batch_num_tokens, global_batch_size: verl's global counts (the mini-batch's loss
            tokens over all ranks; its rows over all ranks). None: this forest's own
            (verl's ``agg_loss`` without them: rows without a loss token are not counted).
        dp_size: verl multiplies each rank's loss by it (FSDP averages gradients).
        response_width: what ``seq-mean-token-sum-norm`` divides by without ``loss_scale_factor``.
        with_entropy: the entropy is computed (verl: ``calculate_entropy`` or
            ``entropy_coeff != 0``), so ``- entropy_coeff * H`` is in the loss.
        temperature: the rollout temperature the log-probs are taken at.
        log_entropy: compute the entropy for metrics (``return_logprobs`` returns it).

    Raises:
        ValueError: a ``loss_mode`` outside :data:`FAST_PATH_LOSS_MODES`, an unknown KL
            type, GSPO with an entropy bonus, or missing global counts with ``dp_size > 1``.
    """
    mode = _policy_mode(config)
    if mode not in FAST_PATH_LOSS_MODES:
        raise ValueError(
            f"verl policy_loss.loss_mode={mode!r} has no dtree equal (fast path: {FAST_PATH_LOSS_MODES}); "
            "run verl's own loss on dtree's two-pass path instead"
        )
    if dp_size > 1 and (batch_num_tokens is None or global_batch_size is None):
        raise ValueError("with dp_size > 1 verl needs the global batch_num_tokens and global_batch_size")
    agg_mode = config.loss_agg_mode
    factor = config.loss_scale_factor if config.loss_scale_factor is not None else response_width
    if agg_mode == "seq-mean-token-sum-norm" and not factor:
        raise ValueError("seq-mean-token-sum-norm without actor.loss_scale_factor needs response_width")
    agg = aggregation(agg_mode, loss_scale_factor=factor if agg_mode == "seq-mean-token-sum-norm" else None)
    counted = global_batch_size is not None
    norm = verl_normalization(forest, batch_num_tokens, global_batch_size)

    def reduction(kw: dict) -> dict:
        kw = dict(kw)
        if "count_empty_sequences" in kw:
            kw["count_empty_sequences"] = counted
        kw["scale"] = kw.get("scale", 1.0) * dp_size
        return kw

    entropy_coef = float(config.entropy_coeff) if with_entropy else 0.0
    kl = dict(kl_coef=float(config.kl_loss_coef), kl_estimator=verl_kl_estimator(config.kl_loss_type)) if (
        config.use_kl_loss) else {}
    low, high = _clip_bounds(config)
    common = dict(temperature=temperature, log_entropy=log_entropy or with_entropy, **kl)
    if mode == "gspo":
        if entropy_coef:
            raise ValueError("verl gspo with an entropy bonus (entropy_coeff != 0) runs on the two-pass path only")
        loss = gspo(low, epsilon_high=high, log_ratio_max=10.0, ratio_gradient="token", **common, **reduction(agg))
        return loss, norm
    common.update(entropy_coef=entropy_coef, log_ratio_clip=20.0)
    if mode == "vanilla":
        return ppo_clip(epsilon_low=low, epsilon_high=high, clip_ratio_c=float(config.clip_ratio_c), **common,
                        **reduction(agg)), norm
    if mode == "cispo":
        return cispo(ratio_min=1.0 - low, ratio_max=1.0 + high, **common, **reduction(agg)), norm
    policy = reduction(aggregation("seq-mean-token-mean"))  # sapo: verl hard-codes it for the policy term
    return sapo(float(config.tau_pos), float(config.tau_neg), regularizer_aggregation=reduction(agg), **common,
                **policy), norm
