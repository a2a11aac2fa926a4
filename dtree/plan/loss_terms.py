"""The predictions a pass computes and the loss terms that read them, per model call.

Each non-root unique token is predicted once, from its predecessor's row, in the group
(model call) that holds that row; each linearized token but a sequence's first is a loss
term reading its unique token's prediction (:func:`every_term`, built with the schedule).
A training pass keeps the terms with a non-zero weight and only the predictions they read
(:func:`select_loss_terms`); a log-prob pass keeps every prediction (:func:`all_predictions`).
Host-side numpy, linear in the loss terms (~1M on a 64k agentic tree).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..forest.forest import Forest

__all__ = ["LossTerms", "all_predictions", "every_term", "prediction_lin", "select_loss_terms"]


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


def all_predictions(every: LossTerms) -> LossTerms:
    """Of a schedule's terms (``Schedule.terms``), every prediction and no loss term: what a
    log-prob pass needs."""
    empty = np.zeros(0, dtype=np.int64)
    return replace(every, loss_lin=empty, loss_pred=empty, loss_offsets=np.zeros_like(every.loss_offsets))


def select_loss_terms(every: LossTerms, weights: np.ndarray) -> LossTerms:
    """Of a schedule's terms (``Schedule.terms``), the loss terms with a non-zero weight,
    and only the predictions they read, so masked tokens (prompts, tool outputs) never
    reach the LM head.

    Args:
        weights: [N] weight of each linearized token's loss term (``TokenLoss.weights``).
    """
    g = len(every.loss_offsets) - 1
    entry_group = np.repeat(np.arange(g), np.diff(every.loss_offsets))
    keep = weights[every.loss_lin] != 0
    lin, grp = every.loss_lin[keep], entry_group[keep]
    gpred = every.pred_offsets[grp] + every.loss_pred[keep]  # index into all of the schedule's predictions
    # the predictions some kept term reads, in order, and each one's rank among them: a
    # mark and a running count (linear; a sort of the ~1M terms of a 64k agentic tree took 20 ms)
    read = np.zeros(len(every.pred_unique), dtype=bool)
    read[gpred] = True
    used = np.flatnonzero(read)
    before = np.concatenate([[0], np.cumsum(read, dtype=np.int64)])  # [i]: read predictions before i
    pred_offsets = before[every.pred_offsets]
    return LossTerms(
        pred_hidden_row=every.pred_hidden_row[used],
        pred_unique=every.pred_unique[used],
        pred_offsets=pred_offsets,
        loss_lin=lin,
        loss_pred=before[gpred] - pred_offsets[grp],
        loss_offsets=np.searchsorted(grp, np.arange(g + 1)),
    )


def every_term(forest: Forest, row_unique: np.ndarray, row_offsets: np.ndarray) -> LossTerms:
    """Phase 5 of :func:`dtree.plan.schedule.build_schedule`: every prediction (each non-root unique token, from its predecessor's
    row, in the group that holds that row) and every loss term (each linearized token
    after its sequence's first, in the group of its prediction)."""
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
    pred_index = np.empty(forest.num_unique_tokens, dtype=np.int64)  # local to the group's predictions
    pred_index[pred_unique] = np.arange(len(pred_unique)) - pred_offsets[pred_group]
    unique_pred_group = np.full(forest.num_unique_tokens, -1, dtype=np.int64)
    unique_pred_group[pred_unique] = pred_group

    lin_idx = prediction_lin(forest)
    l_group = unique_pred_group[forest.lin_unique[lin_idx]]
    order = _group_order(l_group, num_groups)
    loss_lin = lin_idx[order]
    return LossTerms(
        pred_hidden_row=unique_local[forest.predecessor[pred_unique]], pred_unique=pred_unique,
        pred_offsets=pred_offsets, loss_lin=loss_lin, loss_pred=pred_index[forest.lin_unique[loss_lin]],
        loss_offsets=np.searchsorted(l_group[order], np.arange(num_groups + 1)),
    )


def _group_order(group: np.ndarray, num_groups: int) -> np.ndarray:
    """The stable order of items by ``group`` (ids in ``[0, num_groups)``): numpy sorts
    16-bit keys by radix (2 ms for the ~1M loss terms of a 64k agentic tree, 22 ms as int64)."""
    keys = group.astype(np.int16) if num_groups < 2**15 else group
    return np.argsort(keys, kind="stable")
