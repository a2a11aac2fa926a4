"""Nothing is lost when a step fails halfway: a loss that raises on its 1st, 2nd or 3rd
call, a KeyboardInterrupt, a decoder layer's forward or backward hook that raises. Every
method leaves ``param.grad`` bit for bit as it was before the call, and the next step
on the same runner gives bit for bit the gradient of a runner that never failed."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from setups import assert_grads_equal, grads_of, grads_when_first_reached

import dtree
from dtree.baselines import METHODS, make_method
from dtree.losses import TokenLoss

RUNNERS = [
    (name, kw) for name in METHODS
    for kw in ([{"mode": "retain", "chunk_size": 3, "group_tokens": 0},
                {"mode": "recompute", "chunk_size": 3, "group_tokens": 0}, {}, {"grad_guard": "host"}]
               if name == "dtree" else [{}, {"grad_guard": "host"}])
]
IDS = [name + "".join(f"-{k}={v}" for k, v in kw.items()) for name, kw in RUNNERS]
SEQS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9], [1, 2, 10], [11, 12, 13, 14]]
FIRST = [[20, 21, 22, 23], [20, 21, 24]]


class Injected(Exception):
    pass


def nll_raising_on(call: int, error: type[BaseException] = Injected) -> TokenLoss:
    """Token-mean NLL whose per-token function raises ``error`` on its ``call``-th call."""
    count = [0]

    def per_token(logp, fields):
        count[0] += 1
        if count[0] == call:
            raise error(f"injected on call {call}")
        return -logp

    return TokenLoss(per_token, name="raising")


def calls_of(name, kw, model) -> int:
    """How many per-token calls (model calls with loss terms) one step makes."""
    count = [0]

    def per_token(logp, fields):
        count[0] += 1
        return -logp

    runner = make_method(name, copy.deepcopy(model), **kw)
    runner.forward_backward(dtree.Forest.from_sequences(SEQS), TokenLoss(per_token))
    return count[0]


def check_nothing_lost(name, kw, model, fail, error) -> None:
    """One good step, then ``fail(runner, forest)`` must raise ``error`` and leave
    param.grad as it was; then the next step equals a never-failed runner's, bit for bit."""
    twin = copy.deepcopy(model)  # (a Parameter's deepcopy drops .grad: copy it too)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    runner, clean = make_method(name, model, **kw), make_method(name, twin, **kw)
    for r in (runner, clean):
        r.forward_backward(dtree.Forest.from_sequences(FIRST), dtree.losses.nll())
    before = grads_of(model)
    forest = dtree.Forest.from_sequences(SEQS)
    with pytest.raises(error):
        fail(runner, forest)
    assert_grads_equal(model, before)
    out = runner.forward_backward(forest, dtree.losses.nll())
    ref = clean.forward_backward(forest, dtree.losses.nll())
    assert out.loss == ref.loss
    assert_grads_equal(model, grads_of(twin))


@pytest.fixture
def model():
    return make_model("llama", max_positions=64)


@pytest.mark.parametrize("call", [1, 2, 3])
@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_loss_raising_mid_step(name, kw, call, model):
    if call > calls_of(name, kw, model):
        pytest.skip(f"{name} {kw} makes fewer than {call} calls with loss terms")
    check_nothing_lost(name, kw, model, lambda r, f: r.forward_backward(f, nll_raising_on(call)), Injected)


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_keyboard_interrupt_mid_step(name, kw, model):
    call = min(2, calls_of(name, kw, model))
    loss = nll_raising_on(call, KeyboardInterrupt)
    check_nothing_lost(name, kw, model, lambda r, f: r.forward_backward(f, loss), KeyboardInterrupt)


def _raising_hook(after: int, error: type[BaseException] = Injected):
    count = [0]

    def hook(*args):
        count[0] += 1
        if count[0] > after:
            raise error("injected in a decoder layer")

    return hook


@pytest.mark.parametrize("after", [0, 1])
@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_decoder_layer_forward_hook_raising(name, kw, after, model):
    """The last decoder layer's forward raises on its first call, or on a later one
    (mid-walk, after some groups ran their backward)."""
    if after >= calls_of(name, kw, model):
        pytest.skip(f"{name} {kw} runs the forest in one model call")

    def fail(runner, forest):
        handle = model.model.layers[-1].register_forward_hook(_raising_hook(after))
        try:
            runner.forward_backward(forest, dtree.losses.nll())
        finally:
            handle.remove()

    check_nothing_lost(name, kw, model, fail, Injected)


@pytest.mark.parametrize("name,kw", RUNNERS, ids=IDS)
def test_decoder_layer_backward_hook_raising(name, kw, model):
    """A decoder layer's backward raises (the step's first backward)."""

    def fail(runner, forest):
        handle = model.model.layers[0].register_full_backward_hook(_raising_hook(0))
        try:
            runner.forward_backward(forest, dtree.losses.nll())
        finally:
            handle.remove()

    check_nothing_lost(name, kw, model, fail, Injected)


