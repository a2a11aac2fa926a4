"""``TreeRuntime.forward_backward_micro_batches``: the micro-batches of one optimizer step, each
prepared while the one before runs (``dtree.engine.micro_batches``).

It must give what one ``forward_backward`` per forest gives (bit for bit, with the batch-wide
normalization), which is what one step over all the sequences gives (up to rounding); prepare
micro-batch k + 1 before micro-batch k's sync; tell the next plan what the running step frees;
and on a failure leave exactly the micro-batches before it in ``param.grad``, naming the one
that failed."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_models import make_model
from setups import SEQS, assert_exact, assert_grads_equal, grads_of, reference

import dtree
from dtree.engine import micro_batches
from dtree.engine.step import TokenStep
from dtree.losses import Normalization, TokenLoss
from dtree.plan.step_plan import StepPlanner

BATCHES = [
    [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9], [1, 2, 10]],
    [[11, 12, 13, 14], [11, 12, 15], [16, 17]],
    [[20, 21, 22, 23, 24], [20, 21, 22, 25, 26, 27], [20, 28], [29, 30, 31]],
]


def rl_forest(seqs, seed: int) -> dtree.Forest:
    rng = np.random.default_rng(seed)
    return dtree.Forest.from_sequences(
        seqs,
        loss_mask=[[0.0] + list(rng.choice([0.0, 1.0, 1.0], size=len(s) - 1)) for s in seqs],
        advantages=[list(rng.uniform(-2, 2, size=len(s))) for s in seqs],
        old_logprobs=[list(rng.uniform(-5, -4, size=len(s))) for s in seqs],
    )


@pytest.fixture
def forests():
    return [rl_forest(s, i) for i, s in enumerate(BATCHES)]


@pytest.fixture
def model():
    return make_model("qwen2", max_positions=64)


def runtime(model, **kw):
    return dtree.TreeRuntime(model, chunk_size=3, group_tokens=8, **kw)


@pytest.mark.parametrize("kw", [{}, {"grad_guard": False}, {"grad_guard": "host"}, {"mode": "recompute"}])
@pytest.mark.parametrize("loss_name", ["nll", "ppo_clip"])
def test_equals_one_forward_backward_per_forest(model, forests, loss_name, kw):
    loss = dtree.losses.nll() if loss_name == "nll" else dtree.losses.ppo_clip(0.2)
    twin = copy.deepcopy(model)
    outs = runtime(model, **kw).forward_backward_micro_batches(forests, loss, return_logprobs=True)
    norm = Normalization.from_forests(forests, loss)
    ref = [runtime(twin, **kw).forward_backward(f, loss, normalization=norm, return_logprobs=True) for f in forests]
    assert [o.loss for o in outs] == [r.loss for r in ref]
    assert [o.num_model_calls for o in outs] == [r.num_model_calls for r in ref]
    for o, r in zip(outs, ref):
        assert all(torch.equal(a, b) for a, b in zip(o.logprobs, r.logprobs))
    assert_grads_equal(model, grads_of(twin))


def test_equals_one_step_over_all_sequences(model, forests):
    """The batch-wide default normalization: the micro-batches sum to one step over every
    sequence (the reference whose exactness against HF per path the other tests hold)."""
    twin = copy.deepcopy(model)
    outs = runtime(model).forward_backward_micro_batches(forests, dtree.losses.nll())
    seqs = [s for b in BATCHES for s in b]
    fields = {n: [f.field(n, s) for f in forests for s in range(f.num_sequences)] for n in ("loss_mask",)}
    whole = runtime(twin).forward_backward(dtree.Forest.from_sequences(seqs, **fields), dtree.losses.nll())
    assert sum(o.loss for o in outs) == pytest.approx(whole.loss, rel=1e-5)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("kw", [{}, {"grad_guard": False}, {"grad_guard": "host"}, {"mode": "recompute", "group_tokens": 0}])
def test_every_gradient_equals_hf_per_path(model, kw):
    """Against the reference nobody here wrote: HF run on each sequence of the three
    micro-batches (token-mean NLL over all of them), every parameter's gradient."""
    ref_model, ref_loss = reference(model, SEQS)
    batches = [dtree.Forest.from_sequences(SEQS[a:b]) for a, b in ((0, 6), (6, 8), (8, 9))]
    outs = dtree.TreeRuntime(model, **{"chunk_size": 3, **kw}).forward_backward_micro_batches(batches, dtree.losses.nll())
    assert_exact(model, ref_model)
    assert sum(o.loss for o in outs) == pytest.approx(ref_loss, rel=1e-5)


