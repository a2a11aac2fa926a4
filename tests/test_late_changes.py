"""The model changes after TreeRuntime(model): a dtype move, a meta model materialized,
HF gradient checkpointing switched on and off, a device move (GPU). dtree reads the
model's state at every call, so each is exact against HF per path or a clear error."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hf_models import make_model
from setups import GROUP_TOKENS, MODES, SEQS, assert_exact, reference

import dtree


def checkpointing(model, on: bool) -> None:
    """Switch HF gradient checkpointing (renamed activation checkpointing in transformers 5.2x)."""
    name = ("activation" if hasattr(model, "activation_checkpointing_enable") else "gradient") + "_checkpointing_"
    getattr(model, name + ("enable" if on else "disable"))()


def step(rt, seqs=SEQS):
    return rt.forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll())


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@functools.cache
def float64_reference():
    return reference(make_model("llama", dtype=torch.float64))


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
def test_dtype_move_after_wrapping(mode, group_tokens):
    """float32 -> float64 after a step: the KV stack is reallocated in float64 and the
    gradients are those of the float64 model (HF's float32 RMSNorm sets the 1e-6 floor)."""
    model = make_model("llama")
    # a fixed stack size: the stack is reallocated for the new dtype alone
    rt = dtree.TreeRuntime(model, mode=mode, group_tokens=group_tokens, chunk_size=3, stack_capacity=64)
    step(rt, [[1, 2, 3, 4], [1, 2, 5]])
    assert rt.stack.dtype == torch.float32
    model.to(torch.float64).zero_grad(set_to_none=True)
    ref_model, ref_loss = float64_reference()
    out = step(rt)
    assert rt.stack.dtype == torch.float64 and rt.dtype == torch.float64
    assert_exact(model, ref_model, out, ref_loss, tol=1e-6)


def test_bf16_move_on_cpu():
    """The issue's SDPA dtype error: .to(bfloat16) after wrapping now runs in bf16 (its
    exactness rule is GPU-side, test_bf16_move_after_wrapping_on_cuda); here the loss
    agrees with the float32 reference to bf16 precision."""
    model = make_model("llama")
    _, ref_loss = reference(model)
    rt = dtree.TreeRuntime(model, chunk_size=3, group_tokens=8)  # on CPU the stack is kept between steps
    step(rt)
    model.to(torch.bfloat16).zero_grad(set_to_none=True)
    out = step(rt)
    assert rt.stack.dtype == torch.bfloat16
    assert abs(out.loss - ref_loss) < 2e-2 * abs(ref_loss)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_meta_model_materialized_after_wrapping(mode):
    ref_weights = make_model("llama", seed=5)
    with torch.device("meta"):
        model = make_model("llama", seed=5)
    rt = dtree.TreeRuntime(model, mode=mode, chunk_size=3, group_tokens=8)  # no placement read yet
    with pytest.raises(ValueError, match=r"meta device.*model.to_empty\(device=...\)"):
        step(rt)
    with pytest.raises(ValueError, match="meta device"):
        rt.logprobs(dtree.Forest.from_sequences(SEQS))
    model.to_empty(device="cpu")
    with torch.no_grad():  # initialize: weights, and the non-persistent rotary buffers
        model.load_state_dict(ref_weights.state_dict())
        for (_, b), (_, rb) in zip(model.named_buffers(), ref_weights.named_buffers()):
            b.copy_(rb)
    ref_model, ref_loss = reference(ref_weights)
    out = step(rt)
    assert_exact(model, ref_model, out, ref_loss)


def test_gradient_checkpointing_toggled_after_wrapping():
    """HF gradient checkpointing switched on after a step, then off: each step exact
    (HF's re-run layers attend through dtree's stack; tests/test_checkpoint_layers.py
    covers every mode and budget)."""
    model = make_model("qwen2")
    rt = dtree.TreeRuntime(model, chunk_size=3, group_tokens=8)
    step(rt)
    for on in (True, False):
        checkpointing(model, on)
        model.train().zero_grad(set_to_none=True)
        ref_model, ref_loss = reference(model)
        assert_exact(model, ref_model, step(rt), ref_loss)
    rt.logprobs(dtree.Forest.from_sequences(SEQS))


def test_gradient_checkpointing_on_at_construction_then_off():
    model = make_model("llama")
    checkpointing(model, True)
    model.train()
    rt = dtree.TreeRuntime(model, chunk_size=3)
    ref_model, ref_loss = reference(model)
    assert_exact(model, ref_model, step(rt), ref_loss)
    checkpointing(model, False)
    model.zero_grad(set_to_none=True)
    ref_model, ref_loss = reference(model)
    assert_exact(model, ref_model, step(rt), ref_loss)


def _stacks_during_steps(rt, model) -> list:
    """The runtime's KV stack as each model forward finishes (on CUDA it is dropped after
    every call, so it can only be read during one)."""
    seen: list = []
    model.model.register_forward_hook(lambda *args: seen.append(rt.stack))
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_cuda_move_after_wrapping(mode):
    """.cuda() after a CPU step: the KV stack moves, the backend becomes the fused
    Triton kernel, and the gradients match HF per path on the GPU (fp32, no tf32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model("qwen2", tied=True)
    rt = dtree.TreeRuntime(model, mode=mode, chunk_size=3, group_tokens=8)
    stacks = _stacks_during_steps(rt, model)
    step(rt)
    assert rt.attention == "sdpa"
    model.cuda().zero_grad(set_to_none=True)
    ref_model, ref_loss = reference(model)
    out = step(rt)
    assert stacks[-1].device.type == "cuda" and rt.attention == "triton"
    assert_exact(model, ref_model, out, ref_loss, tol=1e-4)  # fp32 kernels, another summation order


@pytest.mark.gpu
def test_bf16_move_after_wrapping_on_cuda():
    """.to(bfloat16) after a float32 step: dtree's bf16 gradients are within the
    flash-attention rule of the fp32 reference (3x the bf16 HF reference's error, plus
    an absolute floor)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model("qwen2").cuda()
    fp32_ref, _ = reference(model)
    rt = dtree.TreeRuntime(model, chunk_size=3, group_tokens=8)
    stacks = _stacks_during_steps(rt, model)
    step(rt)
    model.to(torch.bfloat16).zero_grad(set_to_none=True)
    bf16_ref, _ = reference(model)
    step(rt)
    assert stacks[-1].dtype == torch.bfloat16
    want = dict(fp32_ref.named_parameters())
    hf16 = dict(bf16_ref.named_parameters())
    for name, p in model.named_parameters():
        g32 = want[name].grad
        err_dtree = (p.grad.float() - g32).norm().item()
        err_hf = (hf16[name].grad.float() - g32).norm().item()
        assert err_dtree <= 3 * err_hf + 1e-2 * g32.norm().item() + 1e-6, name


@pytest.mark.gpu
def test_meta_model_materialized_on_cuda():
    ref_weights = make_model("llama", seed=6).cuda()
    with torch.device("meta"):
        model = make_model("llama", seed=6)
    rt = dtree.TreeRuntime(model, chunk_size=3, group_tokens=8)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.load_state_dict(ref_weights.state_dict())
        for (_, b), (_, rb) in zip(model.named_buffers(), ref_weights.named_buffers()):
            b.copy_(rb)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model, ref_loss = reference(copy.deepcopy(ref_weights))
    assert_exact(model, ref_model, step(rt), ref_loss, tol=1e-4)
