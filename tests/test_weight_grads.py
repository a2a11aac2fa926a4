"""Weight gradients added into ``param.grad`` inside the matmul (:mod:`dtree.ops.weight_grads`).

Against the reference (the same ops returning their weight gradients to autograd, whose
``AccumulateGrad`` adds them): equal gradients over several backward calls in float64, for the
shared-input projections and their biases, the RMSNorm weight and the SwiGLU down projection (plain,
consumed in one chunk and in several); the fused path really taken (autograd's accumulator never runs for those weights); and
every case where autograd must keep the gradient: ``torch.autograd.grad``, ``.backward(inputs=)``,
``create_graph``, a hook of the user's on the weight, a non-leaf weight, outside a step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model

import dtree
from dtree.baselines import METHODS, make_method
from dtree.ops.rms_norm import rms_norm
from dtree.ops.shared_input_linear import shared_input_linear
from dtree.ops.swiglu import swiglu_down
from dtree.ops.weight_grads import WAIT_BEFORE_WRITE, accumulates_in_place, in_place_weight_grads

H, I, ROWS = 12, 20, 9
SEQS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9], [1, 2, 10], [11, 12, 13, 14]]


def _weights(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"norm": (H,), "gate": (I, H), "up": (I, H), "gate_bias": (I,), "down": (H, I)}
    return {k: torch.nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64)) for k, s in shapes.items()}


def _mlp(w: dict, x: torch.Tensor, chunk_rows: int | None, consumed: bool) -> torch.Tensor:
    x = rms_norm(x, w["norm"], 1e-6) if "norm" in w else x
    gate, up = shared_input_linear(x, [(w["gate"], w["gate_bias"]), (w["up"], None)])
    if consumed:  # a re-run's gate and up: the backward writes over them (dtree.ops.rerun)
        gate, up = gate.clone(), up.clone()
    return swiglu_down(gate, up, w["down"], None, output_unused=False, chunk_rows=chunk_rows)


def _accumulator_calls(w: dict) -> dict[str, list[int]]:
    """Per weight, how many gradients autograd's ``AccumulateGrad`` node received (a hook on the
    node, not on the tensor: the weight itself stays hook-free; the node still runs, with no
    gradient, where the op added it in place)."""
    counts = {k: [0] for k in w}
    for k, p in w.items():
        node = p.view_as(p).grad_fn.next_functions[0][0]
        node.register_prehook(lambda grads, c=counts[k]: c.__setitem__(0, c[0] + (grads[0] is not None)))
        counts[k].append(node)  # keep the node (and its hook) alive
    return counts


def _train(w: dict, fused: bool, calls: int = 3, chunk_rows: int | None = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    with in_place_weight_grads(fused):
        for _ in range(calls):
            x = torch.randn(ROWS, H, generator=g, dtype=torch.float64)
            y = _mlp(w, x, chunk_rows, consumed=False)
            (y * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum().backward()
    return {k: p.grad.clone() for k, p in w.items()}


@pytest.mark.parametrize("chunk_rows", [None, 0, 4])
def test_fused_weight_grads_equal_autograds_over_calls(chunk_rows):
    ref = _train(_weights(), fused=False, chunk_rows=chunk_rows)
    w = _weights()
    counts = _accumulator_calls(w)
    got = _train(w, fused=True, chunk_rows=chunk_rows)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-12, msg=k)
    # no weight went through autograd's accumulator: the matmuls and the reductions wrote .grad
    assert [counts[k][0] for k in ("gate", "up", "down", "gate_bias", "norm")] == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_ops_add_into_the_forwards_weights(reentrant):
    """Under torch's checkpointing the backward's saved weights are other tensors (non-reentrant: the
    recompute's detached aliases): the gradient still reaches the parameter the forward was given."""
    grads = []
    for fused in (False, True):
        w = _weights()
        counts = _accumulator_calls(w)
        g = torch.Generator().manual_seed(3)
        with in_place_weight_grads(fused):
            for _ in range(2):
                x = torch.randn(ROWS, H, generator=g, dtype=torch.float64, requires_grad=True)
                y = torch.utils.checkpoint.checkpoint(_mlp, w, x, 0, False, use_reentrant=reentrant)
                y.sum().backward()
        grads.append({k: p.grad.clone() for k, p in w.items()})
        assert counts["down"][0] == (0 if fused else 2)
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-12, atol=1e-12, msg=k)


def test_consumed_swiglu_backward_adds_in_place():
    """A re-run's SwiGLU backward (``output_unused``: gate and up written over) in one chunk and
    in several, the chunks' float32 sum added once."""
    for chunk_rows in (0, 4):
        grads = []
        for fused in (False, True):
            w = _weights()
            x = torch.randn(ROWS, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
            with in_place_weight_grads(fused):
                for _ in range(2):
                    gate, up = shared_input_linear(rms_norm(x, w["norm"], 1e-6),
                                                   [(w["gate"], w["gate_bias"]), (w["up"], None)])
                    gate, up = gate * 1.0, up * 1.0  # tensors only this backward reads
                    y = swiglu_down(gate, up, w["down"], None, output_unused=True, chunk_rows=chunk_rows)
                    torch.autograd.backward(y, torch.ones_like(y))
            grads.append({k: p.grad.clone() for k, p in w.items()})
        for k in grads[0]:
            torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-12, atol=1e-12, msg=(chunk_rows, k))


