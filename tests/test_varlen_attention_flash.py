"""flash-attn ops (``dtree.baselines.kernels.varlen_attention_flash``) against the references.

CPU: flash-attn does not run here, so the stack backend's own work (gathering each
segment's ancestors from the stack, interleaving them with the own K/V, the key
offsets, adding the prefix gradients into the stack) is run with a pure-torch varlen
attention in place of the kernel (the same bottom-right causal contract, per sequence
through ``attend_math``) and compared with ``stack_attention_reference``: output, dq,
dk, dv and the stack's gradient buffers, float64. The error paths run everywhere.

GPU (``-m gpu``, skipped unless flash-attn imports): both ops against the references by
the flash-attention rule, bf16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_stack_attention import random_layout

from dtree.baselines.kernels import varlen_attention_flash as vf
from dtree.baselines.kernels.varlen_attention import VarlenLayout, varlen_attention_reference
from dtree.ops.stack_attention import (
    AttentionOptions,
    SegmentLayout,
    StackSlots,
    attend_math,
    stack_attention_reference,
)
from dtree.ops.stack_ops.kv_stack import KVStack


def attend_in_dtype(q, kk, vv, scale):
    """``attend_math`` computed entirely in the inputs' dtype (the "PyTorch at the same
    precision" side of the flash-attention rule)."""
    group = q.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    tq, tk = q.shape[0], kk.shape[0]
    allowed = torch.arange(tk, device=q.device)[None, :] <= (tk - tq) + torch.arange(tq, device=q.device)[:, None]
    return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~allowed, -torch.inf), -1), vv)


