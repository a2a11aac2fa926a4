"""Loss weights and normalization (the HF grad-accumulation bug class)."""

import numpy as np
import pytest
import torch

from dtree import Forest
from dtree.losses import Normalization, TokenLoss, kl_penalty, nll, ppo_clip


def forest():
    return Forest.from_sequences([[1, 2, 3, 4], [1, 2, 5], [7]], loss_mask=[[1, 1, 0, 1], [1, 1, 1], [1]])


def test_token_mean_counts_predictions_only():
    w = nll("token_mean").weights(forest())
    # predictions with mask 1: seq0 t=1,3; seq1 t=1,2 -> 4; first tokens never count
    assert w.tolist() == [0, 0.25, 0, 0.25, 0, 0.25, 0.25, 0]


def test_sequence_mean_skips_empty_sequences():
    w = nll("sequence_mean").weights(forest())
    assert np.allclose(w, [0, 1 / 4, 0, 1 / 4, 0, 1 / 4, 1 / 4, 0])  # 2 active sequences, 2 tokens each


def test_sum_and_scale_and_global_normalization():
    f = forest()
    assert nll("sum", scale=0.5).weights(f).tolist() == [0, 0.5, 0, 0.5, 0, 0.5, 0.5, 0]
    w = nll("token_mean").weights(f, Normalization(loss_tokens=8, loss_sequences=4))
    assert np.allclose(w.sum(), 0.5)


def test_ppo_clip_matches_formula():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    f = {"advantages": torch.tensor([1.0, -1.0, 2.0]), "old_logprobs": torch.tensor([-1.5, -1.0, -0.5])}
    got = ppo_clip(0.2).per_token(logp, f)
    r = torch.exp(logp - f["old_logprobs"])
    want = -torch.minimum(r * f["advantages"], r.clamp(0.8, 1.2) * f["advantages"])
    torch.testing.assert_close(got, want)


def test_kl_estimators_nonnegative_k3():
    lp, ref = torch.randn(100), torch.randn(100)
    assert torch.all(kl_penalty(lp, ref, "k3") >= -1e-7)
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), lp - ref)


def test_custom_loss_validation():
    with pytest.raises(ValueError, match="reduction"):
        TokenLoss(lambda lp, f: -lp, reduction="avg")
    with pytest.raises(ValueError, match="kl_estimator"):
        ppo_clip(kl_estimator="k9")
