"""The rotary op (``dtree.ops.rotary``) against HF's ``apply_rotary_pos_emb``.

CPU: the autograd function with its torch kernels equals HF's function bit for bit in
float64, float32 and bf16, forward and backward (q and k as HF passes them: transposed
views), and keeps only cos and sin. The Triton kernel runs under the interpreter
against its torch twin. GPU (``-m gpu``): the kernel equals HF's eager ops bit for bit
in bf16 and float32, forward and backward, at qwen2.5-1.5b's shapes and odd ones."""

from __future__ import annotations

import pytest
import torch
from interpreter_worker import worker_fixture

from dtree.ops.rotary import interface as ri


def _inputs(b, hq, hk, t, d, dtype, device="cpu", seed=0):
    """q, k as HF's attention passes them ([B, H, T, D] views of [B, T, H, D] projections),
    cos/sin as its rotary embedding makes them (cat(freqs, freqs), cast to the model dtype)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g, dtype=torch.float64).to(dtype).to(device).transpose(1, 2)
    k = torch.randn(b, t, hk, d, generator=g, dtype=torch.float64).to(dtype).to(device).transpose(1, 2)
    pos = torch.arange(t, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat([pos, pos], -1).expand(b, t, d)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    gq = torch.randn(q.shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    gk = torch.randn(k.shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return q, k, cos, sin, gq, gk


def _hf_apply_rotary():
    from transformers.models.qwen2 import modeling_qwen2

    return modeling_qwen2.apply_rotary_pos_emb


def _run(fn, q, k, cos, sin, gq, gk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    out = fn(q, k, cos, sin)
    dq, dk = torch.autograd.grad(out, (q, k), (gq, gk))
    return [out[0].detach(), out[1].detach(), dq, dk]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 12, 2, 37, 128), (2, 3, 3, 5, 6), (1, 1, 1, 1, 2)])
def test_matches_hf_bit_for_bit(dtype, shape):
    inputs = _inputs(*shape, dtype)
    for got, want in zip(_run(ri.rotary, *inputs), _run(_hf_apply_rotary(), *inputs)):
        assert torch.equal(got, want)


def test_reference_is_hf():
    inputs = _inputs(1, 4, 2, 9, 16, torch.float32)
    for got, want in zip(_run(ri.rotary_reference, *inputs), _run(_hf_apply_rotary(), *inputs)):
        assert torch.equal(got, want)


def test_keeps_only_cos_and_sin():
    q, k, cos, sin, _, _ = _inputs(1, 4, 2, 9, 16, torch.float32)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ri.rotary(q, k, cos, sin)
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin


def test_bad_inputs_are_refused():
    q, k, cos, sin, _, _ = _inputs(1, 4, 2, 9, 16, torch.float32)
    with pytest.raises(ValueError, match="rotary takes"):
        ri.rotary(q, k, cos[:, :5], sin[:, :5])
    with pytest.raises(ValueError, match="rotary takes"):
        ri.rotary(q, k.double(), cos, sin)
    assert not ri.rotary_supported(q, k, cos.requires_grad_(), sin)


# --------------------------------------------------------------------------- interpreter
def _case_triton_matches_torch_twin(dtype: str):
    from dtree.ops.rotary import triton_kernels as rt

    assert rt._INTERPRET, "the worker must start with TRITON_INTERPRET=1"
    dt = getattr(torch, dtype)
    # float32 exactly; bf16 within one rounding (the interpreter's float32 -> bf16 casts are
    # not round-to-nearest-even everywhere; the GPU test holds the kernel to HF's bits)
    tol = {"rtol": 0, "atol": 0} if dt == torch.float32 else {"rtol": 2e-2, "atol": 4e-2}
    for shape in [(1, 12, 2, 37, 128), (2, 3, 1, 5, 6), (1, 2, 2, 1, 2)]:
        q, k, cos, sin, gq, gk = _inputs(*shape, dt, seed=shape[3])
        for backward, (x, y) in ((False, (q, k)), (True, (gq, gk))):
            got = rt.rotary_apply(x, y, cos, sin, backward)
            assert got[0].stride() == x.stride() and got[1].stride() == y.stride()  # the input's layout
            for a, inp in zip(got, (x, y)):
                want = ri.rotary_torch(inp, cos, sin, backward)
                torch.testing.assert_close(a, want, **tol)
    # the autograd function picks the kernel on CPU under the interpreter
    inputs = _inputs(1, 4, 2, 19, 64, dt)
    for got, want in zip(_run(ri.rotary, *inputs), _run(_hf_apply_rotary(), *inputs)):
        torch.testing.assert_close(got, want, **tol)


worker = worker_fixture("test_rotary")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_matches_torch_twin(worker, dtype):
    worker.run("triton_matches_torch_twin", dtype=dtype)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 12, 2, 4099, 128), (2, 5, 3, 77, 64), (1, 32, 8, 513, 80)])
def test_gpu_kernel_matches_hf_bit_for_bit(dtype, shape):
    from dtree.ops.rotary import triton_kernels as rt

    inputs = _inputs(*shape, dtype, device="cuda")
    assert rt.takes(*inputs[:4])
    for got, want in zip(_run(ri.rotary, *inputs), _run(_hf_apply_rotary(), *inputs)):
        assert torch.equal(got, want), (got - want).abs().max()