def varlen_torch(q, kk, vv, cu_q, cu_k, max_q, max_k, scale, core=attend_math):
    """flash_attn_varlen_func's causal contract in torch: sequence ``i`` has queries
    ``cu_q[i]:cu_q[i+1]`` and keys ``cu_k[i]:cu_k[i+1]``, causal aligned bottom-right."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cu_q, cu_q[1:])) and max_k == max(b - a for a, b in zip(cu_k, cu_k[1:]))
    outs = [core(q[a:b], kk[c:d], vv[c:d], scale) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    return torch.cat(outs)


def in_dtype(q, kk, vv, cu_q, cu_k, max_q, max_k, scale):
    return varlen_torch(q, kk, vv, cu_q, cu_k, max_q, max_k, scale, core=attend_in_dtype)


def problem(layout, t, used, hq, hkv, d, dtype=torch.float64, device="cpu", seed=0):
    """Stack with ancestors in [0, used) (NaN elsewhere: unread slots must stay unread),
    zeroed gradient buffers, leaf q/k/v of the call."""
    gen = torch.Generator().manual_seed(seed)
    stack = KVStack(1, used + t + 3, hkv, d, dtype=dtype, device=device)
    stack.k.fill_(float("nan"))
    stack.v.fill_(float("nan"))
    stack.k[0, :used] = torch.randn(used, hkv, d, generator=gen).to(device, dtype)
    stack.v[0, :used] = torch.randn(used, hkv, d, generator=gen).to(device, dtype)
    stack.grad_k.zero_()
    stack.grad_v.zero_()
    q, k, v = (torch.randn(t, h, d, generator=gen).to(device, dtype).requires_grad_() for h in (hq, hkv, hkv))
    return stack, q, k, v


def run(attn, stack, q, k, v, layout, scale, go):
    """``attn`` (a stack backend, ``(q, k, v, slots, options)``) forward and backward."""
    out = attn(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=scale))
    return [out, *torch.autograd.grad(out, (q, k, v), go)]


def packed_with(varlen):
    """:func:`stack_attention_packed` on ``varlen`` as a stack backend."""

    def attn(q, k, v, slots, options):
        scale = options.softmax_scale(q.shape[-1])
        return vf.stack_attention_packed(q, k, v, slots.stack, slots.layer, slots.layout, scale, varlen)

    return attn


@pytest.mark.parametrize("seed", range(4))
def test_gathered_prefix_packing_matches_reference(seed):
    rng = np.random.default_rng(seed)
    used = int(rng.integers(5, 40))
    layout, t = random_layout(rng, int(rng.integers(1, 6)), 20, used)
    hq, hkv, d = [(4, 2, 16), (3, 1, 8), (2, 2, 12), (6, 3, 8)][seed]
    scale = d**-0.5
    stack, q, k, v = problem(layout, t, used, hq, hkv, d, seed=seed)
    go = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64)

    got = run(packed_with(varlen_torch), stack, q, k, v, layout, scale, go)
    got_stack = stack.grad_k[0].clone(), stack.grad_v[0].clone()
    stack.grad_k.zero_()
    stack.grad_v.zero_()
    want = run(stack_attention_reference, stack, q, k, v, layout, scale, go)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(got_stack[0], stack.grad_k[0], atol=1e-12, rtol=1e-10, equal_nan=True)
    torch.testing.assert_close(got_stack[1], stack.grad_v[0], atol=1e-12, rtol=1e-10, equal_nan=True)


def test_no_prefix_is_plain_varlen():
    layout = SegmentLayout(np.array([0, 5, 12]), np.array([0, 5]), [(), ()])
    stack, q, k, v = problem(layout, 12, 0, 2, 1, 8)
    out = vf.stack_attention_packed(q, k, v, stack, 0, layout, 0.3, varlen_torch)
    want = varlen_attention_reference(q, k, v, VarlenLayout([0, 5, 12]), 0.3)
    torch.testing.assert_close(out, want)


def test_needs_cuda_16_bit_and_names_the_fix():
    layout = VarlenLayout([0, 3])
    q = torch.randn(3, 2, 8)
    if vf.flash_attn_impl() is None:
        with pytest.raises(RuntimeError, match="pip install flash-attn"):
            vf.varlen_attention_flash_attn(q, q[:, :1], q[:, :1], layout, 0.3)
    else:
        with pytest.raises(ValueError, match="attention='sdpa'"):
            vf.varlen_attention_flash_attn(q, q[:, :1], q[:, :1], layout, 0.3)
    with pytest.raises(ValueError, match="multiple"):
        vf.varlen_attention_flash_attn(q[:, :1], q, q, layout, 0.3)


# --------------------------------------------------------------------------- GPU
def _flash_rule(got, exact, same, names):
    for name, g, e, p in zip(names, got, exact, same):
        err = (g.float() - e).abs().max().item()
        base = (p.float() - e).abs().max().item()
        factor, floor = (2, 1e-5) if name == "out" else (3, 1e-4)
        assert err <= factor * base + floor * max(1.0, e.abs().max().item()), f"{name}: {err:.3e} vs {base:.3e}"


@pytest.mark.gpu
def test_gpu_varlen_flash_rule():
    if vf.flash_attn_impl() is None:
        pytest.skip("flash-attn is not installed")
    lengths = [257, 1, 300, 77, 512]
    layout = VarlenLayout.from_lengths(lengths)
    t, hq, hkv, d = sum(lengths), 8, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(t, h, d, device="cuda", generator=gen) for h in (hq, hkv, hkv)]
    go = torch.randn(t, hq, d, device="cuda", generator=gen)

    def grads(fn, dtype):
        x = [a.to(dtype).requires_grad_() for a in leaves]
        out = fn(*x, layout, d**-0.5)
        return [out, *torch.autograd.grad(out, x, go.to(dtype))]

    def same_precision(q, k, v, lay, scale):
        cu = lay.device_offsets(q.device)
        return in_dtype(q, k, v, cu, cu, lay.max_len, lay.max_len, scale)

    _flash_rule(grads(vf.varlen_attention_flash_attn, torch.bfloat16), grads(same_precision, torch.float32),
                grads(same_precision, torch.bfloat16), ["out", "dq", "dk", "dv"])


@pytest.mark.gpu
def test_gpu_stack_backend_flash_rule():
    if vf.flash_attn_impl() is None:
        pytest.skip("flash-attn is not installed")
    rng = np.random.default_rng(3)
    layout, t = random_layout(rng, 5, 300, 700)
    hq, hkv, d = 8, 2, 128
    base = problem(layout, t, 700, hq, hkv, d, dtype=torch.float32, device="cuda", seed=3)
    go = torch.randn(t, hq, d, device="cuda")

    def grads(fn, dtype):
        stack, q, k, v = problem(layout, t, 700, hq, hkv, d, dtype=dtype, device="cuda", seed=3)
        stack.k.copy_(base[0].k.to(dtype))
        stack.v.copy_(base[0].v.to(dtype))
        out = run(fn, stack, q, k, v, layout, d**-0.5, go.to(dtype))
        return out + [stack.grad_k[0, :700], stack.grad_v[0, :700]]

    same_precision = packed_with(in_dtype)  # the gather and packing checked on CPU; bf16 math throughout here
    _flash_rule(grads(vf.stack_attention_flash_attn, torch.bfloat16), grads(stack_attention_reference, torch.float32),
                grads(same_precision, torch.bfloat16), ["out", "dq", "dk", "dv", "stack dk", "stack dv"])


def test_linearized_baseline_picks_flash_attn_when_installed(monkeypatch):
    """``attention="auto"`` takes flash-attn's varlen kernel where it runs (decided by
    :func:`flash_attn_available`), and the dispatcher routes ``"flash-attn"`` to it; here
    a stand-in with its contract (the reference math) plays the kernel on the CPU."""
    from hf_models import make_model

    import dtree
    from dtree.baselines import LinearizedTrainer
    from dtree.baselines.kernels import varlen_attention as va
    from dtree.baselines.kernels.varlen_interface import varlen_attention

    calls = []

    def stand_in(q, k, v, layout, scale):
        calls.append(layout.num_tokens)
        return varlen_attention_reference(q, k, v, layout, scale)

    monkeypatch.setattr(vf, "varlen_attention_flash_attn", stand_in)
    monkeypatch.setattr(va, "flash_attn_available", lambda device, dtype, head_dim: True)
    layout = VarlenLayout([0, 4, 9])
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    torch.testing.assert_close(varlen_attention(q, k, v, layout, 0.3, "flash-attn"),
                               varlen_attention_reference(q, k, v, layout, 0.3))
    model = make_model("llama")
    trainer = LinearizedTrainer(model)
    assert trainer.attention == "flash-attn"
    out = trainer.forward_backward(dtree.Forest.from_sequences([[1, 2, 3], [1, 2, 4, 5]]), dtree.losses.nll())
    assert out.metrics["attention"] == "flash-attn" and calls
