"""The pieces every dtree loss builds on: the reductions and the counts they divide by
(:class:`Normalization`), the prediction mask, each token's reduction weight, the
settings check, and :class:`LossPart` (a term under a reduction of its own).

:mod:`dtree.losses.token_loss`, :mod:`dtree.losses.policy_losses` and :mod:`dtree.losses.sequence_loss` build
on this module; the semantics are described in :mod:`dtree.losses`, the namespace users
read, which re-exports all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol

import numpy as np
import torch

from ..forest.forest import Forest
from .aggregation import TRL_LOSS_TYPES, VERL_LOSS_AGG_MODES

__all__ = [
    "REDUCTIONS",
    "LossPart",
    "MaskChoice",
    "Normalization",
    "PerTokenFn",
    "check_loss_settings",
    "local_normalization",
    "prediction_mask",
    "reduction_weights",
]

REDUCTIONS = ("sum", "token_mean", "sequence_mean", "seq_mean_token_sum")

PerTokenFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


class MaskChoice(Protocol):
    """What :meth:`Normalization.from_forests` reads of a loss (a ``TokenLoss`` or a
    ``SequenceLoss``): whether it weights terms by the ``loss_mask`` field."""

    use_loss_mask: bool


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
    def from_forests(cls, forests: Iterable[Forest], loss: MaskChoice | None = None) -> "Normalization":
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


def prediction_mask(forest: Forest, use_loss_mask: bool = True, at: np.ndarray | None = None) -> np.ndarray:
    """[N] float64 loss-mask of every linearized token, 0 at each sequence's first token;
    with ``at`` ([E] linearized indices), only those entries (no [N] array is made)."""
    if at is not None:
        at = np.asarray(at, dtype=np.int64)
        mask = forest.fields["loss_mask"][at] if use_loss_mask and "loss_mask" in forest.fields else np.ones(len(at))
        starts = forest.seq_offsets[:-1]
        mask[starts[np.searchsorted(starts, at, side="right") - 1] == at] = 0.0  # each sequence's first token
        return mask
    if use_loss_mask and "loss_mask" in forest.fields:
        mask = forest.fields["loss_mask"].copy()
    else:
        mask = np.ones(forest.num_linearized_tokens)
    mask[forest.seq_offsets[:-1]] = 0.0
    return mask


def local_normalization(forest: Forest, use_loss_mask: bool = True) -> Normalization:
    """This forest's counts (what a single-process step divides by)."""
    return _counts(forest, prediction_mask(forest, use_loss_mask))


def _counts(forest: Forest, mask: np.ndarray, per_seq: np.ndarray | None = None) -> Normalization:
    """:func:`local_normalization` of the forest's :func:`prediction_mask` ``mask`` (and its
    per-sequence sums, when the caller has them)."""
    if per_seq is None:
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
    ``loss = sum_k weights[k] * l[k]`` is the reduction (see :mod:`dtree.losses`).

    One [N] array is made (the mask, then divided in place): on a 64k agentic tree N is
    ~1.1M linearized tokens, and each fresh [N] temporary cost ~3-5 ms of host time
    before the step's first kernel (page faults on the H200 machine's host, sampled)."""
    w = prediction_mask(forest, use_loss_mask)
    per_seq = np.add.reduceat(w, forest.seq_offsets[:-1]) if reduction == "sequence_mean" else None
    norm = norm or _counts(forest, w, per_seq)
    if reduction == "token_mean":
        _check_divisor("loss_tokens", norm.loss_tokens, w)
        if norm.loss_tokens > 0:
            np.divide(w, norm.loss_tokens, out=w)
        else:
            w.fill(0.0)
    elif reduction != "sum":  # the mean over sequences of a per-sequence token mean or token sum
        if count_empty_sequences and norm.num_sequences is None:
            raise ValueError(
                "count_empty_sequences=True needs Normalization.num_sequences (the number of all sequences); "
                "build the Normalization with Normalization.from_forests"
            )
        num_seqs = norm.num_sequences if count_empty_sequences else norm.loss_sequences
        _check_divisor("num_sequences" if count_empty_sequences else "loss_sequences", num_seqs, w)
        if num_seqs <= 0:
            w.fill(0.0)
        elif reduction == "sequence_mean":
            # each token's divisor is its sequence's mask sum times the number of sequences;
            # sequences whose mask sums to 0 get weight 0
            divisor = np.repeat(per_seq * num_seqs, forest.sequence_lengths())
            np.divide(w, divisor, out=w, where=divisor != 0)
            w[np.repeat(per_seq <= 0, forest.sequence_lengths())] = 0.0
        else:  # seq_mean_token_sum
            np.divide(w, num_seqs, out=w)
    if scale != 1.0:
        w *= scale
    return w


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
