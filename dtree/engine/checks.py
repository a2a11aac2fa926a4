"""Input checks and error reports shared by the runtime and the baselines, so every
method rejects the same inputs with the same messages."""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from ..forest.forest import Forest
from ..losses import LogprobLoss, Normalization, SequenceLoss, TokenLoss
from ..models import ModelSpec
from .grad_guard import KEPT_NOTE

__all__ = [
    "check_forest",
    "check_loss_argument",
    "check_normalization",
    "check_trainable",
    "check_training_call",
    "checked_step_loss",
    "raise_non_finite",
    "refuse_paths_beyond_window",
    "validate_forest",
]


def check_trainable(params: Iterable[torch.Tensor]) -> None:
    """A training step needs at least one parameter that requires grad."""
    if not any(p.requires_grad for p in params):
        raise ValueError(
            "no parameter of the model requires grad, so a training step has nothing to compute: unfreeze some "
            "(p.requires_grad_(True), or peft.get_peft_model for adapters), or use TreeRuntime.logprobs for inference"
        )


def check_training_call(params: Iterable[torch.Tensor], what: str = "forward_backward") -> None:
    """A training step computes gradients: refused under ``torch.inference_mode()`` and
    under ``torch.no_grad()`` (where a user asked for no gradients, and a step that
    filled ``param.grad`` anyway would surprise), and with no trainable parameter."""
    if torch.is_inference_mode_enabled():
        raise ValueError(
            f"{what} cannot run under torch.inference_mode() (no gradients there): call it outside the "
            "inference_mode block; TreeRuntime.logprobs works inside one"
        )
    if not torch.is_grad_enabled():
        raise ValueError(
            f"{what} computes gradients, but gradient mode is off (torch.no_grad() or "
            "torch.set_grad_enabled(False)): call it outside that block; for log-probs without gradients use "
            "TreeRuntime.logprobs, which works inside one"
        )
    check_trainable(params)


def check_forest(forest: Any, name: str = "forest") -> None:
    """``forest`` is a :class:`Forest` (a TypeError naming how to build one otherwise)."""
    if isinstance(forest, Forest):
        return
    if isinstance(forest, (torch.Tensor, np.ndarray)) and forest.ndim == 2:
        hint = "a padded batch: dtree.Forest.from_padded(input_ids, attention_mask, ...)"
    elif isinstance(forest, Mapping) and "input_ids" in forest:
        hint = "dtree.Forest.from_padded(batch['input_ids'], batch['attention_mask'], ...)"
    else:
        hint = "dtree.Forest.from_sequences(sequences, loss_mask=..., ...)"
    raise TypeError(f"{name} must be a dtree.Forest, got {type(forest).__name__}: build one with {hint}")


def _returns_a_loss(fn: Any) -> bool:
    """Whether ``fn`` is annotated to return a TokenLoss or SequenceLoss (a loss factory)."""
    try:
        annotation = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):  # builtins and C callables have no signature
        return False
    if isinstance(annotation, str):
        return any(name in annotation for name in ("TokenLoss", "SequenceLoss"))
    return isinstance(annotation, type) and issubclass(annotation, (TokenLoss, SequenceLoss))


