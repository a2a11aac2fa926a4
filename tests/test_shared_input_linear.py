"""Several projections of one input as one op (``dtree.ops.shared_input_linear``), and the
attention's q, k, v through it under HF's own attention forward
(``dtree.models.shared_projections``).

The op against plain ``F.linear`` calls in float64 (outputs and every gradient: the input,
each weight, each bias), with frozen weights and biases, with and without biases; what it
keeps for backward; its errors. The bias kernel under the Triton interpreter against its
torch twin. The swap: one backward node per layer for q, k, v and one for gate and up; a
``k_proj`` called on another input runs its own linear; nothing of a call stays referenced
after ``v_proj``; adapters and hooks keep the modules. The models' gradients against HF per
path are in ``tests/test_lean_layers.py`` (every lean family, every mode).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from interpreter_worker import worker_fixture

from dtree.models import lean_layers, shared_projections
from dtree.models.layer_recompute import graph_nodes
from dtree.ops.shared_input_linear import shared_input_linear, shared_input_linear_reference
from dtree.ops.shared_input_linear.interface import bias_grads_torch
from dtree.ops.weight_grads import GradOutput


def _projections(widths, biased, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 24, generator=g, dtype=dtype, requires_grad=True),
         torch.randn(n, generator=g, dtype=dtype, requires_grad=True) if b else None)
        for n, b in zip(widths, biased)
    ]


@pytest.mark.parametrize("widths,biased", [((32, 8, 8), (True, True, True)), ((40, 40), (False, False)),
                                           ((16, 8, 4), (True, False, True)), ((12,), (True,))])
def test_matches_separate_linears_in_float64(widths, biased):
    x = torch.randn(2, 13, 24, dtype=torch.float64, requires_grad=True)
    projections = _projections(widths, biased)
    leaves = [x] + [t for p in projections for t in p if t is not None]
    outs = shared_input_linear(x, projections)
    want = shared_input_linear_reference(x, projections)
    dys = [torch.randn_like(y) for y in want]
    for y, w in zip(outs, want):
        torch.testing.assert_close(y, w, rtol=0, atol=0)  # the same F.linear calls
    for got, ref in zip(torch.autograd.grad(outs, leaves, dys), torch.autograd.grad(want, leaves, dys)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_frozen_parameters_get_no_gradient_and_the_others_stay_exact():
    x = torch.randn(9, 24, dtype=torch.float64, requires_grad=True)
    projections = _projections((8, 8, 8), (True, True, True))
    projections[1][0].requires_grad_(False)
    projections[2][1].requires_grad_(False)
    outs = shared_input_linear(x, projections)
    sum(y.square().sum() for y in outs).backward()
    assert projections[1][0].grad is None and projections[2][1].grad is None
    got = [x.grad, projections[0][0].grad, projections[1][1].grad, projections[2][0].grad]
    for t in [x] + [t for p in projections for t in p]:
        t.grad = None
    sum(y.square().sum() for y in shared_input_linear_reference(x, projections)).backward()
    want = [x.grad, projections[0][0].grad, projections[1][1].grad, projections[2][0].grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_keeps_the_input_once_and_the_weights():
    x = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    projections = _projections((8, 4), (True, True))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        shared_input_linear(x, projections)
    assert [tuple(t.shape) for t in saved] == [(7, 24), (8, 24), (4, 24)]


def test_without_grad_it_is_the_plain_linears():
    x = torch.randn(5, 24, dtype=torch.float64)
    projections = _projections((8, 4), (True, False))
    with torch.no_grad():
        outs = shared_input_linear(x, projections)
    assert all(y.grad_fn is None for y in outs)
    for y, w in zip(outs, shared_input_linear_reference(x, projections)):
        torch.testing.assert_close(y, w, rtol=0, atol=0)


def test_bad_projections_are_refused():
    x = torch.randn(3, 24)
    with pytest.raises(ValueError, match="no projection"):
        shared_input_linear(x, [])
    with pytest.raises(ValueError, match="projection 1 .* width 24"):
        shared_input_linear(x, [(torch.randn(4, 24), None), (torch.randn(4, 23), None)])
    with pytest.raises(ValueError, match="projection 0"):
        shared_input_linear(x, [(torch.randn(4, 24), torch.randn(5))])


# --------------------------------------------------------------------------- interpreter
def _case_column_sums_match_torch_twin():
    from dtree.ops.shared_input_linear import triton_kernels as tk

    assert tk._INTERPRET, "the worker must start with TRITON_INTERPRET=1"
    for rows, widths in [(37, (96, 32, 40)), (1, (8,)), (0, (16, 4)), (130, (33, 1)), (200, (40, 70))]:
        for dtype, out in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                           (torch.bfloat16, torch.float32)]:
            grads = [torch.randn(rows, n).to(dtype) for n in widths]
            got = tk.column_sums(grads, [out] * len(grads))
            want = bias_grads_torch(grads, [out] * len(grads))
            for a, b in zip(got, want):
                assert a.dtype == out and a.shape == b.shape
                scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
                tol = 1e-5 if out == torch.float32 else 2 ** -6  # the interpreter's bf16 cast: two ulps
                torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol * scale)
            # written into biases' .grad (dtree.ops.weight_grads): added to, filled, or returned
            held = torch.randn(widths[0]).to(out)
            into = [GradOutput(held.clone(), True), None, GradOutput(torch.full((widths[-1],), float("nan")).to(out), False)]
            into = into[:len(grads)]
            got = tk.column_sums(grads, [out] * len(grads), into)
            for a, b, o in zip(got, want, into):
                result = a if o is None else o.tensor
                assert (a is None) == (o is not None) and result.dtype == out
                expect = b.float() + (held.float() if o is not None and o.accumulate else 0.0)
                scale = max(1.0, expect.abs().max().item()) if expect.numel() else 1.0
                tol = 1e-5 if out == torch.float32 else 2 ** -6
                torch.testing.assert_close(result.float(), expect, rtol=0, atol=tol * scale)
    with pytest.raises(ValueError, match="one to three"):
        tk.column_sums([torch.ones(2, 2)] * 4, [torch.float32] * 4)


worker = worker_fixture("test_shared_input_linear")


def test_column_sums_kernel_matches_torch_twin(worker):
    worker.run("column_sums_match_torch_twin")


# --------------------------------------------------------------------------- the swap
def _backward_node_names(model, ids) -> list[str]:
    loss = model(input_ids=ids).logits.float().square().mean()
    return [type(n).__name__ for n in graph_nodes(loss.grad_fn)]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_each_layer_has_one_node_for_qkv_and_one_for_gate_up(arch):
    model = make_model(arch)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    layers = model.config.num_hidden_layers
    with lean_layers.lean_layers_during(model) as applied:
        assert applied.qkv == layers
        names = _backward_node_names(model, ids)
        assert names.count("SharedInputLinearFunctionBackward") == 2 * layers
        linears = sum(names.count(n) for n in ("AddmmBackward0", "MmBackward0"))
        assert linears == layers + 1  # o_proj per layer and the LM head: the rest is in the shared nodes
    assert not any(hasattr(m, "_dtree_handover") for m in model.modules())  # all put back
    assert "SharedInputLinearFunctionBackward" not in _backward_node_names(model, ids)


def test_a_later_projection_on_another_input_runs_its_own_linear_and_nothing_stays_held():
    model = make_model("qwen2")
    attention = next(m for m in model.modules() if type(m).__name__ == "Qwen2Attention")
    projections = shared_projections.swap_projections([attention])
    try:
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        x, other = torch.randn(1, 5, q.in_features), torch.randn(1, 5, q.in_features)
        q(x)
        torch.testing.assert_close(k(other), torch.nn.functional.linear(other, k.weight, k.bias))
        torch.testing.assert_close(k(x), torch.nn.functional.linear(x, k.weight, k.bias))
        assert q._dtree_handover.x is x  # v's output still waits for v_proj's call
        torch.testing.assert_close(v(x), torch.nn.functional.linear(x, v.weight, v.bias))
        assert q._dtree_handover.x is None and not q._dtree_handover.outputs
    finally:
        shared_projections.restore_projections(projections)
    assert not any("forward" in vars(m) for m in model.modules())


def test_hooked_or_adapted_projections_stay_modules():
    model = make_model("llama")
    attentions = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    attentions[0].k_proj.register_forward_hook(lambda *a: None)
    assert not shared_projections.is_shared_attention(attentions[0])
    assert shared_projections.is_shared_attention(attentions[1])
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(copy.deepcopy(make_model("qwen2")), peft.LoraConfig(r=2, target_modules="all-linear"))
    assert lean_layers.apply_lean_layers(lora.base_model.model).qkv == 0


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4099])
def test_gpu_bf16_by_the_flash_rule(rows):
    """qwen2.5-1.5b's q, k, v shapes in bf16 on CUDA (the Triton bias sums, the chained
    matmuls) against float32, within the flash-attention rule of plain bf16 linears."""
    from setups import assert_flash_rule

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(rows)
    x32 = torch.randn(1, rows, 1536, device="cuda", generator=g)
    params32 = [(torch.randn(n, 1536, device="cuda", generator=g) / 40, torch.randn(n, device="cuda", generator=g))
                for n in (1536, 256, 256)]
    dys = [torch.randn(1, rows, n, device="cuda", generator=g) for n in (1536, 256, 256)]

    def grads(fn, dtype):
        x = x32.to(dtype).requires_grad_(True)
        params = [(w.to(dtype).requires_grad_(True), b.to(dtype).requires_grad_(True)) for w, b in params32]
        outs = fn(x, params)
        leaves = [x] + [t for p in params for t in p]
        return list(outs) + list(torch.autograd.grad(outs, leaves, [d.to(dtype) for d in dys]))

    exact = grads(shared_input_linear_reference, torch.float32)
    base = grads(shared_input_linear_reference, torch.bfloat16)
    got = grads(shared_input_linear, torch.bfloat16)
    assert_flash_rule(got, base, exact, f"rows={rows}", outputs=3)
