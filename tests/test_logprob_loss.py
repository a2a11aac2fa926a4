"""dtree.LogprobLoss: any function of the per-sequence log-probs and entropies, trained
on the two-pass path (log-probs and entropies, then one DFS backward seeded with both
gradients), against HF run per path: every parameter's gradient, CPU, float32."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from reference import grad_errors
from rl_reference import path_logprobs_entropy
from test_losses_rl import SEQS
from test_runtime_exact import assert_exact

import dtree

WEIGHTS = [torch.linspace(-1.0, 1.5, len(s) - 1) for s in SEQS]


def coupled(logprobs, forest, entropy=None):
    """Not a sum of per-token terms: each sequence's squared weighted log-prob sum, plus a
    per-sequence mean entropy bonus (when the entropies are given)."""
    loss = sum((lp * w).sum().square() for lp, w in zip(logprobs, WEIGHTS)) / len(logprobs)
    if entropy is not None:
        loss = loss - 0.1 * sum(h.mean() for h in entropy if h.numel())
    return loss


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2", tied=False)


@pytest.mark.parametrize("mode,group_tokens", [("retain", 0), ("recompute", 5), ("auto", None)])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprob_loss_matches_hf_per_path(model, mode, group_tokens, with_entropy):
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    forest = dtree.Forest.from_sequences(SEQS)
    loss = dtree.LogprobLoss(coupled, temperature=0.7, needs_entropy=with_entropy)
    out = dtree.TreeRuntime(tree_model, mode=mode, group_tokens=group_tokens).forward_backward(
        forest, loss, return_logprobs=True)
    lps, ents = zip(*(path_logprobs_entropy(ref_model, s, 0.7) for s in SEQS))
    ref = coupled(list(lps), forest, list(ents) if with_entropy else None)
    ref.backward()
    assert_exact(out, float(ref.detach()), grad_errors(tree_model, ref_model))
    assert (out.entropy is not None) == with_entropy


def test_backward_from_entropy_grads_alone(model):
    """The second pass seeded by entropy gradients only."""
    g = torch.Generator().manual_seed(3)
    seeds = [torch.randn(len(s) - 1, generator=g) for s in SEQS]
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    forest = dtree.Forest.from_sequences(SEQS)
    zeros = [torch.zeros(len(s) - 1) for s in SEQS]
    dtree.TreeRuntime(tree_model, group_tokens=5).backward_from_logprob_grads(
        forest, zeros, entropy_grads=seeds, temperature=0.9)
    sum((path_logprobs_entropy(ref_model, s, 0.9)[1] * w).sum() for s, w in zip(SEQS, seeds)).backward()
    assert max(grad_errors(tree_model, ref_model).values()) < 1e-5


def test_logprob_loss_errors(model):
    forest = dtree.Forest.from_sequences(SEQS)
    with pytest.raises(TypeError, match="callable"):
        dtree.LogprobLoss("not a function")
    with pytest.raises(ValueError, match="temperature"):
        dtree.LogprobLoss(coupled, temperature=0.0)
    m = copy.deepcopy(model)
    rt = dtree.TreeRuntime(m)
    with pytest.raises(ValueError, match="normalization"):
        rt.forward_backward(forest, dtree.LogprobLoss(coupled), normalization=dtree.Normalization(1.0, 1.0, 1.0))
    with pytest.raises(TypeError, match="one-element"):
        rt.forward_backward(forest, dtree.LogprobLoss(lambda lps, f: torch.stack([lp.sum() for lp in lps])))
    assert all(p.grad is None for p in m.parameters())
