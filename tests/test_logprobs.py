"""Chunked log-probs against full-logit log_softmax: values and all gradients."""

import pytest
import torch

from dtree.ops.logprobs import token_entropy, token_logprobs, token_logprobs_reference


@pytest.mark.parametrize("n, chunk", [(1, 4), (13, 4), (13, 13), (50, 7), (0, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_matches_full(n, chunk, bias):
    torch.manual_seed(n)
    h = torch.randn(n, 20, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, 20, dtype=torch.float64, requires_grad=True)
    b = torch.randn(37, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, 37, (n,))
    got = token_logprobs(h, w, y, b, chunk_size=chunk)
    want = token_logprobs_reference(h, w, y, b)
    torch.testing.assert_close(got, want)
    if n == 0:
        return
    g = torch.randn(n, dtype=torch.float64)
    inputs = [h, w] + ([b] if bias else [])
    for a, e in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, e)


def test_entropy():
    h, w = torch.randn(9, 8), torch.randn(11, 8)
    p = torch.log_softmax(h @ w.T, -1)
    torch.testing.assert_close(token_entropy(h, w, chunk_size=4), -(p.exp() * p).sum(-1))
