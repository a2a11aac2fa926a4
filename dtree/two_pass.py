"""The two-pass path: losses that are not sums of per-token terms.

A :class:`~dtree.losses.SequenceLoss` (``gspo``) or any callable
``fn(logprobs, forest) -> 0-d tensor`` is trained in two passes over one schedule::

    pass 1   log-probs of every prediction (no grad), per sequence [len-1]
    host     value = fn(logprobs); w = d value / d logprobs   (autograd on the leaves)
    pass 2   one DFS training step of the surrogate sum_k w[k] * logp[k]

Pass 2's gradient is that of ``fn`` because it replays pass 1's random draws (the
runtime restores the generator state), so it differentiates the log-probs ``fn`` saw.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import rng
from .losses import SequenceLoss, TokenLoss
from .schedule import Schedule
from .step import StepOutput
from .tree import Forest

__all__ = ["SequenceLossFn", "check_temperature", "logprob_grad_weights", "logprob_surrogate", "two_pass_step"]

SequenceLossFn = Callable[[list[torch.Tensor], Forest], torch.Tensor]
# (forest, schedule, with_entropy, temperature) -> (per sequence log-probs, entropies or None)
LogprobsFn = Callable[[Forest, Schedule, bool, float], tuple[list[torch.Tensor], list[torch.Tensor] | None]]
# (forest, schedule, [N] d loss / d logp, loss value, temperature) -> the step's output
BackwardFn = Callable[[Forest, Schedule, np.ndarray, float, float], StepOutput]


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


def two_pass_step(
    forest: Forest,
    sched: Schedule,
    loss_fn: SequenceLoss | SequenceLossFn,
    temperature: float,
    return_logprobs: bool,
    *,
    logprobs: LogprobsFn,
    backward: BackwardFn,
    device: torch.device,
) -> StepOutput:
    """Both passes over one schedule (the same calls, the same random draws)."""
    start = rng.capture(device)
    sequence_loss = isinstance(loss_fn, SequenceLoss)
    with_entropy = sequence_loss and loss_fn.needs_entropy
    with torch.no_grad():
        lps, ents = logprobs(forest, sched, with_entropy, temperature)
    leaves = [lp.detach().requires_grad_(True) for lp in lps]
    with torch.enable_grad():
        if sequence_loss:
            value = loss_fn(leaves, forest, temperature=temperature, entropy=ents)
        else:
            value = loss_fn(leaves, forest)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"a two-pass loss function must return a one-element tensor, got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
    loss_value = float(value.detach())
    if not np.isfinite(loss_value):
        raise ValueError(f"the loss function returned {loss_value}; param.grad was not touched")
    if not value.requires_grad:
        raise ValueError(
            "the loss function returned a value that does not depend on the log-probs it was given (detached, or "
            "computed from something else): no gradient would reach the model. Compute it from the logprobs "
            "argument with torch operations; param.grad was not touched"
        )
    grads = torch.autograd.grad(value.reshape(()), leaves, allow_unused=True)
    w = logprob_grad_weights(forest, list(grads))
    rng.restore(start, device)  # pass 2 replays pass 1's draws (dropout masks)
    out = backward(forest, sched, w, loss_value, temperature)
    if sequence_loss:
        out.metrics.update(loss_fn.metric_values(lps, forest, entropy=ents))
    if return_logprobs:
        out.logprobs, out.entropy = lps, ents
    return out
