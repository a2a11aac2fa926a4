"""The MLP of a checkpointed layer's re-run (:mod:`dtree.ops.swiglu.rerun_mlp`): every gradient
against HF's ops in autograd (float64, several chunks, a ragged last one, with and without
biases, frozen parts), one chunk bit for bit against the path it replaces (the gate/up op and
the consuming SwiGLU backward), a zero output without a matmul, bad shapes; and end to end, a
checkpointed step with tiny chunks against HF run on each path."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_models import make_model
from setups import assert_exact, reference, run_dtree

from dtree.ops.shared_input_linear import shared_input_linear
from dtree.ops.swiglu import rerun_mlp, rerun_mlp_reference, swiglu_down

MODULE = importlib.import_module("dtree.ops.swiglu.rerun_mlp")  # the package's attribute is the function


def _parts(dtype, biased: bool, seed: int = 0, rows: int = 11, h: int = 6, i: int = 10, h_out: int = 6):
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    x = t(1, rows, h)
    proj = [(t(i, h), t(i) if biased else None), (t(i, h), t(i) if biased else None),
            (t(h_out, i), t(h_out) if biased else None)]
    return x, proj


def _grads(fn, x, proj, dy, frozen=()):
    x = x.clone().requires_grad_()
    leaves = [(w.clone().requires_grad_(k not in frozen), None if b is None else b.clone().requires_grad_(k not in frozen))
              for k, (w, b) in enumerate(proj)]
    fn(x, *leaves).backward(dy)
    out = [x.grad]
    for w, b in leaves:
        out += [w.grad, None if b is None else b.grad]
    return out


@pytest.fixture
def chunk_rows(monkeypatch):
    def set_rows(n):
        monkeypatch.setattr(MODULE, "RERUN_CHUNK_ROWS", n)

    return set_rows


@pytest.mark.parametrize("rows", [1, 4, 11, 64])
@pytest.mark.parametrize("biased", [False, True])
def test_every_gradient_matches_hf_ops(chunk_rows, rows, biased):
    chunk_rows(rows)
    x, proj = _parts(torch.float64, biased)
    dy = torch.randn(1, x.shape[1], proj[2][0].shape[0], dtype=torch.float64)
    got = _grads(rerun_mlp, x, proj, dy)
    want = _grads(rerun_mlp_reference, x, proj, dy)
    for k, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), k
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_frozen_projections_get_no_gradient(chunk_rows):
    chunk_rows(4)
    x, proj = _parts(torch.float64, True)
    dy = torch.randn(1, x.shape[1], 6, dtype=torch.float64)
    got = _grads(rerun_mlp, x, proj, dy, frozen=(0, 2))
    want = _grads(rerun_mlp_reference, x, proj, dy, frozen=(0, 2))
    assert got[1] is None and got[2] is None and got[5] is None and got[6] is None
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_one_chunk_is_the_replaced_path_bit_for_bit():
    """Without biases (their sums differ in order on CUDA only): the gate/up op and the SwiGLU
    down op that consumes its inputs, as a re-run ran them before."""
    x, proj = _parts(torch.float32, False, rows=40, h=16, i=24, h_out=16)
    dy = torch.randn(1, 40, 16)

    def replaced(x, gate, up, down):
        g, u = shared_input_linear(x, (gate, up))
        return swiglu_down(g, u, down[0], down[1], output_unused=True)

    for a, b in zip(_grads(rerun_mlp, x, proj, dy), _grads(replaced, x, proj, dy)):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_the_output_is_a_zero_view():
    x, proj = _parts(torch.float32, True)
    out = rerun_mlp(x.requires_grad_(), *proj)
    assert out.shape == (1, 11, 6) and out.stride() == (0, 0, 0) and not out.any()


def test_projections_that_do_not_chain_are_refused():
    x, proj = _parts(torch.float32, False)
    with pytest.raises(ValueError, match="do not chain"):
        rerun_mlp(x, proj[0], (torch.randn(9, 6), None), proj[2])


@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_checkpointed_steps_with_tiny_chunks_match_per_path(chunk_rows, mode, monkeypatch):
    chunk_rows(5)
    chunks = []
    original = MODULE._backward_in_place

    def counted(dp, g, u):
        chunks.append(dp.shape[0])
        return original(dp, g, u)

    monkeypatch.setattr(MODULE, "_backward_in_place", counted)
    model = make_model("qwen2", tied=True)
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=8, checkpoint_layers=True)
    assert_exact(tree_model, ref_model, out, ref_loss)
    assert chunks and max(chunks) == 5 and min(chunks) < 5  # the re-runs went through it, in several chunks
