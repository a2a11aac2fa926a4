"""Input checks and error reports shared by the runtime and the baselines, so every
method rejects the same inputs with the same messages."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from .models import ModelSpec
from .tree import Forest

__all__ = ["validate_forest", "refuse_paths_beyond_window", "raise_non_finite", "model_placement", "check_trainable"]


def model_placement(params: Iterable[torch.Tensor]) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of the model now: those of its first floating-point parameter.

    Read at every call, not once at construction, so ``model.to(torch.bfloat16)``,
    ``.cuda()`` or materializing a meta model after wrapping it just work (the runtime
    reallocates its KV stack when they change). A parameter still on the meta device
    gets an error naming the fix."""
    first = None
    for p in params:
        if p.device.type == "meta":
            raise ValueError(
                "the model has parameters on the meta device (not materialized): materialize it first, e.g. "
                "model.to_empty(device=...) and initialize or load its weights, then call dtree again"
            )
        if first is None and p.is_floating_point():
            first = p
    if first is None:
        raise ValueError("the model has no floating-point parameters")
    return first.device, first.dtype


def check_trainable(params: Iterable[torch.Tensor]) -> None:
    """A training step needs at least one parameter that requires grad."""
    if not any(p.requires_grad for p in params):
        raise ValueError(
            "no parameter of the model requires grad, so a training step has nothing to compute: unfreeze some "
            "(p.requires_grad_(True), or peft.get_peft_model for adapters), or use TreeRuntime.logprobs for inference"
        )


def validate_forest(forest: Forest, spec: ModelSpec) -> None:
    """Host-side checks before any kernel runs: token ids inside the vocabulary, paths
    within the model's positions. Errors name the sequence."""
    bad = np.flatnonzero(forest.lin_tokens >= spec.vocab_size)
    if bad.size:
        s, t = forest.locate(int(bad[0]))
        raise ValueError(
            f"token id {int(forest.lin_tokens[bad[0]])} at sequence {s}, position {t} is outside the "
            f"vocabulary (size {spec.vocab_size})"
        )
    lengths = forest.sequence_lengths()
    s = int(np.argmax(lengths))
    if spec.max_positions is not None and lengths[s] > spec.max_positions:
        raise ValueError(
            f"sequence {s} has {int(lengths[s])} tokens, longer than the model's {spec.max_positions} positions"
        )


def refuse_paths_beyond_window(forest: Forest, spec: ModelSpec, method: str) -> None:
    """For a ``method`` whose attention ignores sliding windows: refuse paths longer
    than the model's window (within it, windowed and full attention agree)."""
    lengths = forest.sequence_lengths()
    s = int(np.argmax(lengths))
    if spec.sliding_window is not None and lengths[s] > spec.sliding_window:
        raise ValueError(
            f"sequence {s} has {int(lengths[s])} tokens, longer than the model's sliding window "
            f"({spec.sliding_window}); the {method} does not implement sliding-window attention "
            "(dtree.TreeRuntime does)"
        )


def raise_non_finite(forest: Forest, loss_lin: np.ndarray, term_log: list[tuple[int, torch.Tensor]]) -> None:
    """Raise a ValueError naming the first (sequence, position) whose loss term is not
    finite. ``term_log`` holds ``(offset, terms)`` pairs: ``terms[i]`` is the weighted
    loss of linearized token ``loss_lin[offset + i]``."""
    bad = []
    for e0, t in term_log:
        local = torch.nonzero(~torch.isfinite(t)).flatten().cpu().numpy()
        bad += [(int(loss_lin[e0 + i]), float(t[i])) for i in local]
    lin, value = min(bad) if bad else (None, float("nan"))
    where = "at sequence {}, position {}".format(*forest.locate(lin)) if lin is not None else "in the sum"
    raise ValueError(f"loss is not finite ({value}) {where}; param.grad was left as it was before this call")
