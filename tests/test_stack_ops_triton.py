"""The Triton tier of the KV stack's ops (``dtree.ops.stack_ops.triton_kernels``: what a GPU
without the CUDA extension runs): the push of K and V into their slots and the fold of
the gradient slots into dK/dV, against their torch references
(``dtree.ops.stack_ops.reference``), through the dispatch of ``dtree.ops.stack_ops``: under
Triton's CPU interpreter (strided K/V as transformers hands them over, values narrower
than keys as MLA has them, missing gradients), and on CUDA (``-m gpu``). The runtime
paths that use them are covered end to end by every exactness test."""

from __future__ import annotations

import pytest
import torch
from interpreter_worker import worker_fixture

from dtree.ops.stack_ops import interface as stack_ops
from dtree.ops.stack_ops import reference as stack_ops_torch

SHAPES = [(37, 2, 12, 12), (5, 3, 16, 8), (1, 1, 4, 4)]  # T, kv heads, key dim, value dim


def _strided(t, h, d, dtype, seed, device="cpu"):
    """[T, H, D] as transformers hands K/V over: a transpose of a [1, H, T, D] tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, d, generator=g).to(dtype)[0].transpose(0, 1).to(device)


def _check_push(dtype, t, h, dk, dv, device="cpu"):
    ks, vs = torch.zeros(t + 9, h, dk, dtype=dtype, device=device), torch.zeros(t + 9, h, dv, dtype=dtype, device=device)
    k, v = _strided(t, h, dk, dtype, 1, device), _strided(t, h, dv, dtype, 2, device)
    assert t == 1 or not k.is_contiguous()
    stack_ops.push_kv(ks, vs, 4, k, v)
    assert torch.equal(ks[4 : 4 + t], k) and torch.equal(vs[4 : 4 + t], v)
    assert ks[:4].abs().sum() == 0 and ks[4 + t :].abs().sum() == 0 and vs[4 + t :].abs().sum() == 0


def _check_fold(dtype, t, h, dk, dv, device="cpu", exact=True):
    g = torch.Generator().manual_seed(3)
    sk, sv = torch.randn(t + 3, h, dk, generator=g).to(device), torch.randn(t + 3, h, dv, generator=g).to(device)
    gk = torch.randn(t, h, dk, generator=g).to(dtype).to(device)
    gv = torch.randn(t, h, dv, generator=g).to(dtype).to(device)
    tol = dict(rtol=0, atol=0) if exact or dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # interpreter bf16
    for a, b in ((gk, gv), (None, gv), (gk, None), (None, None)):
        got = stack_ops.seed_grad(sk, sv, 2, a, b, t, dtype, dtype)
        want = stack_ops_torch.seed_grad(sk, sv, 2, a, b, t, dtype, dtype)
        for x, y in zip(got, want):
            assert x.dtype == dtype
            torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_off_gpu_is_the_torch_reference(shape, dtype):
    _check_push(dtype, *shape)
    _check_fold(dtype, *shape)


def _case_triton_matches_torch(dtype: str):
    from dtree.ops.stack_ops import triton_kernels as st

    assert st._INTERPRET, "the worker must start with TRITON_INTERPRET=1"
    assert stack_ops._triton_runs(torch.zeros(1)), "the Triton tier must serve CPU tensors under the interpreter"
    for shape in SHAPES:
        _check_push(getattr(torch, dtype), *shape)
        _check_fold(getattr(torch, dtype), *shape, exact=False)


worker = worker_fixture("test_stack_ops_triton")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernels_match_torch(worker, dtype):
    worker.run("triton_matches_torch", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_tier_matches_torch_bit_for_bit(dtype):
    from dtree.ops.stack_ops import triton_kernels as st

    t, h, dk, dv = 4099, 4, 128, 128
    ks, vs = torch.zeros(t + 5, h, dk, dtype=dtype, device="cuda"), torch.zeros(t + 5, h, dv, dtype=dtype, device="cuda")
    k, v = _strided(t, h, dk, dtype, 1, "cuda"), _strided(t, h, dv, dtype, 2, "cuda")
    st.push_kv(ks[5:], vs[5:], k, v)
    assert torch.equal(ks[5:], k) and torch.equal(vs[5:], v)
    sk, sv = torch.randn(t, h, dk, device="cuda"), torch.randn(t, h, dv, device="cuda")
    gk, gv = torch.randn_like(sk).to(dtype), torch.randn_like(sv).to(dtype)
    got = st.fold_seed(sk, sv, gk, gv, (dtype, dtype))
    want = stack_ops_torch.seed_grad(sk, sv, 0, gk, gv, t, dtype, dtype)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
