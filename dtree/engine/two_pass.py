"""The two-pass path: losses that are not sums of per-token terms.

A :class:`~dtree.losses.SequenceLoss` (``gspo``), any callable
``fn(logprobs, forest) -> 0-d tensor``, or a :class:`LogprobLoss` (such a function at a
temperature, optionally of the entropies too) is trained in two passes over one
schedule, two plain calls in :meth:`dtree.TreeRuntime.forward_backward`::

    pass 1   log-probs (and entropies) of every prediction (no grad), per sequence [len-1]
    host     value = fn(logprobs[, entropy]); w = d value / d logprobs (w_H = d value / d entropy)
             (:func:`logprob_grads`)
    pass 2   one DFS training walk of the surrogate sum_k w[k] * logp[k] (+ w_H[k] * H[k])
             (:func:`surrogate`)

Pass 2's gradient is that of ``fn`` because it replays pass 1's random draws (the
log-prob walk rewinds the generators), so it differentiates the log-probs ``fn`` saw.
The runtime runs pass 1's walk (:meth:`dtree.engine.walk.TreeWalk.logprobs`), then
:func:`host_step` and :func:`surrogate`, then pass 2's training walk
(:func:`dtree.engine.walk.train_step`); :func:`two_pass_output` makes its output the step's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ..forest.forest import Forest
from ..losses import LogprobLoss, SequenceLoss, TokenLoss
from .step import StepOutput

__all__ = [
    "LogprobGrads",
    "LogprobPass",
    "SequenceLossFn",
    "check_temperature",
    "host_step",
    "logprob_entropy_surrogate",
    "logprob_grad_weights",
    "logprob_grads",
    "loss_temperature",
    "logprob_surrogate",
    "needs_entropy",
    "surrogate",
    "two_pass_output",
]

SequenceLossFn = Callable[[list[torch.Tensor], Forest], torch.Tensor]


def check_temperature(temperature: float) -> float:
    if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive number (the sampling temperature), got {temperature!r}")
    return float(temperature)


def _identity(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return logp


def logprob_surrogate(temperature: float) -> TokenLoss:
    """``sum_k w[k] * logp[k]`` at ``temperature``, with the weights given per step: its
    gradient is the one seeded by ``w = d loss / d logp``."""
    return TokenLoss(_identity, reduction="sum", name="logprob_grad", use_loss_mask=False, temperature=temperature)


def _entropy_and_logprob(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return logp * fields["logprob_grad"] + fields["entropy"] * fields["entropy_grad"]


def logprob_entropy_surrogate(
    forest: Forest, w_logp: np.ndarray, w_entropy: np.ndarray, temperature: float
) -> tuple[Forest, TokenLoss, np.ndarray]:
    """``sum_k w_logp[k] * logp[k] + w_entropy[k] * H[k]``: the forest carrying both [N]
    gradients as fields, the loss, and its [N] weights (1 where either is non-zero)."""
    fields = {**forest.fields, "logprob_grad": w_logp, "entropy_grad": w_entropy}
    loss = TokenLoss(
        _entropy_and_logprob, reduction="sum", name="logprob_entropy_grad", use_loss_mask=False,
        temperature=temperature, needs_entropy=True, required_fields=("logprob_grad", "entropy_grad"),
    )
    return dataclasses.replace(forest, fields=fields), loss, ((w_logp != 0) | (w_entropy != 0)).astype(np.float64)


def logprob_grad_weights(forest: Forest, grads: Sequence[torch.Tensor | None]) -> np.ndarray:
    """[N] per linearized token: d loss / d logp, from per sequence [len-1] gradients
    (0 at sequence starts and for a sequence whose gradient is None)."""
    if len(grads) != forest.num_sequences:
        raise ValueError(f"got {len(grads)} gradient tensors for {forest.num_sequences} sequences")
    w = np.zeros(forest.num_linearized_tokens)
    for s, g in enumerate(grads):
        n = int(forest.seq_offsets[s + 1] - forest.seq_offsets[s]) - 1
        if g is None:
            continue
        g = g.detach().double().cpu().numpy().reshape(-1)
        if g.shape[0] != n:
            raise ValueError(f"gradient for sequence {s} has {g.shape[0]} values, expected {n} (len - 1)")
        bad = np.flatnonzero(~np.isfinite(g))
        if bad.size:
            raise ValueError(f"loss gradient is {g[bad[0]]} at sequence {s}, position {int(bad[0]) + 1}")
        w[forest.seq_offsets[s] + 1 : forest.seq_offsets[s + 1]] = g
    return w


def _evaluate(
    loss_fn, forest: Forest, lps: list[torch.Tensor], ents: list[torch.Tensor] | None, temperature: float
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(the loss value, its log-prob leaves, its entropy leaves: empty unless it reads them)."""
    leaves = [lp.detach().requires_grad_(True) for lp in lps]
    ent_leaves: list[torch.Tensor] = []
    with torch.enable_grad():
        if isinstance(loss_fn, SequenceLoss):
            value = loss_fn(leaves, forest, temperature=temperature, entropy=ents)
        elif isinstance(loss_fn, LogprobLoss) and loss_fn.needs_entropy:
            ent_leaves = [e.detach().requires_grad_(True) for e in ents]
            value = loss_fn.fn(leaves, forest, ent_leaves)
        elif isinstance(loss_fn, LogprobLoss):
            value = loss_fn.fn(leaves, forest)
        else:
            value = loss_fn(leaves, forest)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"a two-pass loss function must return a one-element tensor, got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
    return value, leaves, ent_leaves


