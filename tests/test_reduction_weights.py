"""``reduction_weights`` (one [N] array, divided in place) bit for bit against the plain
definition it replaced (a fresh array per step of the formula), and ``prediction_mask``'s
gathered form against indexing the whole mask, on random forests and masks (fractional
weights, all-zero sequences), every reduction, scales and given normalizations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import sequence_batches

import dtree
from dtree.losses.reduction import REDUCTIONS, Normalization, local_normalization, prediction_mask, reduction_weights


def plain_weights(forest, reduction, *, scale=1.0, use_loss_mask=True, count_empty_sequences=False, norm=None):
    """The definition: ``loss = sum_k w[k] l[k]`` for each reduction, one expression each."""
    mask = prediction_mask(forest, use_loss_mask)
    norm = norm or local_normalization(forest, use_loss_mask)
    if reduction == "sum":
        w = mask
    elif reduction == "token_mean":
        w = mask / norm.loss_tokens if norm.loss_tokens > 0 else np.zeros_like(mask)
    else:
        num_seqs = norm.num_sequences if count_empty_sequences else norm.loss_sequences
        w = np.zeros_like(mask)
        if num_seqs > 0:
            if reduction == "sequence_mean":
                per_tok = np.repeat(np.add.reduceat(mask, forest.seq_offsets[:-1]), forest.sequence_lengths())
                ok = per_tok > 0
                w[ok] = mask[ok] / (per_tok[ok] * num_seqs)
            else:
                w = mask / num_seqs
    return w * scale


@st.composite
def masked_forests(draw):
    seqs = draw(sequence_batches(max_sequences=6, max_len=10))
    values = st.sampled_from([0.0, 0.0, 1.0, 1.0, 0.5, 0.25, 3.0])
    masks = [draw(st.lists(values, min_size=len(s), max_size=len(s))) for s in seqs]
    return dtree.Forest.from_sequences(seqs, loss_mask=masks)


@settings(max_examples=150, deadline=None)
@given(
    forest=masked_forests(),
    reduction=st.sampled_from(REDUCTIONS),
    scale=st.sampled_from([1.0, 0.5, 1 / 3, 7.0]),
    use_loss_mask=st.booleans(),
    count_empty=st.booleans(),
    given_norm=st.booleans(),
)
def test_weights_equal_the_definition(forest, reduction, scale, use_loss_mask, count_empty, given_norm):
    norm = Normalization(7.0, 3.0, 5.0) if given_norm else None
    kw = dict(scale=scale, use_loss_mask=use_loss_mask, count_empty_sequences=count_empty, norm=norm)
    want = plain_weights(forest, reduction, **kw)
    got = reduction_weights(forest, reduction, **kw)
    assert got.dtype == np.float64 and got.shape == want.shape
    assert np.array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(forest=masked_forests(), use_loss_mask=st.booleans(), data=st.data())
def test_prediction_mask_at_indices(forest, use_loss_mask, data):
    n = forest.num_linearized_tokens
    at = np.asarray(data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n)), dtype=np.int64)
    assert np.array_equal(prediction_mask(forest, use_loss_mask, at), prediction_mask(forest, use_loss_mask)[at])
