"""Python's automatic garbage collection is paused while a training step walks (every method:
the baselines share dtree's TokenStep) and on again when the step returns, also when it
fails; ``pause_gc=False`` and a collector the user switched off are left alone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hf_models import make_model

import dtree
from dtree.baselines import METHODS, make_method
from dtree.engine.collector import CollectorPause
from dtree.losses import TokenLoss

SEQS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11]]


def recording_nll(seen: list, fail: bool = False) -> TokenLoss:
    """Token-mean NLL that records whether the collector ran automatically at each call."""

    def per_token(logp, fields):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("injected")
        return -logp

    return TokenLoss(per_token, reduction="token_mean", name="nll_recording")


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


@pytest.mark.parametrize("name", list(METHODS))
def test_paused_during_the_step_and_back_after(name):
    model = make_model("llama")
    runner = make_method(name, model)
    seen: list = []
    runner.forward_backward(dtree.Forest.from_sequences(SEQS), recording_nll(seen))
    assert seen and not any(seen)
    assert gc.isenabled()


def test_back_on_after_a_failed_step_and_grads_kept():
    model = make_model("llama")
    rt = dtree.TreeRuntime(model)
    seen: list = []
    with pytest.raises(RuntimeError, match="injected"):
        rt.forward_backward(dtree.Forest.from_sequences(SEQS), recording_nll(seen, fail=True))
    assert seen == [False] and gc.isenabled()
    assert all(p.grad is None for p in model.parameters())


def test_left_alone_when_asked_or_already_off():
    model = make_model("llama")
    seen: list = []
    dtree.TreeRuntime(model, pause_gc=False).forward_backward(dtree.Forest.from_sequences(SEQS), recording_nll(seen))
    assert all(seen) and gc.isenabled()
    gc.disable()
    seen.clear()
    dtree.TreeRuntime(model).forward_backward(dtree.Forest.from_sequences(SEQS), recording_nll(seen))
    assert not any(seen) and not gc.isenabled()  # the user's choice stands


def test_explicit_collections_still_run_while_paused():
    class Cycle:
        pass

    with CollectorPause():
        a = Cycle()
        a.self = a
        ref = weakref.ref(a)
        del a
        assert ref() is not None
        gc.collect()
        assert ref() is None
    assert gc.isenabled()


def test_gradients_are_those_of_a_step_with_the_collector_running():
    torch.manual_seed(0)
    model = make_model("llama")
    forest = dtree.Forest.from_sequences(SEQS)
    grads = []
    for pause in (True, False):
        model.zero_grad(set_to_none=True)
        dtree.TreeRuntime(model, pause_gc=pause).forward_backward(forest, dtree.losses.nll())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
