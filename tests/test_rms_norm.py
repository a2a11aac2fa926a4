"""The lean RMSNorm (``dtree.ops.rms_norm``) against HF's formula (``rms_norm_reference``).

CPU: the autograd function with its torch kernels, float64 and float32, odd sizes,
rows of every leading shape (Qwen3's per-head norms), a frozen weight; what it saves
(the input, the weight and one float32 per row), counted with saved-tensor hooks. The
Triton kernels run under the interpreter (a worker subprocess) against their torch
twins, float32 and bf16. GPU (``-m gpu``): bf16 by the flash-attention rule.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_worker import worker_fixture

from dtree.ops.rms_norm import interface as rn
from dtree.ops.weight_grads import GradOutput

SHAPES = [(63, 60), (1, 7, 3, 20), (5, 1536), (1, 1)]


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype).to(device).requires_grad_(True)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype).to(device).requires_grad_(True)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return x, w, dy


def _grads(fn, x, w, dy, eps=1e-6):
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    y = fn(x, w, eps)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_reference(shape, dtype):
    x, w, dy = _inputs(shape, dtype)
    # HF normalizes in float32 whatever the input dtype: float32 rounding in both
    tol = dict(rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(rn.rms_norm, x, w, dy), _grads(rn.rms_norm_reference, x, w, dy)):
        torch.testing.assert_close(got, want, **tol)


def test_bf16_on_cpu_matches_reference_roundings():
    x, w, dy = _inputs((33, 96), torch.bfloat16)
    y, dx, dw = _grads(rn.rms_norm, x, w, dy)
    ry, rdx, rdw = _grads(rn.rms_norm_reference, x, w, dy)
    assert torch.equal(y, ry)  # the same two roundings as HF
    torch.testing.assert_close(dx, rdx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw, rdw, rtol=2e-2, atol=5e-2)


def test_frozen_weight_and_input_without_grad():
    x, w, dy = _inputs((9, 24), torch.float32)
    w = w.detach()
    x = x.detach().requires_grad_(True)
    rn.rms_norm(x, w, 1e-6).backward(dy)
    ref = x.detach().requires_grad_(True)
    rn.rms_norm_reference(ref, w, 1e-6).backward(dy)
    torch.testing.assert_close(x.grad, ref.grad)
    out = rn.rms_norm(x.detach(), w.requires_grad_(True), 1e-6)
    out.backward(dy)
    assert w.grad is not None


def test_keeps_only_input_weight_and_row_stats():
    x, w, _ = _inputs((40, 64), torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rn.rms_norm(x, w, 1e-6)
    assert sorted(t.numel() for t in saved) == sorted([x.numel(), w.numel(), 40])
    assert {t.dtype for t in saved} == {torch.float32}
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rn.rms_norm_reference(x, w, 1e-6)
    assert sum(t.numel() for t in saved if t.numel() > 64) >= 3 * x.numel()  # HF keeps copies of the rows


def test_bad_weight_shape():
    with pytest.raises(ValueError, match="does not match rows of width 8"):
        rn.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6)


# --------------------------------------------------------------------------- interpreter
def _case_triton_matches_torch_twins(dtype: str):
    from dtree.ops.rms_norm import triton_kernels as rt

    assert rt._INTERPRET, "the worker must start with TRITON_INTERPRET=1"
    dt = getattr(torch, dtype)
    for m, n in [(37, 60), (5, 128), (1, 1), (0, 8)]:
        x, w, dy = _inputs((m, n), dt, seed=m)
        x, w = x.detach(), w.detach()
        y, r = rt.rms_norm_forward(x, w, 1e-6)
        ty, tr = rn.rms_norm_forward_torch(x, w, 1e-6)
        tol = dict(rtol=1e-6, atol=1e-6) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)  # an ulp flip
        torch.testing.assert_close(r, tr, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y, ty, **tol)
        for need in (True, False):
            dx, dw = rt.rms_norm_backward(dy, x, w, r, need)
            tdx, tdw = rn.rms_norm_backward_torch(dy, x, w, tr, need)
            torch.testing.assert_close(dx, tdx, **tol)
            assert (dw is None) == (not need)
            if need:  # bf16: the interpreter's casts to bf16 differ from torch's in the last bit
                assert dw.dtype == w.dtype  # summed in float32, written in the weight's dtype
                atol = 1e-4 if dt == torch.float32 else 2e-2 * tdw.abs().max().item()
                torch.testing.assert_close(dw, tdw.to(w.dtype), rtol=1e-5, atol=atol)
        # written into a weight's .grad (dtree.ops.weight_grads): added to what it holds, or filled
        _, tdw = rn.rms_norm_backward_torch(dy, x, w, tr, True)
        held = torch.randn(n).to(dt)
        for into in (GradOutput(held.clone(), True), GradOutput(torch.full((n,), float("nan")).to(dt), False)):
            dx, dw = rt.rms_norm_backward(dy, x, w, r, True, into)
            assert dw is None
            want = (tdw + held.float()) if into.accumulate else tdw
            atol = 1e-4 if dt == torch.float32 else 2e-2 * max(1.0, want.abs().max().item())
            torch.testing.assert_close(into.tensor.float(), want, rtol=1e-5, atol=atol)
    # the autograd function picks the kernels on CPU under the interpreter
    x, w, dy = _inputs((1, 7, 3, 20), dt)
    for got, want in zip(_grads(rn.rms_norm, x, w, dy), _grads(rn.rms_norm_reference, x, w, dy)):
        torch.testing.assert_close(got.to(torch.float32), want.to(torch.float32), rtol=2e-2, atol=5e-2)


worker = worker_fixture("test_rms_norm")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernels_match_torch_twins(worker, dtype):
    worker.run("triton_matches_torch_twins", dtype=dtype)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4099, 1536), (1, 513, 12, 128)])
def test_gpu_bf16_flash_rule(shape):
    """Output and gradients: error vs float32 at most 2x / 3x that of the bf16 reference,
    plus a floor."""
    from setups import assert_flash_rule

    x, w, dy = _inputs(shape, torch.float32, "cuda")
    exact = _grads(rn.rms_norm_reference, x, w, dy)
    base = _grads(rn.rms_norm_reference, x.bfloat16(), w.bfloat16(), dy.bfloat16())
    got = _grads(rn.rms_norm, x.bfloat16(), w.bfloat16(), dy.bfloat16())
    assert rn.load_triton_kernels(x.bfloat16()) is not None
    assert_flash_rule(got, base, exact, f"rms_norm {shape}")
