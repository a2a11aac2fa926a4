"""The step contract every method in ``dtree.bench`` keeps (dtree.engine.step): bad input gets a
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


# A user's first mistakes with forward_backward, refused by every method with the same
# error, naming the fix, and param.grad exactly as before. (What each returns is a
# ValueError or TypeError; the loss functions' own mistakes surface during the step.)
def _numpy_terms(logp, f):
    return (-logp).detach().numpy()


MISUSES = {
    "a list as forest": (lambda F: ([[1, 2, 3]], dtree.losses.nll()), TypeError,
                         r"forest must be a dtree.Forest, got list: build one with dtree.Forest.from_sequences"),
    "None as forest": (lambda F: (None, dtree.losses.nll()), TypeError, r"forest must be a dtree.Forest, got NoneType"),
    "a padded tensor as forest": (lambda F: (torch.ones(2, 3, dtype=torch.long), dtree.losses.nll()), TypeError,
                                  r"Forest.from_padded\(input_ids, attention_mask"),
    "uncalled ppo_clip": (lambda F: (F, dtree.losses.ppo_clip), TypeError,
                          r"loss factory dtree.losses.ppo_clip, not called: call it .*ppo_clip\(\.\.\.\)"),
    "uncalled nll": (lambda F: (F, dtree.losses.nll), TypeError, r"loss factory dtree.losses.nll, not called"),
    "the TokenLoss class": (lambda F: (F, TokenLoss), TypeError, r"loss is the class TokenLoss"),
    "aggregation's dict": (lambda F: (F, dtree.losses.aggregation("grpo")), TypeError, r"pass them to a loss"),
    "a field the loss does not declare": (
        lambda F: (F, TokenLoss(lambda lp, f: -lp * f["advantages"], name="adv")), ValueError,
        r"loss 'adv' read fields\['advantages'\], which is not in its required_fields \(\): list it"),
    "a field the forest lacks": (
        lambda F: (F, TokenLoss(lambda lp, f: -lp * f["nope"])), ValueError,
        r"read fields\['nope'\], which the forest does not have \(its fields: \['advantages'\]\)"),
    "entropy without needs_entropy": (
        lambda F: (F, TokenLoss(lambda lp, f: -lp - f["entropy"])), ValueError, r"needs_entropy=True"),
    "per_token returns numpy": (lambda F: (F, TokenLoss(_numpy_terms)), TypeError,
                                r"returned ndarray; it must return a torch tensor"),
    "per_token returns a float": (lambda F: (F, TokenLoss(lambda lp, f: 1.0)), TypeError, r"returned float"),
    "per_token detached": (lambda F: (F, TokenLoss(lambda lp, f: (-lp).detach())), ValueError,
                           r"does not depend on logp .*no gradient would reach the model"),
}


@pytest.mark.parametrize("misuse", MISUSES)
@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_first_mistakes(name, kw, misuse, model):
    make_args, error, match = MISUSES[misuse]
    runner, before = with_existing_grads(name, kw, model)
    forest = dtree.Forest.from_sequences(SEQS, advantages=[1.0, -1.0, 0.5])
    with pytest.raises(error, match=match):
        runner.forward_backward(*make_args(forest))
    assert_grads_equal(model, before)
    runner.forward_backward(forest, dtree.losses.nll())  # and the next step runs


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_grad_mode_off_is_refused(name, kw, model):
    """Under torch.no_grad() (or set_grad_enabled(False)) the user asked for no
    gradients: a step that filled param.grad anyway would surprise, so it is refused."""
    runner, before = with_existing_grads(name, kw, model)
    forest = dtree.Forest.from_sequences(SEQS)
    for off in (torch.no_grad, lambda: torch.set_grad_enabled(False)):
        with off(), pytest.raises(ValueError, match=r"gradient mode is off \(torch.no_grad\(\).*call it outside"):
            runner.forward_backward(forest, dtree.losses.nll())
    assert_grads_equal(model, before)


NORMALIZATIONS = {
    "nan": (lambda: dtree.Normalization(float("nan"), 1, 1), ValueError, r"loss_tokens must be a finite count >= 0"),
    "negative": (lambda: dtree.Normalization(-5, 1, 1), ValueError, r"loss_tokens must be a finite count >= 0, got -5"),
    "nan sequences": (lambda: dtree.Normalization(4, float("nan"), 2), ValueError, r"loss_sequences must be a finite"),
    "inf": (lambda: dtree.Normalization(float("inf"), 1, 1), ValueError, r"finite count"),
    "a string count": (lambda: dtree.Normalization("4", 1, 1), TypeError, r"loss_tokens must be a number, got str"),
}


@pytest.mark.parametrize("case", NORMALIZATIONS)
def test_invalid_normalization_values(case):
    build, error, match = NORMALIZATIONS[case]
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_bad_normalization_argument(name, kw, model):
    runner, before = with_existing_grads(name, kw, model)
    forest = dtree.Forest.from_sequences(SEQS)
    with pytest.raises(TypeError, match=r"normalization must be a dtree.Normalization or None, got dict"):
        runner.forward_backward(forest, dtree.losses.nll(), normalization={"loss_tokens": 4})
    with pytest.raises(TypeError, match=r"got str: dtree.Normalization.from_forests"):
        runner.forward_backward(forest, dtree.losses.nll(), normalization="global")
    # a count of 0 would silently give loss 0 and no gradient
    with pytest.raises(ValueError, match=r"loss_tokens is 0 but this forest has 8 loss terms"):
        runner.forward_backward(forest, dtree.losses.nll(), normalization=dtree.Normalization(0, 3, 3))
    with pytest.raises(ValueError, match=r"loss_sequences is 0 but"):
        runner.forward_backward(forest, dtree.losses.nll("sequence_mean"), normalization=dtree.Normalization(8, 0, 3))
    assert_grads_equal(model, before)
