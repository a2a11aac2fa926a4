"""The lean SwiGLU (``dtree.ops.swiglu``) against HF's ops (``silu_mul_reference``,
``swiglu_down_reference``).

CPU: both autograd functions with their torch kernels, float64 and float32, odd
sizes, with and without bias, frozen pieces; what they save (``gate`` and ``up``, plus
the weight for the fused down projection: never the SiLU output or the product),
counted with saved-tensor hooks; a re-run's backward (``output_unused``), which writes
the gradients over gate and up, in one chunk and several. The Triton kernels run under the interpreter against
their torch twins, in place where the down projection owns the buffers. GPU
(``-m gpu``): bf16 by the flash-attention rule.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_worker import worker_fixture

from dtree.ops.swiglu import interface as sw


def _inputs(shape, h, dtype, device="cpu", seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    gate, up = r(*shape, scale=2.0), r(*shape)
    w = r(h, shape[-1], scale=shape[-1] ** -0.5)
    b = r(h) if bias else None
    dy = r(*shape[:-1], h)
    return gate, up, w, b, dy


def _grads(fn, *inputs, dy):
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("shape", [(63, 60), (1, 9, 100), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference(shape, dtype, bias):
    gate, up, w, b, dy = _inputs(shape, 24, dtype, bias=bias)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    got = _grads(sw.swiglu_down, gate, up, w, b, dy=dy)
    want = _grads(sw.swiglu_down_reference, gate, up, w, b, dy=dy)
    for a, e in zip(got, want):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a, e, **tol)
    dp = torch.randn_like(gate)
    for a, e in zip(_grads(sw.silu_mul, gate, up, dy=dp), _grads(sw.silu_mul_reference, gate, up, dy=dp)):
        torch.testing.assert_close(a, e, **tol)


def test_bf16_on_cpu_matches_reference_roundings():
    gate, up, _, _, _ = _inputs((17, 96), 8, torch.bfloat16)
    dp = torch.randn_like(gate)
    got, want = _grads(sw.silu_mul, gate, up, dy=dp), _grads(sw.silu_mul_reference, gate, up, dy=dp)
    for a, e in zip(got, want):
        assert torch.equal(a, e)  # the same ops and roundings as HF


def test_frozen_pieces():
    gate, up, w, b, dy = _inputs((11, 30), 12, torch.float32)
    for frozen in ("w", "gate", "up"):
        leaves = {"gate": gate.clone(), "up": up.clone(), "w": w.clone(), "b": b.clone()}
        for name, t in leaves.items():
            t.requires_grad_(name != frozen)
        sw.swiglu_down(leaves["gate"], leaves["up"], leaves["w"], leaves["b"]).backward(dy)
        ref = {k: v.detach().requires_grad_(k != frozen) for k, v in leaves.items()}
        sw.swiglu_down_reference(ref["gate"], ref["up"], ref["w"], ref["b"]).backward(dy)
        for name in leaves:
            if name == frozen:
                assert leaves[name].grad is None
            else:
                torch.testing.assert_close(leaves[name].grad, ref[name].grad, rtol=1e-5, atol=1e-6)


def _saved(fn, *args):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


def test_keeps_gate_up_and_weight_only():
    gate, up, w, b, _ = _inputs((40, 64), 16, torch.float32)
    gate, up, w = (t.requires_grad_(True) for t in (gate, up, w))
    saved = _saved(sw.swiglu_down, gate, up, w, b)
    assert {id(t) for t in saved} == {id(gate), id(up), id(w)}
    saved = _saved(sw.silu_mul, gate, up)
    assert {id(t) for t in saved} == {id(gate), id(up)}
    # HF's ops keep the SiLU output and the product besides
    hf = _saved(sw.swiglu_down_reference, gate, up, w, b)
    assert sum(t.numel() for t in hf if t.shape == gate.shape) == 4 * gate.numel()


def _consumed_grads(gate, up, w, b, dy, chunk_rows=None, owned=False):
    """Grads through ``swiglu_down(output_unused=True)`` (a re-run's form, whose backward
    writes over its gate and up: they are made here, as a re-run makes them), or with
    ``owned`` through ``swiglu_down(inputs_owned=True)`` (a step's form: the output computed),
    and the addresses of the gate and up it was given and of their gradients."""
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (gate, up, w, b)]
    g_in, u_in = leaves[0] * 1, leaves[1] * 1  # non-leaf, like the projections' outputs
    seen = {"gate": g_in.data_ptr(), "up": u_in.data_ptr()}
    g_in.register_hook(lambda g: seen.__setitem__("dgate", g.data_ptr()))
    u_in.register_hook(lambda g: seen.__setitem__("dup", g.data_ptr()))
    if owned:
        y = sw.swiglu_down(g_in, u_in, leaves[2], leaves[3], chunk_rows=chunk_rows, inputs_owned=True)
        assert torch.equal(y, sw.swiglu_down(gate, up, w, b))
    else:
        y = sw.swiglu_down(g_in, u_in, leaves[2], leaves[3], output_unused=True, chunk_rows=chunk_rows)
        assert not y.any()
    y.backward(dy)
    return [t.grad if t is not None else None for t in leaves], seen


@pytest.mark.parametrize("rows", [4096, 5, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_consuming_backward_matches(rows, dtype, monkeypatch):
    # a re-run's backward: the same gradients (the same bits in one chunk), written over gate and up
    monkeypatch.setattr(sw, "CONSUMING_CHUNK_ROWS", rows)
    gate, up, w, b, dy = _inputs((2, 19, 60), 24, dtype)
    got, seen = _consumed_grads(gate, up, w, b, dy)
    want = _grads(sw.swiglu_down, gate, up, w, b, dy=dy)[1:]
    for a, e in zip(got, want):
        if rows >= 38:
            assert torch.equal(a, e)
        else:
            torch.testing.assert_close(a, e, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-6)
    assert seen["dgate"] == seen["gate"] and seen["dup"] == seen["up"]
    # empty rows, no bias, frozen weight
    gate, up, w, _, dy = _inputs((0, 8), 4, dtype)
    got, _ = _consumed_grads(gate, up, w, None, dy)
    assert got[0].shape == gate.shape and got[2].shape == w.shape and not got[2].any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_consuming_backward_takes_the_callers_chunk_rows(dtype, monkeypatch):
    """``chunk_rows`` (a re-run's, :func:`dtree.ops.rerun.rerun_chunk_rows`) over the op's own rows:
    0 runs every row in one chunk (the same bits as the backward that consumes nothing), 5 in chunks
    of 5; a negative count is refused by name."""
    monkeypatch.setattr(sw, "CONSUMING_CHUNK_ROWS", 3)
    chunks = []
    original = sw._backward_in_place
    monkeypatch.setattr(sw, "_backward_in_place", lambda *a: chunks.append(a[0].shape[0]) or original(*a))
    gate, up, w, b, dy = _inputs((2, 19, 60), 24, dtype)
    want = _grads(sw.swiglu_down, gate, up, w, b, dy=dy)[1:]
    got, _ = _consumed_grads(gate, up, w, b, dy, chunk_rows=0)
    assert chunks == [38] and all(torch.equal(a, e) for a, e in zip(got, want))
    chunks.clear()
    got, _ = _consumed_grads(gate, up, w, b, dy, chunk_rows=5)
    assert chunks == [5] * 7 + [3]
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk_rows must be None or >= 0"):
        sw.swiglu_down(gate, up, w, b, output_unused=True, chunk_rows=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_owned_inputs_give_the_same_bits_written_over_gate_and_up(dtype):
    """``inputs_owned`` (a step's graph, :mod:`dtree.ops.backward_once`) in one chunk: the forward's
    output and every gradient bit for bit those of the backward that keeps its inputs, the input
    gradients written over ``gate`` and ``up``."""
    gate, up, w, b, dy = _inputs((2, 19, 60), 24, dtype)
    want = _grads(sw.swiglu_down, gate, up, w, b, dy=dy)[1:]
    got, seen = _consumed_grads(gate, up, w, b, dy, chunk_rows=0, owned=True)
    assert all(torch.equal(a, e) for a, e in zip(got, want))
    assert seen["dgate"] == seen["gate"] and seen["dup"] == seen["up"]


def test_bad_shapes():
    with pytest.raises(ValueError, match="do not match"):
        sw.swiglu_down(torch.ones(2, 8), torch.ones(2, 8), torch.ones(4, 7))
    with pytest.raises(ValueError, match="differ"):
        sw.silu_mul(torch.ones(2, 8), torch.ones(2, 7))


# --------------------------------------------------------------------------- interpreter
def _case_triton_matches_torch_twins(dtype: str):
    from dtree.ops.swiglu import triton_kernels as st

    assert st._INTERPRET, "the worker must start with TRITON_INTERPRET=1"
    dt = getattr(torch, dtype)
    tol = dict(rtol=1e-6, atol=1e-6) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)  # bf16: an ulp flip
    for shape in [(37, 60), (1, 300), (0, 4)]:
        gate, up, w, b, dy = _inputs(shape, 12, dt, seed=shape[0])
        torch.testing.assert_close(st.silu_mul_forward(gate, up), sw.silu_mul_forward_torch(gate, up), **tol)
        dp = torch.randn(shape, dtype=torch.float64).to(dt)
        want = sw.silu_mul_backward_torch(dp, gate, up)
        got = st.silu_mul_backward(dp.clone(), gate, up)
        spare, owned = torch.empty_like(dp), dp.clone()
        in_place = st.silu_mul_backward(owned, gate, up, reuse_dp=True, spare=spare)
        assert in_place[0].data_ptr() == owned.data_ptr() and in_place[1].data_ptr() == spare.data_ptr()
        for a, b_, e in zip(got, in_place, want):
            torch.testing.assert_close(a, e, **tol)
            torch.testing.assert_close(b_, e, **tol)
        # a re-run's backward: product, dgate, dup over dp, gate, up
        buffers = [dp.clone(), gate.clone(), up.clone()]
        twins = [dp.clone(), gate.clone(), up.clone()]
        st.silu_mul_backward_in_place(*buffers)
        sw.silu_mul_backward_in_place_torch(*twins)
        expected = [sw.silu_mul_forward_torch(gate, up), *want]
        for a, b_, e in zip(buffers, twins, expected):
            torch.testing.assert_close(a, e, **tol)
            torch.testing.assert_close(b_, e, **tol)
    # the autograd functions pick the kernels on CPU under the interpreter
    gate, up, w, b, dy = _inputs((1, 9, 100), 24, dt)
    got = _grads(sw.swiglu_down, gate, up, w, b, dy=dy)
    want = _grads(sw.swiglu_down_reference, gate, up, w, b, dy=dy)
    for a, e in zip(got, want):
        scale = e.abs().max().item()
        torch.testing.assert_close(a, e, rtol=1e-5 if dt == torch.float32 else 3e-2, atol=3e-2 * scale)
    consumed, _ = _consumed_grads(gate, up, w, b, dy)  # the in-place kernel, in chunks of 4096 rows: one here
    for a, e in zip(consumed, got[1:]):
        assert torch.equal(a, e)


worker = worker_fixture("test_swiglu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernels_match_torch_twins(worker, dtype):
    worker.run("triton_matches_torch_twins", dtype=dtype)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape,h", [((4099, 8960), 1536), ((1, 513, 300), 72)])
def test_gpu_bf16_flash_rule(shape, h):
    from setups import assert_flash_rule

    gate, up, w, b, dy = _inputs(shape, h, torch.float32, "cuda", bias=False)
    exact = _grads(sw.swiglu_down_reference, gate, up, w, None, dy=dy)
    half = [t.bfloat16() for t in (gate, up, w)]
    base = _grads(sw.swiglu_down_reference, *half, None, dy=dy.bfloat16())
    got = _grads(sw.swiglu_down, *half, None, dy=dy.bfloat16())
    assert_flash_rule(got, base, exact, f"swiglu_down {shape}")
    consumed, seen = _consumed_grads(*half, None, dy.bfloat16())  # 4099 rows: two chunks
    assert seen["dgate"] == seen["gate"]
    assert_flash_rule([got[0], *consumed[:3]], base, exact, f"swiglu_down re-run backward {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sum_chunk_in_matmul(dtype):
    # the re-run backward's float32 sum of its chunks' weight gradients, accumulated in the matmul,
    # against the float64 sum of the same half-precision products: closer than summing rounded parts
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunks = [(torch.randn(1536, 4096, device="cuda", generator=gen).to(dtype),
               torch.randn(4096, 8960, device="cuda", generator=gen).to(dtype)) for _ in range(3)]
    summed = torch.full((1536, 8960), float("nan"), device="cuda")  # the first chunk overwrites it
    for i, (a, b) in enumerate(chunks):
        sw.sum_chunk_in_matmul(summed, a, b, first=i == 0)
    exact = sum(a.double() @ b.double() for a, b in chunks)
    rounded = sum((a @ b).float() for a, b in chunks)  # the sum it replaces: each part rounded first
    err, old_err = (summed.double() - exact).abs().max().item(), (rounded.double() - exact).abs().max().item()
    assert err <= 1e-5 * exact.abs().max().item(), err
    assert err < old_err, (err, old_err)
