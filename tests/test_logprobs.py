"""The chunked LM-head op against its full-logits reference: log-probs, entropies and
every gradient (hidden, weight, bias, a head module's parameters), with temperature,
logit scale, final softcap, float32 and float64, and the module path's dropout replay."""

from __future__ import annotations

import pytest
import torch

from dtree.ops.logprobs import OutputHead, as_output_head, token_logprobs, token_logprobs_reference

V, H = 37, 20


class LowRankHead(torch.nn.Module):
    """A LoRA-style head: frozen base linear plus a trainable low-rank update, with
    optional dropout on the update's input (as PEFT's lora_dropout)."""

    def __init__(self, dtype, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.base = torch.nn.Linear(H, V, bias=bias, dtype=dtype)
        self.base.requires_grad_(False)
        self.a = torch.nn.Linear(H, 3, bias=False, dtype=dtype)
        self.b = torch.nn.Linear(3, V, bias=False, dtype=dtype)
        torch.nn.init.normal_(self.b.weight)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, h):
        return self.base(h) + 0.5 * self.b(self.a(self.drop(h)))


def _inputs(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, dtype=dtype, generator=g).requires_grad_(True)
    y = torch.randint(0, V, (n,), generator=g)
    return h, y


def _check(head, h, y, chunk, tol, **kw):
    """Values and gradients (w.r.t. hidden and every trainable tensor of the head) of
    the op against the reference, with random seeds on log-probs and entropies."""
    got = token_logprobs(h, head, y, chunk, **kw)
    kw.pop("keep_logits", None)
    want = token_logprobs_reference(h, head, y, chunk, **kw)
    with_entropy = kw.get("with_entropy", False)
    assert (got[1] is None) == (want[1] is None) == (not with_entropy)
    outs = [0, 1] if with_entropy else [0]
    for i in outs:
        torch.testing.assert_close(got[i], want[i], atol=tol, rtol=tol)
        assert got[i].dtype == (torch.float64 if h.dtype == torch.float64 else torch.float32)
    if h.shape[0] == 0:
        return
    leaves = [h] + [t for t in (head.weight, head.bias) if t is not None and t.requires_grad]
    if head.module is not None:
        leaves += [p for p in head.module.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    for used in ([0], [1], [0, 1]) if with_entropy else ([0],):
        seeds = [torch.randn(h.shape[0], dtype=got[0].dtype, generator=g) for _ in used]
        a = torch.autograd.grad([got[i] for i in used], leaves, seeds, retain_graph=True, allow_unused=True)
        e = torch.autograd.grad([want[i] for i in used], leaves, seeds, retain_graph=True, allow_unused=True)
        for x, r in zip(a, e):
            torch.testing.assert_close(x, r, atol=tol, rtol=tol)


TRANSFORMS = [
    dict(),
    dict(temperature=0.7),
    dict(logit_scale=0.3, final_softcap=2.0, temperature=1.3),
]


@pytest.mark.parametrize("n, chunk", [(1, 4), (13, 4), (13, 13), (50, 7), (0, 3)])
@pytest.mark.parametrize("transform", range(len(TRANSFORMS)))
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("keep_logits", [False, True])
def test_fused_matches_reference(n, chunk, transform, with_entropy, keep_logits):
    """(_check's later backward passes through the same graph recompute what the first one
    found kept and overwrote.)"""
    bias = transform != 1
    kw = dict(TRANSFORMS[transform])
    temperature = kw.pop("temperature", 1.0)
    h, y = _inputs(n, torch.float64, seed=n)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if bias else None
    head = OutputHead(weight=w, bias=b, **kw)
    _check(head, h, y, chunk, 1e-10, temperature=temperature, with_entropy=with_entropy, keep_logits=keep_logits)


@pytest.mark.parametrize("n, chunk", [(13, 13), (13, 4)])
def test_kept_logits_are_the_recomputed_ones(monkeypatch, n, chunk):
    """The torch op keeps a one-chunk forward's logits for its backward (no product there)
    and gives the recomputing backward's gradients bit for bit."""
    from dtree.ops.logprobs import interface

    h, y = _inputs(n, torch.float32, seed=3)
    w = torch.randn(V, H, requires_grad=True)
    head = OutputHead(weight=w, bias=torch.randn(V, requires_grad=True), final_softcap=3.0)
    products = []
    linear = interface.F.linear
    monkeypatch.setattr(interface.F, "linear", lambda *a: products.append(1) or linear(*a))
    grads = []
    for keep in (False, True):
        logp, ent = token_logprobs(h, head, y, chunk, with_entropy=True, keep_logits=keep)
        before = len(products)
        grads.append(torch.autograd.grad((logp * 0.3).sum() + ent.sum(), [h, w, head.bias]))
        backward_products = len(products) - before
        assert backward_products == (0 if keep and n <= chunk else -(-n // chunk))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("transform", range(len(TRANSFORMS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_module_matches_reference(transform, dtype):
    kw = dict(TRANSFORMS[transform])
    temperature = kw.pop("temperature", 1.0)
    torch.manual_seed(0)
    head = OutputHead(module=LowRankHead(dtype), **kw)
    h, y = _inputs(29, dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    _check(head, h, y, 8, tol, temperature=temperature, with_entropy=True)
    _check(head, h, y, 64, tol, temperature=temperature, with_entropy=False)


def test_module_path_equals_fused_path_for_the_same_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(H, V, dtype=torch.float64)
    h, y = _inputs(23, torch.float64)
    fused = token_logprobs(h, OutputHead(weight=lin.weight, bias=lin.bias), y, 5, with_entropy=True)
    module = token_logprobs(h, OutputHead(module=lin), y, 5, with_entropy=True)
    for a, b in zip(fused, module):
        torch.testing.assert_close(a, b)
    leaves = [h, lin.weight, lin.bias]
    ga = torch.autograd.grad(fused[0].sum() + fused[1].sum(), leaves)
    gb = torch.autograd.grad(module[0].sum() + module[1].sum(), leaves)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk", [7, 64])
def test_module_dropout_is_replayed_in_backward(chunk):
    """A head with dropout in train mode: the backward re-runs each chunk with the
    forward's random state, so value and gradients are those of one set of masks (the
    reference draws the same masks: same seed, chunk by chunk in the same order)."""
    head_mod = LowRankHead(torch.float64, dropout=0.5).train()
    head = OutputHead(module=head_mod)
    h, y = _inputs(29, torch.float64)
    leaves = [h] + [p for p in head_mod.parameters() if p.requires_grad]
    torch.manual_seed(123)
    got, _ = token_logprobs(h, head, y, chunk)
    torch.randn(1000)  # the backward must not depend on the global generator's state
    g_got = torch.autograd.grad(got.sum(), leaves)
    torch.manual_seed(123)
    want = torch.cat([token_logprobs_reference(h[a : a + chunk], head, y[a : a + chunk])[0] for a in range(0, 29, chunk)])
    g_want = torch.autograd.grad(want.sum(), leaves)
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    # the masks matter: in eval mode the values differ
    head_mod.eval()
    assert not torch.allclose(token_logprobs(h, head, y, chunk)[0], got)


def test_only_trainable_module_parameters_get_gradients():
    head_mod = LowRankHead(torch.float32)
    h, y = _inputs(9, torch.float32)
    lp, _ = token_logprobs(h.detach(), OutputHead(module=head_mod), y, 4)
    lp.sum().backward()
    assert head_mod.base.weight.grad is None
    assert head_mod.a.weight.grad is not None and head_mod.b.weight.grad.abs().sum() > 0


def test_frozen_weight_gets_no_gradient():
    w = torch.randn(V, H)
    h, y = _inputs(9, torch.float32)
    lp, _ = token_logprobs(h, (w, None), y, 4)
    (gh,) = torch.autograd.grad(lp.sum(), [h])
    (want,) = torch.autograd.grad(token_logprobs_reference(h, (w, None), y)[0].sum(), [h])
    torch.testing.assert_close(gh, want)


def test_output_head_validation():
    w = torch.randn(V, H)
    assert as_output_head((w, None)).fused
    with pytest.raises(ValueError, match="either weight"):
        OutputHead()
    with pytest.raises(ValueError, match="either weight"):
        OutputHead(weight=w, module=torch.nn.Linear(H, V))
    with pytest.raises(TypeError, match="must be an nn.Module"):
        OutputHead(module=lambda h: h @ w.T)
    with pytest.raises(ValueError, match="final_softcap"):
        OutputHead(weight=w, final_softcap=0.0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.randn(2, H), OutputHead(weight=w), torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(TypeError, match="dtree_output_layer"):
        as_output_head([w])
    with pytest.raises(ValueError, match="expected"):
        token_logprobs(torch.randn(2, H), OutputHead(module=torch.nn.Flatten(0)), torch.zeros(2, dtype=torch.long))


def test_fused_kernel_is_chosen_for_16bit_weight_heads_on_cuda():
    """``impl="auto"``: the fused Triton op for a weight head in float16/bfloat16 on CUDA
    (decided on the host: no GPU needed), the chunked torch op everywhere else."""
    pytest.importorskip("triton")
    from dtree.ops.logprobs import fused_head_kernel

    weight = torch.zeros(7, 3)
    fused, module = OutputHead(weight=weight), OutputHead(module=torch.nn.Linear(3, 7))
    assert fused_head_kernel(fused, torch.bfloat16, "cuda") and fused_head_kernel(fused, torch.float16, "cuda:1")
    assert not fused_head_kernel(fused, torch.float32, "cuda")
    assert not fused_head_kernel(fused, torch.bfloat16, "cpu")
    assert not fused_head_kernel(module, torch.bfloat16, "cuda")


def test_impl_is_checked():
    h, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="impl must be one of"):
        token_logprobs(h, OutputHead(weight=torch.randn(5, 3)), y, impl="fast")
    with pytest.raises(ValueError, match="impl='triton' needs a fused head"):
        token_logprobs(h, OutputHead(module=torch.nn.Linear(3, 5)), y, impl="triton")
