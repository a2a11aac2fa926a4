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
    # global counts (e.g. a micro-batch of a larger step): every term divides by them, token by token
    w = nll("token_mean").weights(f, Normalization(loss_tokens=8, loss_sequences=4))
    assert w.tolist() == [0, 1 / 8, 0, 1 / 8, 0, 1 / 8, 1 / 8, 0]
    w = nll("sequence_mean").weights(f, Normalization(loss_tokens=8, loss_sequences=4))
    assert w.tolist() == [0, 1 / 8, 0, 1 / 8, 0, 1 / 8, 1 / 8, 0]  # 1/4 sequences x 1/2 of each one's 2 tokens
    w = nll("seq_mean_token_sum").weights(f, Normalization(loss_tokens=8, loss_sequences=4))
    assert w.tolist() == [0, 1 / 4, 0, 1 / 4, 0, 1 / 4, 1 / 4, 0]


def test_ppo_clip_matches_formula():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    f = {"advantages": torch.tensor([1.0, -1.0, 2.0]), "old_logprobs": torch.tensor([-1.5, -1.0, -0.5])}
    got = ppo_clip(0.2).per_token(logp, f)
    r = torch.exp(logp - f["old_logprobs"])
    want = -torch.minimum(r * f["advantages"], r.clamp(0.8, 1.2) * f["advantages"])
    torch.testing.assert_close(got, want)


def test_kl_estimator_values_by_hand():
    """KL(pi || ref) estimators at log-ratios logp - ref = 1, -1, 0, against numbers
    worked out by hand: k2 = r^2 / 2, k3 = exp(-r) + r - 1 (e = 2.718281828459045)."""
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -1.0, -0.5], dtype=torch.float64)
    want = {
        "k1": [1.0, -1.0, 0.0],
        "k2": [0.5, 0.5, 0.0],
        "k3": [0.36787944117144233, 0.7182818284590451, 0.0],  # 1/e, e - 2
        "low_var_kl": [0.36787944117144233, 0.7182818284590451, 0.0],  # within its clamps
        "abs": [1.0, 1.0, 0.0],
    }
    grad = {  # d/dlogp: k2 -> r; k3 -> 1 - exp(-r)
        "k2": [1.0, -1.0, 0.0],
        "k3": [0.6321205588285577, -1.718281828459045, 0.0],  # 1 - 1/e, 1 - e
    }
    for name, values in want.items():
        got = kl_penalty(lp, ref, name)
        assert got.tolist() == pytest.approx(values, rel=1e-15, abs=1e-15), name
        if name in grad:
            (g,) = torch.autograd.grad(got.sum(), lp)
            assert g.tolist() == pytest.approx(grad[name], rel=1e-15, abs=1e-15), name
    # inside ppo_clip at ratio 1 with zero advantages, the loss is kl_coef times the estimate
    fields = {"advantages": torch.zeros(3, dtype=torch.float64), "old_logprobs": lp.detach(), "ref_logprobs": ref}
    for name in ("k2", "k3"):
        got = ppo_clip(0.2, kl_coef=0.1, kl_estimator=name).per_token(lp.detach(), fields)
        assert got.tolist() == pytest.approx([0.1 * v for v in want[name]], rel=1e-15, abs=1e-15), name


def test_clip_eps_high_by_hand():
    """Clip-higher (DAPO): the upper bound 1 + 0.28 with ``clip_eps_high`` (the older
    name) and ``epsilon_high`` alike, the lower one 1 - 0.2. Per token with A = 2 or -1:
    r = 1.25 is inside [0.8, 1.28] (symmetric 0.2 would clip it to 1.2), r = 1.5 clips
    to 1.28, r = 0.7 with A < 0 clips to 0.8."""
    ratio = torch.tensor([1.25, 1.5, 0.7, 1.25], dtype=torch.float64)
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0], dtype=torch.float64)
    old = torch.full((4,), -3.0, dtype=torch.float64)
    fields = {"advantages": adv, "old_logprobs": old}
    logp = old + torch.log(ratio)
    want = [-2.5, -2.56, 0.8, 1.25]  # -min(r A, clip(r) A)
    for loss in (ppo_clip(0.2, clip_eps_high=0.28), ppo_clip(0.2, epsilon_high=0.28)):
        assert loss.per_token(logp, fields).tolist() == pytest.approx(want, rel=1e-12)
    assert ppo_clip(0.2).per_token(logp, fields).tolist() == pytest.approx([-2.4, -2.4, 0.8, 1.25], rel=1e-12)
    metrics = ppo_clip(0.2, clip_eps_high=0.28).metrics(logp, fields)
    assert metrics["clip_ratio/high_mean"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert metrics["clip_ratio/low_mean"].tolist() == [0.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="not both"):
        ppo_clip(0.2, clip_eps_high=0.28, epsilon_high=0.28)


def test_custom_loss_validation():
    with pytest.raises(ValueError, match="reduction"):
        TokenLoss(lambda lp, f: -lp, reduction="avg")
    with pytest.raises(ValueError, match="kl_estimator"):
        ppo_clip(kl_estimator="k9")
