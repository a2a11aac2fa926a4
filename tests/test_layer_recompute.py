"""dtree's activation checkpointing function (dtree/models/layer_recompute.py) on one
layer against the same layer run plainly: every gradient (inputs and parameters) in
float64, with keyword tensors, tuple outputs, dropout (the re-run replays the forward's
random draws), autocast, inputs that need no grad (the parameters still get theirs), and
a backward restricted to some inputs (nothing reaches ``param.grad``)."""

from __future__ import annotations

import pytest
import torch

from dtree.models.layer_recompute import recompute_in_backward


class Block(torch.nn.Module):
    """A small layer: two linears, a scaled residual, dropout, an extra tensor output."""

    def __init__(self, d: int = 8, p: float = 0.0):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, *, scale, flag=True, extra=None):
        h = self.drop(torch.nn.functional.gelu(self.a(x)))
        y = x + self.b(h) * scale
        if extra is not None:
            y = y + extra
        return (y, None, h.sum(-1)) if flag else y


def _run(layer, x, recompute: bool, **kwargs):
    if recompute:
        return recompute_in_backward(layer, x, **kwargs)
    return layer(x, **kwargs)


def _grads(layer, x, recompute, seed=0, **kwargs):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    out = _run(layer, x, recompute, **kwargs)
    y = out[0] if isinstance(out, tuple) else out
    loss = (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum()
    if isinstance(out, tuple):
        loss = loss + out[2].pow(2).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    if x.requires_grad:
        grads["x"] = x.grad.clone()
    return grads, out


@pytest.mark.parametrize("flag", [True, False], ids=["tuple output", "tensor output"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["input needs grad", "input needs none"])
def test_gradients_equal_the_plain_layer(flag, x_grad):
    torch.manual_seed(0)
    layer = Block().double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=x_grad)
    extra = torch.randn(5, 8, dtype=torch.float64)
    want, out_plain = _grads(layer, x, False, scale=0.5, flag=flag, extra=extra)
    got, out = _grads(layer, x, True, scale=0.5, flag=flag, extra=extra)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12, msg=name)
    if flag:
        assert out[1] is None and out[2].requires_grad


def test_dropout_draws_the_same_masks_in_the_rerun():
    torch.manual_seed(0)
    layer = Block(p=0.5).double().train()
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    want, _ = _grads(layer, x, False, seed=3, scale=1.0)
    got, _ = _grads(layer, x, True, seed=3, scale=1.0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12, msg=name)


def test_autocast_is_replayed():
    torch.manual_seed(0)
    layer = Block()
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for recompute, autocast in ((False, True), (True, True), (False, False)):
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = _run(layer, xx, recompute, scale=1.0, flag=False)
        y.float().sum().backward()
        results.append((xx.grad.clone(), layer.a.weight.grad.clone()))
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(results[0][1], results[2][1])  # autocast changes them: the re-run replayed it


@pytest.mark.parametrize("how", ["backward(inputs=...)", "autograd.grad"])
def test_a_restricted_backward_leaves_the_parameters_alone(how):
    """The memory probe backpropagates to one activation only: the re-run then computes
    the inputs' gradients and nothing lands in param.grad."""
    torch.manual_seed(0)
    layer = Block().double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    want, _ = _grads(layer, x, False, scale=0.5, flag=False)
    layer.zero_grad(set_to_none=True)
    y = recompute_in_backward(layer, x, scale=0.5, flag=False)
    loss = (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum()
    if how == "autograd.grad":
        (gx,) = torch.autograd.grad(loss, [x])
    else:
        loss.backward(inputs=[x])
        gx = x.grad
    torch.testing.assert_close(gx, want["x"], rtol=0, atol=1e-12)
    assert all(p.grad is None for p in layer.parameters())


def test_the_forward_keeps_only_the_inputs():
    """Between forward and backward autograd holds the input, not the layer's
    activations (saved-tensor hooks see what is kept)."""
    layer = Block(d=16)
    x = torch.randn(32, 16, requires_grad=True)
    kept = []

    def pack(t):
        kept.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = recompute_in_backward(layer, x, scale=1.0, flag=False)
    assert kept == [x.shape]
    y.sum().backward()
    assert layer.a.weight.grad is not None
