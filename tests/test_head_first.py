"""A call's backward with the LM head's part first (dtree.engine.head_first): the same
gradients as one backward, and with tied embeddings the head's weight gradient is in
``.grad`` before any decoder layer's backward runs (it no longer waits, alive, for the
embedding's)."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_model
from setups import SEQS

import dtree
from dtree.baselines import LinearizedTrainer, TreeMaskTrainer
from dtree.engine.head_first import HeadSplit


class _AddSeed(torch.autograd.Function):
    """Identity whose backward adds a fixed gradient: a stand-in for the KV stack's seeds,
    which reach a group's graph even where its loss reads nothing."""

    @staticmethod
    def forward(ctx, x, seed):
        ctx.seed = seed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad + ctx.seed, None


def _graph(seed: torch.Tensor):
    torch.manual_seed(0)
    w_in = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, dtype=torch.float64)
    hidden = _AddSeed.apply(torch.tanh(x @ w_in), seed)  # [3, 4]
    return w_in, w_out, hidden


ROWS = torch.tensor([2, 0, 2])  # rows may repeat: their gradients add in the decoder's backward


@pytest.mark.parametrize("reads", ["all", "none", "nothing"])
def test_same_gradients_as_one_backward(reads):
    """``reads``: the loss reads every row of the head input, a zero-row slice of it, or
    only the head weight (its gradient then never reaches the head input, and the
    hidden states' graph still runs, with its seeds: what one backward of the loss and
    the hidden states with a zero gradient computes)."""
    seed = torch.full((3, 4), 0.25, dtype=torch.float64)

    def loss_of(h, w_out):
        if reads == "all":
            return torch.log_softmax(h @ w_out.T, -1)[:, 2].sum()
        if reads == "none":
            return (h[:0] @ w_out.T).sum() + w_out.square().sum()
        return w_out.square().sum()

    w_in, w_out, hidden = _graph(seed)
    torch.autograd.backward([loss_of(hidden[ROWS], w_out), hidden], [None, torch.zeros_like(hidden)])
    want = w_in.grad.clone(), w_out.grad.clone()

    w_in, w_out, hidden = _graph(seed)
    split = HeadSplit(hidden, ROWS)
    assert split.head_in.is_leaf and split.head_in.requires_grad and split.head_in.shape == (3, 4)
    split.backward(loss_of(split.head_in, w_out))
    torch.testing.assert_close(w_in.grad, want[0], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(w_out.grad, want[1], rtol=1e-14, atol=1e-14)
    assert split.head_in is None  # let go: neither graph is held after the backward


def test_hidden_without_grad_reads_its_rows():
    hidden = torch.randn(3, 4)
    split = HeadSplit(hidden, ROWS)
    assert not split.head_in.requires_grad
    torch.testing.assert_close(split.head_in, hidden[ROWS])
    w = torch.randn(4, 2, requires_grad=True)
    split.backward((split.head_in @ w).sum())
    torch.testing.assert_close(w.grad, hidden[ROWS].sum(0)[:, None].expand(4, 2))


def test_neither_the_hidden_states_nor_the_rows_gradient_outlive_their_use():
    """The call's [T, H] final hidden states are freed after the gather (the split holds
    no reference to them), the rows once the head's backward has run (the caller still
    holds the loss, whose graph points to them), and the rows' gradient handed to the
    decoder's backward after its first node reads it."""
    import weakref

    seed = torch.zeros(3, 4, dtype=torch.float64)
    w_in, w_out, _ = _graph(seed)
    x = torch.randn(3, 5, dtype=torch.float64)
    inner = torch.tanh(x @ w_in)
    hidden = _AddSeed.apply(inner, seed)
    hidden_ref = weakref.ref(hidden)
    split = HeadSplit(hidden, ROWS)
    del hidden
    assert hidden_ref() is None
    handed: list = []
    split.head_in.register_post_accumulate_grad_hook(lambda t: handed.append(weakref.ref(t.grad)))
    alive_below: list[bool] = []
    inner.register_hook(lambda g: alive_below.append(handed[0]() is not None))
    rows = split.head_in
    split.backward(torch.log_softmax(rows @ w_out.T, -1)[:, 1].sum())
    assert alive_below == [False]
    assert rows.numel() == 0 and rows.grad is None  # the rows' [P, H] released after the head's backward
    assert w_in.grad is not None and w_out.grad is not None


def _head_grad_seen_by_decoder(model, run) -> list[bool]:
    """Whether the tied head weight held a gradient when the top decoder layer's backward
    began, call by call."""
    weight = model.get_output_embeddings().weight
    assert weight is model.get_input_embeddings().weight
    seen: list[bool] = []

    def on_output(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(lambda g: seen.append(weight.grad is not None))

    handle = model.model.layers[-1].register_forward_hook(on_output)
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("method", ["dtree", "tree-mask", "linearized"])
def test_tied_head_gradient_is_added_before_the_decoder_backward(method):
    model = make_model("qwen2", tied=True)
    forest = dtree.Forest.from_sequences(SEQS)
    loss = dtree.losses.nll()
    trainer = {
        "dtree": lambda: dtree.TreeRuntime(model),
        "tree-mask": lambda: TreeMaskTrainer(model),
        "linearized": lambda: LinearizedTrainer(model),
    }[method]()
    seen = _head_grad_seen_by_decoder(model, lambda: trainer.forward_backward(forest, loss))
    assert seen and all(seen), seen

