"""The ``chunked`` backend of linear_recurrence (dtree/ops/linear_recurrence/chunked.py)
against the token-by-token ``reference`` one: outputs, final states and the gradient of
every input (q, k, v, g, beta and the initial states) on varlen calls with segments of
length 0, 1, lengths that are not multiples of the 64-token chunk and long ones, zero
and nonzero initial states, with and without the delta rule and the L2 normalization,
grouped value heads, in float64 and float32. Then whole hybrid models (Qwen3.5's gated
DeltaNet, Nemotron-H's Mamba2) trained on a branching forest whose segments cross chunk
boundaries, with the backend forced, against HF run on each path; and ``auto`` on CUDA
taking ``chunked`` where flash-linear-attention is missing or refuses the GPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from reference import linearized_step
from setups import FP32_TOL, assert_exact
from test_checkpoint_layers import hf_checkpointing
from test_families import build

import dtree
from dtree.ops.linear_recurrence import fla_backend as linear_recurrence_fla
from dtree.ops.linear_recurrence import recurrence_reference
from dtree.ops.linear_recurrence.chunked import recurrence_chunked
from dtree.ops.registry import resolve_backend

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _call(lengths, heads, dtype, *, delta: bool, per_key: bool = False, zero_initial: bool = False, seed: int = 0):
    """(leaves: q, k, v, g, beta or None, initial; cu_seqlens) of a random varlen call."""
    hk, h, dk, dv = heads
    gen = torch.Generator().manual_seed(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    t, n = int(cu[-1]), len(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k, v = rand(t, hk, dk), rand(t, hk, dk), rand(t, h, dv)
    if not delta:  # SSD-like inputs: keep the un-normalized state bounded
        q, k = q * dk**-0.5, k * dk**-0.5
    g = -torch.rand(t, h, *((dk,) if per_key else ()), generator=gen, dtype=dtype) * 0.6
    beta = torch.rand(t, h, generator=gen, dtype=dtype) if delta else None
    initial = torch.zeros(n, h, dk, dv, dtype=dtype) if zero_initial else rand(n, h, dk, dv) * 0.3
    return [q, k, v, g, beta, initial], cu


def _outputs_and_grads(fn, leaves, cu, scale, qk_l2norm):
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in leaves]
    q, k, v, g, beta, initial = leaves
    out, final = fn(q, k, v, g, beta, cu, initial, scale, qk_l2norm)
    gen = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    w_final = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(final.dtype)
    live = [x for x in leaves if x is not None]
    grads = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), live)
    return [out, final, *grads]


def _assert_close(lengths, heads, dtype, *, delta, qk_l2norm, per_key=False, zero_initial=False, seed=0):
    leaves, cu = _call(lengths, heads, dtype, delta=delta, per_key=per_key, zero_initial=zero_initial, seed=seed)
    want = _outputs_and_grads(recurrence_reference, leaves, cu, 0.5, qk_l2norm)
    got = _outputs_and_grads(recurrence_chunked, leaves, cu, 0.5, qk_l2norm)
    names = ["out", "final", "dq", "dk", "dv", "dg"] + (["dbeta"] if delta else []) + ["dinitial"]
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} (lengths {lengths})"


LENGTHS = [
    [1],
    [64],
    [65, 1, 0, 130],  # a chunk and one row, an empty segment, two chunks and two rows
    [300, 3, 64, 127, 1],  # a long segment beside short ones: the short ones finish early
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize(
    "delta, qk_l2norm", [(True, True), (True, False), (False, False), (False, True)],
    ids=["delta_l2", "delta", "decay", "decay_l2"],
)
def test_chunked_matches_reference(lengths, delta, qk_l2norm, dtype):
    # grouped value heads (2 q/k heads for 4 value heads), K != V
    _assert_close(lengths, (2, 4, 8, 6), dtype, delta=delta, qk_l2norm=qk_l2norm)


@pytest.mark.parametrize("seed", range(4))
def test_chunked_random_segments_and_zero_states(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.choice([1, 2, 17, 63, 64, 65, 129, 310], size=int(rng.integers(1, 7))).tolist()
    _assert_close(lengths, (4, 4, 16, 16), torch.float32, delta=bool(seed % 2), qk_l2norm=seed % 2 == 1,
                  zero_initial=seed < 2, seed=seed)


def test_strong_decay_stays_finite():
    """Mamba2-like decays of many nats per token underflow exp(cumsum) inside a chunk:
    the chunk terms only exponentiate differences that are <= 0 (float64: as exact as
    ever; float32: finite, and within float32 rounding of float64)."""
    leaves, cu = _call([200, 70], (2, 2, 8, 4), torch.float64, delta=False)
    leaves[3] = leaves[3] * 40  # g down to -24 per token, -1500 over a chunk
    exact = _outputs_and_grads(recurrence_chunked, leaves, cu, 1.0, False)
    want = _outputs_and_grads(recurrence_reference, leaves, cu, 1.0, False)
    for a, b in zip(exact, want):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-12
    single = _outputs_and_grads(recurrence_chunked, [x.float() for x in leaves if x is not None][:4] + [None]
                                + [leaves[5].float()], cu, 1.0, False)
    results = {torch.float64: exact, torch.float32: single}
    for a, b in zip(results[torch.float32], results[torch.float64]):
        assert torch.isfinite(a).all()
        assert ((a.double() - b).abs().max() / b.abs().max()).item() <= 1e-4


def test_bf16_inputs_give_bf16_outputs_and_float32_states():
    """As the adapters call it in a bf16 model: the math in float32, close to the
    reference's, the output in the inputs' dtype."""
    leaves, cu = _call([70, 5], (2, 4, 8, 8), torch.float32, delta=True)
    low = [None if x is None else x.to(torch.bfloat16) for x in leaves[:3]] + [leaves[3], leaves[4].bfloat16(),
                                                                              leaves[5]]
    out, final = recurrence_chunked(*low[:5], cu, low[5], 0.5, True)
    want_out, want_final = recurrence_reference(*low[:5], cu, low[5], 0.5, True)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert (out.float() - want_out.float()).abs().max() <= 1e-2 * want_out.float().abs().max()
    assert (final - want_final).abs().max() <= 1e-5 * want_final.abs().max()


def test_per_key_decay_runs_the_reference():
    _assert_close([70, 5], (2, 2, 4, 3), torch.float64, delta=True, qk_l2norm=True, per_key=True)


def _long_forest(vocab: int) -> list[list[int]]:
    """Branches at several depths, segments that cross 64-token chunks at odd offsets, a
    1-token node, a prefix of another path and a second tree."""
    rng = np.random.default_rng(19)

    def tokens(n):
        return rng.integers(3, vocab, n).tolist()

    prompt, mid, one = tokens(90), tokens(70), tokens(1)
    return [prompt + mid + one + tokens(40), prompt + mid + one + tokens(5), prompt + mid + tokens(66),
            prompt + tokens(130), prompt + mid, tokens(20)]


@pytest.mark.parametrize(
    "settings",
    [{}, {"group_tokens": 0}, {"mode": "recompute", "group_tokens": 64},
     {"checkpoint_layers": True, "group_tokens": 64}],
    ids=["default", "calls", "recompute", "checkpoint_layers"],
)
@pytest.mark.parametrize("name", ["qwen3_5_text", "nemotron_h"])
def test_models_exact_with_chunked_backend(name, settings):
    model = build(name)
    model.config.max_position_embeddings = 1024  # the forest's paths are longer than the tiny configs allow
    sequences = _long_forest(model.config.vocab_size)
    ref_model = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref_model, sequences)
    runtime = dtree.TreeRuntime(model, recurrence="chunked", chunk_size=48, **settings)
    out = runtime.forward_backward(dtree.Forest.from_sequences(sequences), dtree.losses.nll())
    assert out.metrics["recurrence"] == "chunked" and (out.num_model_calls > 1 or not settings)  # default: one call
    assert abs(out.loss - ref_loss) <= FP32_TOL * max(1.0, abs(ref_loss))
    assert_exact(model, ref_model)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hf_checkpointing_around_the_checkpointed_recurrence(reentrant):
    """The backend checkpoints itself; HF's layer checkpointing around it re-runs it once more."""
    model = build("qwen3_5_text")
    model.config.max_position_embeddings = 1024
    sequences = _long_forest(model.config.vocab_size)
    ref_model = copy.deepcopy(model)
    linearized_step(ref_model, sequences)
    hf_checkpointing(model, reentrant)
    dtree.TreeRuntime(model, recurrence="chunked", chunk_size=48, group_tokens=64).forward_backward(
        dtree.Forest.from_sequences(sequences), dtree.losses.nll())
    assert_exact(model, ref_model)