def _one_call(w: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(ROWS, H, dtype=torch.float64, requires_grad=True)
    return x, _mlp(w, x, 0, consumed=False).sum()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_autograd_keeps_the_gradients_it_returns():
    """``torch.autograd.grad``, ``.backward(inputs=)`` and ``create_graph`` return or build
    gradients: nothing may be written into ``param.grad`` behind them."""
    w = _weights()
    with in_place_weight_grads():
        x, y = _one_call(w)
        grads = torch.autograd.grad(y, [w["gate"], w["down"]])
        assert all(p.grad is None for p in w.values())
        assert all(g is not None and g.abs().sum() > 0 for g in grads)
        x, y = _one_call(w)
        y.backward(inputs=[x])
        assert all(p.grad is None for p in w.values()) and x.grad is not None
        x, y = _one_call(w)
        y.backward(create_graph=True)
        assert w["down"].grad is not None and w["down"].grad.requires_grad  # autograd's, with its graph


def test_hooks_and_outside_a_backward_go_through_autograd():
    """A hook of the user's on the weight (before or after accumulation) sees autograd's gradient."""
    w = _weights()
    seen = []
    w["up"].register_hook(lambda g: seen.append("hook"))
    w["down"].register_post_accumulate_grad_hook(lambda p: seen.append("post"))
    with in_place_weight_grads():
        _one_call(w)[1].backward()
        assert not accumulates_in_place(w["gate"])  # no backward running
    assert sorted(seen) == ["hook", "post"]


def test_a_strided_weight_gets_autograds_gradient_of_its_strides():
    w = _weights()
    w["gate"] = torch.nn.Parameter(w["gate"].detach().t().contiguous().t())  # [I, H], column-major
    counts = _accumulator_calls(w)
    with in_place_weight_grads():
        _one_call(w)[1].backward()
    assert counts["gate"][0] == 1 and counts["down"][0] == 0
    assert w["gate"].grad.stride() == w["gate"].stride()


def test_a_weight_computed_from_a_parameter_gets_autograds_gradient():
    x = torch.randn(ROWS, H, dtype=torch.float64)
    grads = []
    for fused in (False, True):
        w = _weights()
        counts = _accumulator_calls(w)
        with in_place_weight_grads(fused):
            for _ in range(2):
                shared_input_linear(x, [(w["gate"] * 2.0, None)])[0].sum().backward()
        grads.append(w["gate"].grad)
        assert counts["gate"][0] == 2  # not a leaf: autograd's accumulator, both times
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_wait_hooks_run_before_the_write_and_keep_the_path_fused():
    """The host guard's hook (marked :data:`WAIT_BEFORE_WRITE`) runs once, before the first
    write, and does not send the weight back to autograd."""
    w = _weights()
    order = []

    def wait(grad):
        order.append(("wait", w["down"].grad is None))
        handle.remove()

    setattr(wait, WAIT_BEFORE_WRITE, True)
    handle = w["down"].register_hook(wait)
    counts = _accumulator_calls(w)
    with in_place_weight_grads():
        for _ in range(2):
            _one_call(w)[1].backward()
    assert order == [("wait", True)] and counts["down"][0] == 0 and w["down"].grad is not None


@pytest.mark.parametrize("name", METHODS)
def test_steps_with_and_without_weight_grads_in_matmul_agree(name):
    """Every method's step (several backward calls) gives the same gradients either way, in float64,
    the second step adding into the first's."""
    model = make_model("qwen2", dtype=torch.float64)
    twin = copy.deepcopy(model)
    kw = {"dtree": {"chunk_size": 3, "group_tokens": 0}, "linearized": {"max_tokens_per_batch": 8}}.get(name, {})
    fused = make_method(name, model, **kw)
    plain = make_method(name, twin, weight_grads_in_matmul=False, **kw)
    forest = dtree.Forest.from_sequences(SEQS)
    for _ in range(2):
        out = fused.forward_backward(forest, dtree.losses.nll())
        ref = plain.forward_backward(forest, dtree.losses.nll())
        assert out.loss == pytest.approx(ref.loss, rel=1e-12)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="weight_grads_in_matmul must be True or False"):
        dtree.RuntimeConfig(weight_grads_in_matmul="yes")
    with pytest.raises(ValueError, match="weight_grads_in_matmul must be True or False"):
        make_method("tree-mask", make_model("qwen2"), weight_grads_in_matmul=1)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_rows", [0, 64])
def test_gpu_bf16_sums_in_the_matmul_are_no_further_from_float64(chunk_rows):
    """bf16 on CUDA over four calls: each weight's gradient summed in the matmul or the reduction's
    kernel (one rounding a call) is at most as far from the float64 sum as autograd's (product or sum
    rounded, then added), within a slack of 1.25x for rounding luck."""
    torch.manual_seed(0)
    big_h, big_i, rows = 256, 512, 300
    shapes = {"norm": (big_h,), "gate": (big_i, big_h), "up": (big_i, big_h), "gate_bias": (big_i,),
              "down": (big_h, big_i)}
    base = {k: torch.randn(*s, device="cuda", dtype=torch.float64) * 0.05 for k, s in shapes.items()}
    base["norm"] += 1.0
    xs = [torch.randn(rows, big_h, device="cuda", dtype=torch.float64) for _ in range(4)]
    dys = [torch.randn(rows, big_h, device="cuda", dtype=torch.float64) for _ in range(4)]
    results = {}
    for label, dtype, fused in (("exact", torch.float64, False), ("autograd", torch.bfloat16, False),
                                ("fused", torch.bfloat16, True)):
        w = {k: torch.nn.Parameter(v.to(dtype)) for k, v in base.items()}
        with in_place_weight_grads(fused):
            for x, dy in zip(xs, dys):
                y = _mlp(w, x.to(dtype), chunk_rows, consumed=False)
                y.backward(dy.to(dtype))
        results[label] = {k: p.grad.double() for k, p in w.items()}
    for k in shapes:
        err = {m: float((results[m][k] - results["exact"][k]).abs().max()) for m in ("autograd", "fused")}
        assert err["fused"] <= 1.25 * err["autograd"], (k, err)
