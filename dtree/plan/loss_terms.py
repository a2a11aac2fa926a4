"""The predictions a pass computes and the loss terms that read them, per model call.

Each non-root unique token is predicted once, from its predecessor's row, in the group
(model call) that holds that row (:func:`every_prediction`, built with the schedule).
Each linearized token but a sequence's first is a loss term reading its unique token's
prediction. A training pass makes terms only of the linearized tokens with a non-zero
weight, and keeps only the predictions they read (:func:`select_loss_terms`): on agentic
trees ~10% of the ~1M linearized tokens of a 64k tree have one (prompts and tool outputs
are masked), and making every term first cost the plan ~25 ms of host time per step.
A log-prob pass keeps every prediction (:func:`all_predictions`). :func:`every_term` makes
them all (the reference :func:`select_loss_terms` is tested against).
Host-side numpy, linear in the predictions plus the terms made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..forest.forest import Forest

__all__ = [
    "LossTerms",
    "Predictions",
    "all_predictions",
    "every_prediction",
    "every_term",
    "loss_terms",
    "prediction_lin",
    "select_loss_terms",
]


@dataclass(frozen=True)
class Predictions:
    """Every prediction of a schedule, per group (``P`` predictions, ``U`` unique tokens,
    ``G`` groups), concatenated over groups like the :class:`Schedule` arrays:
        pred_hidden_row: [P] row (local to its group) whose hidden state predicts ``pred_unique``
        pred_unique:  [P] unique token predicted (its id is the label)
        pred_offsets: [G+1] group ``g``'s predictions are ``[pred_offsets[g], pred_offsets[g+1])``
        unique_group: [U] the group predicting each unique token (-1: a root, never predicted)
        unique_index: [U] its index among that group's predictions
    """

    pred_hidden_row: np.ndarray
    pred_unique: np.ndarray
    pred_offsets: np.ndarray
    unique_group: np.ndarray
    unique_index: np.ndarray


@dataclass(frozen=True)
class LossTerms:
    """The predictions one pass computes and the loss terms that read them, per group.

    Concatenated over groups like the :class:`Schedule` arrays (``P`` predictions,
    ``E`` loss terms, ``G`` groups):
        pred_hidden_row: [P] row (local to its group) whose hidden state predicts ``pred_unique``
        pred_unique:  [P] unique token predicted (its id is the label)
        pred_offsets: [G+1] group ``g``'s predictions are ``[pred_offsets[g], pred_offsets[g+1])``
        loss_lin:     [E] linearized token index of each loss term
        loss_pred:    [E] index (local to its group's predictions) of the term's log-prob
        loss_offsets: [G+1] group ``g``'s terms are ``[loss_offsets[g], loss_offsets[g+1])``
    """

    pred_hidden_row: np.ndarray
    pred_unique: np.ndarray
    pred_offsets: np.ndarray
    loss_lin: np.ndarray
    loss_pred: np.ndarray
    loss_offsets: np.ndarray


def prediction_lin(forest: Forest) -> np.ndarray:
    """[N - S] int64 linearized index of every predicted token, in order: all tokens
    but each sequence's first (index 0 is never predicted)."""
    keep = np.ones(forest.num_linearized_tokens, dtype=bool)
    keep[forest.seq_offsets[:-1]] = False
    return np.flatnonzero(keep)


def every_prediction(forest: Forest, row_unique: np.ndarray, row_offsets: np.ndarray) -> Predictions:
    """Phase 5 of :func:`dtree.plan.schedule.build_schedule`: every non-root unique token's
    prediction, from its predecessor's row, in the group that holds that row."""
    num_groups = len(row_offsets) - 1
    row_group = np.repeat(np.arange(num_groups), np.diff(row_offsets))
    unique_group = np.empty(forest.num_unique_tokens, dtype=np.int64)
    unique_local = np.empty(forest.num_unique_tokens, dtype=np.int64)
    unique_group[row_unique] = row_group
    unique_local[row_unique] = np.arange(len(row_unique)) - row_offsets[row_group]

    predicted = np.flatnonzero(forest.predecessor >= 0)
    p_group = unique_group[forest.predecessor[predicted]]
    order = _group_order(p_group, num_groups)
    pred_unique = predicted[order]
    pred_group = p_group[order]
    pred_offsets = np.searchsorted(pred_group, np.arange(num_groups + 1))
    index = np.zeros(forest.num_unique_tokens, dtype=np.int64)
    index[pred_unique] = np.arange(len(pred_unique)) - pred_offsets[pred_group]
    group = np.full(forest.num_unique_tokens, -1, dtype=np.int64)
    group[pred_unique] = pred_group
    return Predictions(
        pred_hidden_row=unique_local[forest.predecessor[pred_unique]], pred_unique=pred_unique,
        pred_offsets=pred_offsets, unique_group=group, unique_index=index,
    )


def loss_terms(preds: Predictions, forest: Forest, lin: np.ndarray) -> LossTerms:
    """Every prediction, and a loss term for each linearized token of ``lin`` (ascending,
    none a sequence's first), in the group of its prediction."""
    num_groups = len(preds.pred_offsets) - 1
    unique = forest.lin_unique[lin]
    group = preds.unique_group[unique]
    order = _group_order(group, num_groups)
    return LossTerms(
        pred_hidden_row=preds.pred_hidden_row, pred_unique=preds.pred_unique, pred_offsets=preds.pred_offsets,
        loss_lin=lin[order], loss_pred=preds.unique_index[unique[order]],
        loss_offsets=np.searchsorted(group[order], np.arange(num_groups + 1)),
    )


def every_term(preds: Predictions, forest: Forest) -> LossTerms:
    """Every prediction and every loss term (each linearized token after its sequence's first)."""
    return loss_terms(preds, forest, prediction_lin(forest))


def all_predictions(preds: Predictions) -> LossTerms:
    """Every prediction and no loss term: what a log-prob pass needs."""
    empty = np.zeros(0, dtype=np.int64)
    return LossTerms(preds.pred_hidden_row, preds.pred_unique, preds.pred_offsets, empty, empty,
                     np.zeros_like(preds.pred_offsets))


def select_loss_terms(preds: Predictions, forest: Forest, weights: np.ndarray) -> LossTerms:
    """The loss terms of the linearized tokens with a non-zero weight, and only the
    predictions they read, so masked tokens (prompts, tool outputs) never reach the LM head.
    The same as :func:`every_term` filtered by weight, without making the masked terms.

    Args:
        weights: [N] weight of each linearized token's loss term (``TokenLoss.weights``;
            a sequence's first token has none, whatever its weight).
    """
    keep = weights != 0
    keep[forest.seq_offsets[:-1]] = False
    terms = loss_terms(preds, forest, np.flatnonzero(keep))
    g = len(preds.pred_offsets) - 1
    grp = np.repeat(np.arange(g), np.diff(terms.loss_offsets))
    gpred = preds.pred_offsets[grp] + terms.loss_pred  # index into all of the schedule's predictions
    # the predictions some term reads, in order, and each one's rank among them: a mark and a
    # running count (linear; a sort of the terms took 20 ms on a 64k agentic tree)
    read = np.zeros(len(preds.pred_unique), dtype=bool)
    read[gpred] = True
    used = np.flatnonzero(read)
    before = np.concatenate([[0], np.cumsum(read, dtype=np.int64)])  # [i]: read predictions before i
    pred_offsets = before[preds.pred_offsets]
    return LossTerms(
        pred_hidden_row=preds.pred_hidden_row[used],
        pred_unique=preds.pred_unique[used],
        pred_offsets=pred_offsets,
        loss_lin=terms.loss_lin,
        loss_pred=before[gpred] - pred_offsets[grp],
        loss_offsets=terms.loss_offsets,
    )


def _group_order(group: np.ndarray, num_groups: int) -> np.ndarray:
    """The stable order of items by ``group`` (ids in ``[0, num_groups)``): numpy sorts
    16-bit keys by radix (2 ms for the ~1M loss terms of a 64k agentic tree, 22 ms as int64)."""
    keys = group.astype(np.int16) if num_groups < 2**15 else group
    return np.argsort(keys, kind="stable")