def test_auto_on_cuda_takes_chunked_without_fla(monkeypatch):
    monkeypatch.setattr(linear_recurrence_fla, "fla_unavailable", lambda target: "needs flash-linear-attention")
    assert resolve_backend("linear_recurrence", "auto", "cuda", torch.bfloat16) == "chunked"
    assert resolve_backend("linear_recurrence", "chunked", "cpu", torch.float32) == "chunked"
    assert resolve_backend("linear_recurrence", "auto", "cpu", torch.float32) == "reference"


def test_fla_refused_on_hopper_with_old_triton(monkeypatch):
    """fla-core 0.6.0 raises in its gated backward on Hopper with Triton < 3.7.1: the check
    says so up front (auto then takes ``chunked``)."""
    reason = linear_recurrence_fla.hopper_triton_refusal((9, 0), "3.6.0", tilelang=False)
    assert reason is not None and "3.7.1" in reason and "chunked" in reason
    assert linear_recurrence_fla.hopper_triton_refusal((9, 0), "3.7.1", tilelang=False) is None
    assert linear_recurrence_fla.hopper_triton_refusal((9, 0), "3.6.0", tilelang=True) is None
    assert linear_recurrence_fla.hopper_triton_refusal((8, 0), "3.6.0", tilelang=False) is None
    assert linear_recurrence_fla.hopper_triton_refusal((10, 0), "3.3.1", tilelang=False) is None
