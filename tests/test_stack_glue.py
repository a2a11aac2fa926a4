"""The KV stack's per-layer glue (``dtree.ops.stack_glue``): the push of K and V into
their slots and the fold of the gradient slots into dK/dV, against their torch
references; the Triton kernels under the interpreter (strided K/V as transformers
hands them over, values narrower than keys as MLA has them, missing gradients), and
on CUDA (``-m gpu``). The runtime paths that use them are covered end to end by every
exactness test."""

from __future__ import annotations

import pytest
import torch
from interpreter_worker import worker_fixture

from dtree.kv_stack import KVStack
from dtree.ops import stack_glue as sg

SHAPES = [(37, 2, 12, 12), (5, 3, 16, 8), (1, 1, 4, 4)]  # T, kv heads, key dim, value dim


def _strided(t, h, d, dtype, seed):
    """[T, H, D] as transformers hands K/V over: a transpose of a [1, H, T, D] tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, d, generator=g).to(dtype)[0].transpose(0, 1)


def _check_push(dtype, t, h, dk, dv):
    stack = KVStack(3, t + 9, h, dk, v_head_dim=dv, dtype=dtype, device="cpu")
    stack.k.zero_()
    stack.v.zero_()
    k, v = _strided(t, h, dk, dtype, 1), _strided(t, h, dv, dtype, 2)
    assert t == 1 or not k.is_contiguous()
    sg.push_kv(*stack.slots(1, 4, t), k, v)
    assert torch.equal(stack.k[1, 4 : 4 + t], k) and torch.equal(stack.v[1, 4 : 4 + t], v)
    assert stack.k[1, :4].abs().sum() == 0 and stack.k[1, 4 + t :].abs().sum() == 0 and stack.k[0].abs().sum() == 0


def _check_fold(dtype, t, h, dk, dv):
    g = torch.Generator().manual_seed(3)
    sk, sv = torch.randn(t, h, dk, generator=g), torch.randn(t, h, dv, generator=g)
    gk, gv = torch.randn(t, h, dk, generator=g).to(dtype), torch.randn(t, h, dv, generator=g).to(dtype)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # interpreter's bf16 casts
    for a, b in ((gk, gv), (None, gv), (gk, None), (None, None)):
        got = sg.fold_seed(sk, sv, a, b, (dtype, dtype))
        want = sg.fold_seed_torch(sk, sv, a, b, (dtype, dtype))
        for x, y in zip(got, want):
            assert x.dtype == dtype
            torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_references(shape, dtype):
    _check_push(dtype, *shape)
    _check_fold(dtype, *shape)


def test_push_refuses_mismatched_slots():
    with pytest.raises(ValueError, match="for slots"):
        sg.push_kv(torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), torch.zeros(2, 2, 4), torch.zeros(3, 2, 4))


def _case_triton_matches_torch(dtype: str):
    from dtree.ops import stack_glue_triton as st

    assert st._INTERPRET, "the worker must start with TRITON_INTERPRET=1"
    for shape in SHAPES:
        _check_push(getattr(torch, dtype), *shape)
        _check_fold(getattr(torch, dtype), *shape)


worker = worker_fixture("test_stack_glue")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernels_match_torch(worker, dtype):
    worker.run("triton_matches_torch", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernels_match_torch(dtype):
    t, h, dk, dv = 4099, 4, 128, 128
    stack = KVStack(2, t + 5, h, dk, v_head_dim=dv, dtype=dtype, device="cuda")
    k, v = _strided(t, h, dk, dtype, 1).cuda(), _strided(t, h, dv, dtype, 2).cuda()
    sg.push_kv(*stack.slots(1, 5, t), k, v)
    assert torch.equal(stack.k[1, 5:], k) and torch.equal(stack.v[1, 5:], v)
    sk, sv = torch.randn(t, h, dk, device="cuda"), torch.randn(t, h, dv, device="cuda")
    gk, gv = torch.randn_like(sk).to(dtype), torch.randn_like(sv).to(dtype)
    for x, y in zip(sg.fold_seed(sk, sv, gk, gv, (dtype, dtype)), sg.fold_seed_torch(sk, sv, gk, gv, (dtype, dtype))):
        assert torch.equal(x, y)