@pytest.mark.parametrize("name", METHODS)
def test_unguarded_steps_accumulate_in_place(name, model):
    """``grad_guard=False``: a step adds into the ``param.grad`` tensors already there (no
    second copy of the gradients while accumulating), with the gradients of the guarded form;
    a failed step says that ``param.grad`` may hold part of it."""
    twin = copy.deepcopy(model)
    guarded, plain = make_method(name, twin), make_method(name, model, grad_guard=False)
    first, forest = dtree.Forest.from_sequences(FIRST), dtree.Forest.from_sequences(SEQS)
    for r in (guarded, plain):
        r.forward_backward(first, dtree.losses.nll())
    old = {n: p.grad for n, p in model.named_parameters()}
    with grads_when_first_reached(model) as seen:
        out = plain.forward_backward(forest, dtree.losses.nll())
    ref = guarded.forward_backward(forest, dtree.losses.nll())
    assert len(seen) == len(old) and all(seen[n] is old[n] for n in old)  # in place: the old tensors
    assert all(p.grad is old[n] for n, p in model.named_parameters())
    assert out.loss == pytest.approx(ref.loss, rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    with pytest.raises(Injected, match="injected"):
        plain.forward_backward(forest, nll_raising_on(1))
    with pytest.raises(ValueError, match=r"may hold part of this call's gradient \(grad_guard=False\)"):
        plain.forward_backward(forest, TokenLoss(lambda logp, fields: logp * float("nan")))


@pytest.mark.parametrize("name", METHODS)
def test_host_guarded_steps_accumulate_in_place(name, model):
    """``grad_guard="host"``: the old gradients wait in host memory while the step adds into
    the ``param.grad`` tensors already there, bit for bit as unguarded; a failed step puts the
    old values back into those same tensors."""
    twin = copy.deepcopy(model)
    calls = {"chunk_size": 3, "group_tokens": 0} if name == "dtree" else {}  # several backwards before the failure
    plain = make_method(name, twin, grad_guard=False, **calls)
    hosted = make_method(name, model, grad_guard="host", **calls)
    first, forest = dtree.Forest.from_sequences(FIRST), dtree.Forest.from_sequences(SEQS)
    for r in (plain, hosted):
        r.forward_backward(first, dtree.losses.nll())
    old = {n: p.grad for n, p in model.named_parameters()}
    before = grads_of(model)
    with pytest.raises(Injected):
        hosted.forward_backward(forest, nll_raising_on(calls_of(name, calls, model)))
    assert all(p.grad is old[n] for n, p in model.named_parameters())
    assert_grads_equal(model, before)
    with grads_when_first_reached(model) as seen:
        out = hosted.forward_backward(forest, dtree.losses.nll())
    ref = plain.forward_backward(forest, dtree.losses.nll())
    assert len(seen) == len(old) and all(seen[n] is old[n] for n in old)
    assert all(p.grad is old[n] for n, p in model.named_parameters())
    assert out.loss == ref.loss
    assert_grads_equal(model, grads_of(twin))


def test_grad_guard_is_checked(model):
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match="grad_guard must be True, False, 'device' or 'host'"):
            dtree.RuntimeConfig(grad_guard=bad)
        with pytest.raises(ValueError, match="grad_guard must be True, False, 'device' or 'host'"):
            make_method("tree-mask", model, grad_guard=bad)


def test_the_host_buffer_is_kept_lent_once_and_released(monkeypatch):
    """The host guard's pinned buffer (pinning gigabytes outlasts a step's forward): kept between
    steps and grown when too small; a second guard alive at once gets its own; released on request.
    (CPU: ``pin_memory`` needs CUDA, so the allocation is plain here.)"""
    from dtree.engine import grad_guard as guards

    real_empty = torch.empty
    monkeypatch.setattr(guards.torch, "empty", lambda n, dtype, pin_memory: real_empty(n, dtype=dtype))
    pinned = guards._PinnedBuffer()
    first = pinned.take(100)
    other = pinned.take(50)  # lent: a buffer of its own
    assert other is not first and other.numel() == 50
    pinned.give_back(other)  # not the kept one: changes nothing
    assert pinned.lent
    pinned.give_back(first)
    assert pinned.take(80) is first  # kept and large enough
    pinned.give_back(first)
    grown = pinned.take(200)
    assert grown is not first and grown.numel() == 200
    pinned.give_back(grown)
    pinned.release()
    assert pinned.buffer is None and not pinned.lent
    guards.release_host_buffer()
    assert guards._PINNED.buffer is None
