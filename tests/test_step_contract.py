"""The step contract every method in ``dtree.bench`` keeps (dtree.step): bad input gets a
ValueError before any model call and leaves ``param.grad`` exactly as it was; a
non-finite loss restores ``param.grad``; gradients accumulate into an existing
``param.grad``. Run over every method of :data:`dtree.baselines.METHODS` (dtree in
both modes that differ in how groups run)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import VOCAB, make_model
from setups import assert_grads_equal, grads_of

import dtree
from dtree.baselines import METHODS, make_method
from dtree.losses import TokenLoss

# every method, dtree once per mode whose walk differs (retain keeps graphs, recompute re-runs)
RUNNERS = [
    (name, kw) for name in METHODS
    for kw in ([{"mode": "retain"}, {"mode": "recompute", "group_tokens": 0}] if name == "dtree" else [{}])
]
IDS = [name + "".join(f"-{v}" for v in kw.values()) for name, kw in RUNNERS]
SEQS = [[1, 2, 3, 4], [1, 2, 5, 6, 7], [9, 8]]


@pytest.fixture
def model():
    return make_model("llama", max_positions=64)


def with_existing_grads(name, kw, model):
    """The method's runner, after one good step: gradients a failed step must keep."""
    runner = make_method(name, model, **kw)
    runner.forward_backward(dtree.Forest.from_sequences(SEQS[:1]), dtree.losses.nll())
    return runner, grads_of(model)


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_token_outside_vocabulary(name, kw, model):
    runner, before = with_existing_grads(name, kw, model)
    forest = dtree.Forest.from_sequences([[1, 2, 3], [1, 2, VOCAB + 5, 4]])
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 5} at sequence 1, position 2 is outside the vocabulary"):
        runner.forward_backward(forest, dtree.losses.nll())
    assert_grads_equal(model, before)


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_missing_loss_field(name, kw, model):
    runner, before = with_existing_grads(name, kw, model)
    forest = dtree.Forest.from_sequences([[1, 2, 3]], advantages=[[0, 1, 1]])
    with pytest.raises(ValueError, match=r"needs per-token fields \['old_logprobs'\]"):
        runner.forward_backward(forest, dtree.losses.ppo_clip())
    assert_grads_equal(model, before)


def test_mismatched_field_lengths_are_refused_by_the_forest():
    """Field lengths are checked where the forest is built, so no method sees them."""
    with pytest.raises(ValueError, match="field 'advantages' of sequence 1 has 2 values but the sequence has 3 tokens"):
        dtree.Forest.from_sequences([[1, 2], [1, 3, 4]], advantages=[[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="field 'advantages' has 1 entries but there are 2 sequences"):
        dtree.Forest.from_sequences([[1, 2], [1, 3, 4]], advantages=[[0, 1]])


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_non_finite_loss_restores_grads(name, kw, model):
    flag = [[0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0]]  # sequence 1, position 3 goes bad

    def per_token(logp, f):
        return torch.where(f["flag"] > 0, torch.log(-logp.abs() - 1), -logp)

    loss = TokenLoss(per_token, reduction="sum", required_fields=("flag",), name="explodes")
    runner, before = with_existing_grads(name, kw, model)
    with pytest.raises(ValueError, match=r"loss is not finite \(nan\) at sequence 1, position 3"):
        runner.forward_backward(dtree.Forest.from_sequences(SEQS, flag=flag), loss)
    assert_grads_equal(model, before)


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_gradients_accumulate_into_existing_grad(name, kw, model):
    """Step A then step B leaves grad(A) + grad(B), each taken alone on a fresh copy."""
    first = dtree.Forest.from_sequences([[5, 6, 7], [5, 6, 7, 8, 9, 10], [5, 6]])
    second = dtree.Forest.from_sequences(SEQS)
    alone = []
    for forest in (first, second):
        fresh = copy.deepcopy(model)
        make_method(name, fresh, **kw).forward_backward(forest, dtree.losses.nll())
        alone.append(dict(fresh.named_parameters()))
    runner = make_method(name, model, **kw)
    runner.forward_backward(first, dtree.losses.nll())
    runner.forward_backward(second, dtree.losses.nll())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, alone[0][n].grad + alone[1][n].grad, rtol=1e-6, atol=1e-7)
