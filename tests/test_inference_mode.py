"""torch.inference_mode(): forward_backward refuses it before allocating anything,
logprobs works inside it, and neither leaves state that breaks the next training step
(exact against HF per path, all modes and group budgets)."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_models import make_model
from setups import GROUP_TOKENS, MODES, SEQS, assert_exact, assert_logprobs_exact, reference

import dtree


def forest():
    return dtree.Forest.from_sequences(SEQS)


@functools.cache
def llama_reference():
    return reference(make_model("llama", seed=2))


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
def test_refused_under_inference_mode_then_exact(mode, group_tokens):
    model = make_model("llama", seed=2)
    ref_model, ref_loss = llama_reference()
    rt = dtree.TreeRuntime(model, mode=mode, group_tokens=group_tokens, chunk_size=3)
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"cannot run under torch.inference_mode\(\).*outside"):
            rt.forward_backward(forest(), dtree.losses.nll())
        with pytest.raises(ValueError, match=r"inference_mode"):
            rt.backward_from_logprob_grads(forest(), [None] * len(SEQS))
        assert rt.stack is None  # nothing allocated
        lps = rt.logprobs(forest())  # allowed: allocates a stack, which must not poison training
    assert rt.stack is not None and not any(t.is_inference() for t in rt.stack.tensors())
    assert all(p.grad is None for p in model.parameters())
    out = rt.forward_backward(forest(), dtree.losses.nll())
    assert_exact(model, ref_model, out, ref_loss)
    with torch.inference_mode():  # and back: the training stack serves inference too
        again = rt.logprobs(forest())
    for a, b in zip(lps, again):
        torch.testing.assert_close(a, b)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    rt.forward_backward(forest(), dtree.losses.nll())  # the stack inference wrote into still trains
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n])


def test_logprobs_under_inference_mode_are_exact():
    model = make_model("qwen3", tied=True)
    with torch.inference_mode():
        assert_logprobs_exact(model, dict(group_tokens=8))