@dataclass(frozen=True)
class LogprobGrads:
    """The host step between the two passes: the loss's value and its [N] gradients per
    linearized token w.r.t. the log-probs (``logp``) and the entropies (``entropy``,
    None when the loss does not read them), both at ``temperature``."""

    value: float
    temperature: float  # of the log-probs (and entropies) differentiated
    logp: np.ndarray
    entropy: np.ndarray | None


def logprob_grads(
    loss_fn: SequenceLoss | LogprobLoss | SequenceLossFn, forest: Forest, lps: list[torch.Tensor],
    ents: list[torch.Tensor] | None, temperature: float,
) -> LogprobGrads:
    """Evaluate ``loss_fn`` on pass 1's per sequence log-probs (and entropies) and
    differentiate it: a ValueError when it is not finite or does not depend on them."""
    value, leaves, ent_leaves = _evaluate(loss_fn, forest, lps, ents, temperature)
    loss_value = float(value.detach())
    if not np.isfinite(loss_value):
        raise ValueError(f"the loss function returned {loss_value}; param.grad was not touched")
    if not value.requires_grad:
        raise ValueError(
            "the loss function returned a value that does not depend on the log-probs it was given (detached, or "
            "computed from something else): no gradient would reach the model. Compute it from the logprobs "
            "argument with torch operations; param.grad was not touched"
        )
    grads = torch.autograd.grad(value.reshape(()), leaves + ent_leaves, allow_unused=True)
    w = logprob_grad_weights(forest, list(grads[: len(leaves)]))
    w_entropy = logprob_grad_weights(forest, list(grads[len(leaves) :])) if ent_leaves else None
    return LogprobGrads(loss_value, temperature, w, w_entropy)


def needs_entropy(loss_fn: SequenceLoss | LogprobLoss | SequenceLossFn) -> bool:
    """Whether pass 1 computes the entropies too."""
    return isinstance(loss_fn, (SequenceLoss, LogprobLoss)) and loss_fn.needs_entropy


@dataclass(frozen=True)
class LogprobPass:
    """Pass 1 and the host step: over ``forest``, per sequence [len-1] ``logprobs`` and
    ``entropy`` (None unless the loss reads them), and the loss's ``grads``."""

    forest: Forest
    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None
    grads: LogprobGrads


def loss_temperature(loss_fn: SequenceLoss | LogprobLoss | SequenceLossFn) -> float:
    """The temperature of the log-probs pass 1 computes: the loss's, a plain callable's 1."""
    return getattr(loss_fn, "temperature", 1.0)


def host_step(
    loss_fn: SequenceLoss | LogprobLoss | SequenceLossFn, forest: Forest, lps: list[torch.Tensor],
    ents: list[torch.Tensor] | None,
) -> LogprobPass:
    """The host step after pass 1 (the log-prob walk, at :func:`loss_temperature`, with the
    entropies when :func:`needs_entropy`): the loss's value and gradients on those log-probs."""
    return LogprobPass(forest, lps, ents, logprob_grads(loss_fn, forest, lps, ents, loss_temperature(loss_fn)))


def surrogate(forest: Forest, grads: LogprobGrads) -> tuple[Forest, TokenLoss, np.ndarray]:
    """Pass 2's token loss, whose gradient is the loss's: ``sum_k w[k] * logp[k]`` (plus
    ``w_H[k] * H[k]`` when the loss read the entropies), with the forest it trains on and
    its [N] weights."""
    if grads.entropy is None or not grads.entropy.any():
        return forest, logprob_surrogate(grads.temperature), grads.logp
    return logprob_entropy_surrogate(forest, grads.logp, grads.entropy, grads.temperature)


def two_pass_output(
    out: StepOutput, loss_fn: SequenceLoss | LogprobLoss | SequenceLossFn, first: LogprobPass, return_logprobs: bool
) -> StepOutput:
    """Pass 2's output as the step's: the loss's value, a SequenceLoss's metrics on pass 1's
    log-probs, and those log-probs (entropies) when ``return_logprobs``."""
    out.loss = first.grads.value
    if isinstance(loss_fn, SequenceLoss):
        out.metrics.update(loss_fn.metric_values(first.logprobs, first.forest, entropy=first.entropy))
    if return_logprobs:
        out.logprobs, out.entropy = first.logprobs, first.entropy
    return out