def test_other_losses_run_one_step_each(model, forests):
    twin = copy.deepcopy(model)
    loss = dtree.losses.gspo(0.2)
    outs = runtime(model).forward_backward_micro_batches(forests, loss)
    norm = Normalization.from_forests(forests, loss)
    ref = [runtime(twin).forward_backward(f, loss, normalization=norm) for f in forests]
    assert [o.loss for o in outs] == [r.loss for r in ref]
    assert_grads_equal(model, grads_of(twin))


def test_the_next_micro_batch_is_planned_before_the_sync(model, forests, monkeypatch):
    events, releasing = [], []
    make_plan, finish = StepPlanner.make_plan, TokenStep.finish

    def planned(self, *a, **k):
        events.append("plan")
        releasing.append(k.get("releasing", 0.0))
        return make_plan(self, *a, **k)

    def finished(self, walked):
        events.append("sync")
        return finish(self, walked)

    monkeypatch.setattr(StepPlanner, "make_plan", planned)
    monkeypatch.setattr(TokenStep, "finish", finished)
    rt = runtime(model)
    rt.forward_backward_micro_batches(forests, dtree.losses.nll())
    assert events == ["plan", "plan", "sync", "plan", "sync", "sync"]
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    # micro-batch 0 started without gradients (nothing to add into); micro-batch 1 frees its own
    # when it adds them into micro-batch 0's
    assert releasing == [0.0, 0.0, grads]
    events.clear()
    releasing.clear()
    runtime(model, grad_guard=False).forward_backward_micro_batches(forests, dtree.losses.nll())
    assert releasing == [0.0, 0.0, 0.0]  # in place: nothing is freed


def test_a_bad_forest_fails_after_the_micro_batches_before_it(model, forests):
    twin = copy.deepcopy(model)
    loss = dtree.losses.nll()
    norm = Normalization.from_forests(forests, loss)
    bad = dtree.Forest.from_sequences([[1, 2, 10_000]])  # outside the vocabulary
    with pytest.raises(ValueError, match="vocab") as info:
        runtime(model).forward_backward_micro_batches(forests[:2] + [bad], loss, normalization=norm)
    assert "in micro-batch 2 of 3 (counting from 0); the gradients of micro-batches 0..1" in str(info.value.__notes__)
    rt = runtime(twin)
    for f in forests[:2]:
        rt.forward_backward(f, loss, normalization=norm)
    assert_grads_equal(model, grads_of(twin))  # micro-batch 1 finished although 2's plan failed in its wait


def test_a_failing_step_keeps_the_micro_batches_before_it(model, forests):
    twin = copy.deepcopy(model)
    count = [0]

    def per_token(logp, fields):
        count[0] += 1
        if count[0] > 2:  # inside micro-batch 1 (micro-batch 0 makes two calls with terms here)
            raise RuntimeError("injected")
        return -logp

    loss = TokenLoss(per_token)
    calls = runtime(copy.deepcopy(model)).forward_backward(forests[0], dtree.losses.nll()).num_model_calls
    assert calls == 2
    norm = Normalization.from_forests(forests, loss)
    with pytest.raises(RuntimeError, match="injected") as info:
        runtime(model).forward_backward_micro_batches(forests, loss, normalization=norm)
    assert "in micro-batch 1 of 3" in str(info.value.__notes__)
    runtime(twin).forward_backward(forests[0], TokenLoss(lambda lp, f: -lp), normalization=norm)
    assert_grads_equal(model, grads_of(twin))


def test_bad_arguments(model, forests):
    rt = runtime(model)
    with pytest.raises(ValueError, match="forests is empty"):
        rt.forward_backward_micro_batches([], dtree.losses.nll())
    with pytest.raises(TypeError):
        rt.forward_backward_micro_batches([forests[0], [1, 2, 3]], dtree.losses.nll())
    assert all(p.grad is None for p in model.parameters())


def test_run_micro_batches_prepares_without_a_hook():
    """A run that never calls its hook still gets every micro-batch prepared, in order."""
    seen = []
    out = micro_batches.run_micro_batches(3, lambda k, r: k * 10, lambda k, p, ahead: seen.append((k, p)) or p)
    assert out == [0, 10, 20] and seen == [(0, 0), (1, 10), (2, 20)]

