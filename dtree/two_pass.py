"""The two-pass path: losses that are not sums of per-token terms.

A :class:`~dtree.losses.SequenceLoss` (``gspo``), any callable
``fn(logprobs, forest) -> 0-d tensor``, or a :class:`LogprobLoss` (such a function at a
temperature, optionally of the entropies too) is trained in two passes over one
schedule::

    pass 1   log-probs (and entropies) of every prediction (no grad), per sequence [len-1]
    host     value = fn(logprobs[, entropy]); w = d value / d logprobs (w_H = d value / d entropy)
    pass 2   one DFS training step of the surrogate sum_k w[k] * logp[k] (+ w_H[k] * H[k])

Pass 2's gradient is that of ``fn`` because it replays pass 1's random draws (the
runtime restores the generator state), so it differentiates the log-probs ``fn`` saw.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import rng
from .losses import LogprobLoss, SequenceLoss, TokenLoss
from .schedule import Schedule
from .step import StepOutput
from .tree import Forest

__all__ = [
    "SequenceLossFn",
    "check_temperature",
    "logprob_entropy_surrogate",
    "logprob_grad_weights",
    "logprob_surrogate",
    "two_pass_step",
]

SequenceLossFn = Callable[[list[torch.Tensor], Forest], torch.Tensor]
# (forest, schedule, with_entropy, temperature) -> (per sequence log-probs, entropies or None)
LogprobsFn = Callable[[Forest, Schedule, bool, float], tuple[list[torch.Tensor], list[torch.Tensor] | None]]
# (forest, schedule, [N] d loss / d logp, loss value, temperature, [N] d loss / d entropy or None) -> the output
BackwardFn = Callable[[Forest, Schedule, np.ndarray, float, float, np.ndarray | None], StepOutput]


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


def two_pass_step(
    forest: Forest,
    sched: Schedule,
    loss_fn: SequenceLoss | LogprobLoss | SequenceLossFn,
    temperature: float,
    return_logprobs: bool,
    *,
    logprobs: LogprobsFn,
    backward: BackwardFn,
    device: torch.device,
) -> StepOutput:
    """Both passes over one schedule (the same calls, the same random draws)."""
    start = rng.capture(device)
    with_entropy = isinstance(loss_fn, (SequenceLoss, LogprobLoss)) and loss_fn.needs_entropy
    with torch.no_grad():
        lps, ents = logprobs(forest, sched, with_entropy, temperature)
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
    rng.restore(start, device)  # pass 2 replays pass 1's draws (dropout masks)
    out = backward(forest, sched, w, loss_value, temperature, w_entropy)
    if isinstance(loss_fn, SequenceLoss):
        out.metrics.update(loss_fn.metric_values(lps, forest, entropy=ents))
    if return_logprobs:
        out.logprobs, out.entropy = lps, ents
    return out
