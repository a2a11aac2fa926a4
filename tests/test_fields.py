"""Per-sequence scalar fields (broadcast), Forest.with_fields and the log-prob round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import make_model

import dtree
from dtree import Forest

SEQS = [[1, 2, 3], [1, 2, 4], [7, 8, 9]]  # three sequences of three tokens: S == len


def test_one_number_per_sequence_is_broadcast():
    want = np.repeat([0.5, -1.0, 2.0], 3)
    for given in (
        [0.5, -1.0, 2.0],
        np.array([0.5, -1.0, 2.0]),
        torch.tensor([0.5, -1.0, 2.0]),
        [torch.tensor(0.5), np.float32(-1.0), 2],
    ):
        assert np.array_equal(Forest.from_sequences(SEQS, advantages=given).fields["advantages"], want), given


def test_entries_decide_by_their_own_dimensionality():
    """A [S] tensor is per sequence, a [S, L] tensor per token, even when S == L."""
    per_token = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]])
    f = Forest.from_sequences(SEQS, a=per_token, b=per_token[:, 0], c=[1.0, [9.0, 9.5, 9.9], 3.0])
    assert f.fields["a"].tolist() == list(range(9))
    assert f.fields["b"].tolist() == [0.0] * 3 + [3.0] * 3 + [6.0] * 3
    assert f.fields["c"].tolist() == [1.0] * 3 + [9.0, 9.5, 9.9] + [3.0] * 3


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"a": 1.0}, "field 'a' must hold one entry per sequence"),
        ({"a": torch.tensor(1.0)}, "field 'a' must hold one entry per sequence"),
        ({"a": [1.0, 2.0]}, "field 'a' has 2 entries but there are 3 sequences"),
        ({"a": [[1.0, 2.0], 1.0, 1.0]}, r"has 2 values but the sequence has 3 tokens .*use Forest.with_fields"),
        ({"a": [np.ones((3, 1)), 1.0, 1.0]}, r"must be a number \(per sequence\) or 1-D \(per token\), got shape \(3, 1\)"),
        ({"a": [float("nan"), 1.0, 1.0]}, "field 'a' of sequence 0 at position 0 is nan"),
        ({"a": ["x", 1.0, 1.0]}, "field 'a' of sequence 0 must be a number or a 1-D list of numbers"),
    ],
)
def test_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        Forest.from_sequences(SEQS, **fields)


def test_with_fields_shares_the_trie_and_leaves_the_original():
    f = Forest.from_sequences(SEQS, advantages=[1.0, 2.0, 3.0])
    g = f.with_fields(old_logprobs=[[0.0, -1.0, -2.0], [-1.0, -2.0], 0.5], advantages=[4.0, 5.0, 6.0])
    assert g.tokens is f.tokens and g.lin_unique is f.lin_unique and g.seq_offsets is f.seq_offsets
    assert set(f.fields) == {"advantages"} and f.fields["advantages"][0] == 1.0
    assert g.fields["old_logprobs"].tolist() == [0.0, -1.0, -2.0, 0.0, -1.0, -2.0, 0.5, 0.5, 0.5]
    assert g.fields["advantages"][0] == 4.0
    h = g.with_fields(advantages=None)
    assert set(h.fields) == {"old_logprobs"}
    with pytest.raises(ValueError, match=r"has 1 values but the sequence has 3 tokens \(expected 3 \(or 2, prediction-aligned\)"):
        f.with_fields(x=[[1.0], 1.0, 1.0])
    with pytest.raises(ValueError, match="position 2 is inf"):
        f.with_fields(x=[[1.0, float("inf")], 1.0, 1.0])  # prediction-aligned: value 1 is position 2


def test_logprob_round_trip():
    """rt.logprobs -> with_fields -> a PPO step is exactly on-policy (ratio 1)."""
    model = make_model("llama")
    seqs = [[5, 6, 7, 8], [5, 6, 9], [5]]
    forest = Forest.from_sequences(seqs, advantages=[1.0, -1.0, 0.5])
    rt = dtree.TreeRuntime(model)
    lps = rt.logprobs(forest)
    forest = forest.with_fields(old_logprobs=lps)
    for s in range(3):
        assert forest.field("old_logprobs", s)[0] == 0.0
        np.testing.assert_array_equal(forest.field("old_logprobs", s)[1:], lps[s].numpy())
    # token-aligned [len] values (0 at index 0) give the same forest
    again = forest.with_fields(old_logprobs=[torch.cat([lp.new_zeros(1), lp]) for lp in lps])
    np.testing.assert_array_equal(again.fields["old_logprobs"], forest.fields["old_logprobs"])
    out = rt.forward_backward(forest, dtree.losses.ppo_clip(0.2, reduction="sum"))
    assert out.loss == pytest.approx(-(1.0 * 3 - 1.0 * 2), abs=1e-5)  # r = 1: -sum(A) over predictions


def test_subset_and_jsonl_keep_broadcast_fields(tmp_path):
    f = Forest.from_sequences(SEQS, advantages=[1.0, 2.0, 3.0])
    assert f.subset([2]).fields["advantages"].tolist() == [3.0] * 3
    f.to_jsonl(str(tmp_path / "b.jsonl"))
    assert Forest.from_jsonl(str(tmp_path / "b.jsonl")).fields["advantages"].tolist() == f.fields["advantages"].tolist()