def check_loss_argument(loss: Any) -> None:
    """``loss`` is a TokenLoss, a SequenceLoss, a LogprobLoss or a callable ``fn(logprobs,
    forest)``; an uncalled loss factory (``dtree.losses.ppo_clip``), a loss class, or
    aggregation's keyword dict get a TypeError naming the fix."""
    if isinstance(loss, (TokenLoss, SequenceLoss, LogprobLoss)):
        return
    if isinstance(loss, type):
        raise TypeError(
            f"loss is the class {loss.__name__}, not a loss: build one, e.g. dtree.losses.TokenLoss(fn, reduction=...)"
        )
    if isinstance(loss, Mapping):
        raise TypeError(
            "loss is a dict (dtree.losses.aggregation's keyword arguments?): pass them to a loss, e.g. "
            "dtree.losses.ppo_clip(**dtree.losses.aggregation('grpo'))"
        )
    if not callable(loss):
        raise TypeError(
            f"loss must be a dtree.losses.TokenLoss, a SequenceLoss or a callable fn(logprobs, forest), got "
            f"{type(loss).__name__}"
        )
    name = getattr(loss, "__qualname__", getattr(loss, "__name__", type(loss).__name__))
    module = getattr(loss, "__module__", "") or ""
    if _returns_a_loss(loss):
        where = "dtree.losses." if module.startswith("dtree.") else ""
        raise TypeError(
            f"loss is the loss factory {where}{name}, not called: call it to build the loss, e.g. "
            f"forward_backward(forest, {where}{name}(...))"
        )
    try:
        inspect.signature(loss).bind(None, None)
    except TypeError:
        raise TypeError(
            f"loss {name} is a callable that does not take (logprobs, forest): a two-pass loss is "
            "fn(logprobs: list[Tensor], forest) -> 0-d tensor; per-token losses are dtree.losses.TokenLoss"
        ) from None
    except ValueError:  # no signature to check
        pass


def check_normalization(normalization: Any) -> None:
    """``normalization`` is None or a :class:`Normalization` (its values are checked
    when it is built)."""
    if normalization is None or isinstance(normalization, Normalization):
        return
    hint = (
        ": build one, dtree.Normalization(**counts)"
        if isinstance(normalization, Mapping)
        else ": dtree.Normalization.from_forests(micro_batches, loss) gives the counts of one optimizer step"
    )
    raise TypeError(f"normalization must be a dtree.Normalization or None, got {type(normalization).__name__}{hint}")


def validate_forest(forest: Forest, spec: ModelSpec) -> None:
    """Host-side checks before any kernel runs: a Forest, token ids inside the
    vocabulary, paths within the model's positions. Errors name the sequence."""
    check_forest(forest)
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


def raise_non_finite(
    forest: Forest, loss_lin: np.ndarray, term_log: list[tuple[int, torch.Tensor]],
    note: str = KEPT_NOTE,
) -> None:
    """Raise a ValueError naming the first (sequence, position) whose loss term is not
    finite. ``term_log`` holds ``(offset, terms)`` pairs: ``terms[i]`` is the weighted
    loss of linearized token ``loss_lin[offset + i]``; ``note`` ends the message (what became
    of ``param.grad``: :mod:`dtree.engine.grad_guard`)."""
    bad = []
    for e0, t in term_log:
        local = torch.nonzero(~torch.isfinite(t)).flatten().cpu().numpy()
        bad += [(int(loss_lin[e0 + i]), float(t[i])) for i in local]
    lin, value = min(bad) if bad else (None, float("nan"))
    where = "at sequence {}, position {}".format(*forest.locate(lin)) if lin is not None else "in the sum"
    raise ValueError(f"loss is not finite ({value}) {where}; {note}")


def checked_step_loss(loss: Any, forest: Forest, normalization: Normalization | None) -> Any:
    """The loss a ``forward_backward`` step trains, its fields checked against ``forest``: a
    TokenLoss as given; a SequenceLoss with ``normalization`` (when given) in place of its
    own, refusing two different ones; a LogprobLoss or plain callable, refusing a
    ``normalization`` (it normalizes itself)."""
    if isinstance(loss, TokenLoss):
        loss.check_fields(forest, supports_temperature=True, supports_entropy=True)
        return loss
    if isinstance(loss, SequenceLoss):
        loss.check_fields(forest)
        if normalization is None:
            return loss
        if loss.normalization is not None and loss.normalization != normalization:
            raise ValueError(
                f"loss {loss.name!r} carries normalization={loss.normalization} and forward_backward got "
                f"normalization={normalization}: pass one of them"
            )
        return loss.with_normalization(normalization)
    if normalization is not None:
        raise ValueError(
            "normalization= applies to a TokenLoss or a dtree.losses.SequenceLoss; a plain two-pass callable "
            "fn(logprobs, forest) divides by whatever it chooses: normalize inside it, or wrap its per-token "
            "terms in a SequenceLoss"
        )
    return loss
