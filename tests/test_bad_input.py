"""Bad input gets a clear ValueError naming the sequence and position, before any
kernel runs, and loses nothing: param.grad is exactly as before the call. What every
method shares (out-of-vocabulary tokens, missing loss fields, non-finite loss) is in
tests/test_step_contract.py; this file holds what is the runtime's own."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_model
from setups import assert_grads_equal, grads_of

import dtree


@pytest.fixture
def model():
    return make_model("llama", max_positions=64)


def test_path_longer_than_max_positions(model):
    forest = dtree.Forest.from_sequences([[1, 2], list(range(1, 66))])
    with pytest.raises(ValueError, match="sequence 1 has 65 tokens, longer than the model's 64 positions"):
        dtree.TreeRuntime(model).logprobs(forest)


def test_tree_larger_than_stack_capacity(model):
    forest = dtree.Forest.from_sequences([list(range(1, 40)), list(range(1, 30)) + [50]])
    with pytest.raises(ValueError, match=r"longest path \(sequence 0, 39 tokens\) alone exceeds it"):
        dtree.TreeRuntime(model, stack_capacity=32).forward_backward(forest, dtree.losses.nll())
    # the path fits, but packing siblings into one call would not: say what to change
    forest = dtree.Forest.from_sequences([list(range(1, 20)) + [60 + i] * 10 for i in range(4)])
    with pytest.raises(ValueError, match="lower group_tokens or raise stack_capacity"):
        dtree.TreeRuntime(model, stack_capacity=32, group_tokens=64).forward_backward(forest, dtree.losses.nll())
    out = dtree.TreeRuntime(model, stack_capacity=32, group_tokens=0).forward_backward(forest, dtree.losses.nll())
    assert out.stack_tokens <= 32


def test_non_finite_two_pass_loss(model):
    forest = dtree.Forest.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="the loss function returned -?inf"):
        dtree.TreeRuntime(model).forward_backward(forest, lambda lps, f: lps[0].sum() * float("inf"))
    assert all(p.grad is None for p in model.parameters())


def test_bad_two_pass_gradient_shape(model):
    forest = dtree.Forest.from_sequences([[1, 2, 3], [1, 4]])
    rt = dtree.TreeRuntime(model)
    with pytest.raises(ValueError, match=r"gradient for sequence 1 has 3 values, expected 1"):
        rt.backward_from_logprob_grads(forest, [torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match=r"loss gradient is nan at sequence 0, position 2"):
        rt.backward_from_logprob_grads(forest, [torch.tensor([1.0, float("nan")]), None])


def test_bad_options(model):
    with pytest.raises(ValueError, match="mode must be one of"):
        dtree.TreeRuntime(model, mode="fast")
    with pytest.raises(ValueError, match="attention must be 'auto' or one of"):
        dtree.TreeRuntime(model, attention="flash9")
    with pytest.raises(ValueError, match="reduction must be one of"):
        dtree.losses.nll(reduction="mean")
    with pytest.raises(TypeError, match="neither a transformers causal LM nor"):
        dtree.TreeRuntime(torch.nn.Linear(3, 3))


def test_sliding_window_rejected_only_where_it_is_not_implemented():
    """TreeRuntime implements sliding windows (tests/test_runtime_attention_options.py);
    the baselines refuse paths longer than the window, before touching param.grad."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from dtree.baselines import LinearizedTrainer

    cfg = MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = AutoModelForCausalLM.from_config(cfg)
    long = dtree.Forest.from_sequences([list(range(1, 10))])
    dtree.TreeRuntime(model).logprobs(long)
    LinearizedTrainer(model).forward_backward(dtree.Forest.from_sequences([list(range(1, 9))]), dtree.losses.nll())
    before = grads_of(model)
    with pytest.raises(ValueError, match="longer than the model's sliding window"):
        LinearizedTrainer(model).forward_backward(long, dtree.losses.nll())
    assert_grads_equal(model, before)


def test_two_pass_loss_mistakes(model):
    """A two-pass callable that returns numpy, or a value detached from the log-probs it
    got (no gradient would flow), is refused with param.grad untouched."""
    import numpy as np

    forest = dtree.Forest.from_sequences([[1, 2, 3], [1, 2, 4]])
    rt = dtree.TreeRuntime(model)
    rt.forward_backward(forest, dtree.losses.nll())
    before = grads_of(model)
    with pytest.raises(TypeError, match="must return a one-element tensor, got float64"):
        rt.forward_backward(forest, lambda lps, f: np.float64(1.0))
    with pytest.raises(ValueError, match="does not depend on the log-probs it was given"):
        rt.forward_backward(forest, lambda lps, f: sum(lp.sum() for lp in lps).detach())
    with pytest.raises(TypeError, match=r"does not take \(logprobs, forest\)"):
        rt.forward_backward(forest, lambda lps: lps[0].sum())
    with torch.no_grad(), pytest.raises(ValueError, match="backward_from_logprob_grads computes gradients|gradient mode is off"):
        rt.backward_from_logprob_grads(forest, [torch.ones(2), torch.ones(2)])
    assert_grads_equal(model, before)


def test_inference_calls_name_a_wrong_forest(model):
    rt = dtree.TreeRuntime(model)
    with pytest.raises(TypeError, match=r"forest must be a dtree.Forest, got list"):
        rt.logprobs([[1, 2, 3]])
    with pytest.raises(TypeError, match=r"forest must be a dtree.Forest, got str"):
        rt.entropy("1 2 3")
