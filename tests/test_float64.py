"""float64 stays float64: a float64 model trained through dtree agrees with HF run on each
path to 1e-12 on shared-prefix forests, against a golden reference that computes in
float64 throughout (``hf_models.make_golden_model``).

Two things used to cap it at float32 accuracy (about 1e-8): the KV stack's gradient
slots were float32 (a shared prefix's K/V gradient is summed over its descendants
there), and tensor fields were stored rounded to float32. Both are checked directly
too."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_models import ARCHS, make_golden_model, make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import grad_errors, linearized_step
from setups import SEQS
from strategies import sequence_batches

import dtree

GOLDEN_TOL = 1e-12
# the walk's variants: graphs kept, groups re-run, node by node in 3-token segments
SETTINGS = {
    "retain": dict(mode="retain"),
    "recompute": dict(mode="recompute", chunk_size=3),
    "node-by-node": dict(group_tokens=0, chunk_size=3),
}


def golden_check(model, seqs, rt_kw, fields=None, kind="nll", reduction="sum", loss=None, **loss_kw):
    """Train ``seqs`` through dtree and through HF per path; return the worst relative
    parameter-gradient error and both losses."""
    ref = copy.deepcopy(model)
    tree = copy.deepcopy(model)
    forest = dtree.Forest.from_sequences(seqs, **(fields or {}))
    loss = loss or dtree.losses.nll(reduction=reduction)
    out = dtree.TreeRuntime(tree, **rt_kw).forward_backward(forest, loss)
    ref_loss, _ = linearized_step(ref, seqs, fields, kind, reduction, **loss_kw)
    errs = grad_errors(tree, ref)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tree.parameters())
    return max(errs.values()), out.loss, ref_loss


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_float64_matches_golden_reference(arch, setting):
    """The shared-prefix forest of the per-setup tests (branches at several depths, a
    duplicate, a sequence ending inside another), every parameter to 1e-12."""
    err, loss, ref_loss = golden_check(make_golden_model(arch), SEQS, SETTINGS[setting], reduction="token_mean")
    assert err < GOLDEN_TOL, f"{arch} {setting}: gradient off by {err:.2e}"
    assert abs(loss - ref_loss) <= GOLDEN_TOL * abs(ref_loss)


def test_float64_issue_case():
    """The measured case: [[28, 13], [28, 78, 59]] on a float64 Qwen2, nll(sum) (off by
    4.4e-8 with float32 stack gradients), and a single sequence split into 3-token
    segments (off by 2.0e-8)."""
    model = make_golden_model("qwen2")
    err, _, _ = golden_check(model, [[28, 13], [28, 78, 59]], {})
    assert err < GOLDEN_TOL, err
    err, _, _ = golden_check(model, [[28, 78, 59, 3, 4, 5, 6, 7, 9]], {"chunk_size": 3, "group_tokens": 0})
    assert err < GOLDEN_TOL, err


def _ppo_fields(model, seqs, seed: int):
    """float64 tensor fields: advantages, and old log-probs from dtree's own log-probs
    of the model (the README's round trip), shifted by a little noise so ratios differ
    from 1 and some tokens clip."""
    g = torch.Generator().manual_seed(seed)
    lps = dtree.TreeRuntime(model).logprobs(dtree.Forest.from_sequences(seqs))
    old = [torch.cat([lp.new_zeros(1), lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype)]) for lp in lps]
    adv = [torch.randn(len(s), generator=g, dtype=torch.float64) for s in seqs]
    mask = [torch.tensor([0.0] + [float(i % 3 != 1) for i in range(1, len(s))], dtype=torch.float64) for s in seqs]
    return {"advantages": adv, "old_logprobs": old, "loss_mask": mask}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float64_ppo_with_float64_fields(arch):
    """PPO-clip with float64 advantages and old log-probs (tensor fields, kept at their
    precision) and a loss mask, against the reference's PPO per path."""
    model = make_golden_model(arch)
    fields = _ppo_fields(model, SEQS, seed=1)
    loss = dtree.losses.ppo_clip(clip_eps=0.2, reduction="sum")
    err, loss_value, ref_loss = golden_check(model, SEQS, {"chunk_size": 3}, fields, kind="ppo", loss=loss)
    assert err < GOLDEN_TOL, err
    assert abs(loss_value - ref_loss) <= GOLDEN_TOL * max(1.0, abs(ref_loss))


@settings(max_examples=6)
@given(seqs=sequence_batches(alphabet=4, max_sequences=6, max_len=10), arch=st.sampled_from(ARCHS),
       setting=st.sampled_from(sorted(SETTINGS)))
def test_float64_random_forests(seqs, arch, setting):
    """Random forests with many shared prefixes (4-token alphabet): duplicates, prefixes
    of others, same-token siblings, one-token sequences."""
    if all(len(s) < 2 for s in seqs):
        seqs = seqs + [[1, 2, 3]]
    err, _, _ = golden_check(make_golden_model(arch), seqs, SETTINGS[setting])
    assert err < GOLDEN_TOL, f"{arch} {setting} {seqs}: {err:.2e}"


@pytest.mark.slow
@settings(max_examples=60)
@given(seqs=sequence_batches(alphabet=5, max_sequences=7, max_len=14), arch=st.sampled_from(ARCHS),
       setting=st.sampled_from(sorted(SETTINGS)), tied=st.booleans())
def test_float64_random_forests_sweep(seqs, arch, setting, tied):
    if all(len(s) < 2 for s in seqs):
        seqs = seqs + [[1, 2, 3]]
    err, _, _ = golden_check(make_golden_model(arch, tied=tied), seqs, SETTINGS[setting])
    assert err < GOLDEN_TOL, f"{arch} {setting} tied={tied} {seqs}: {err:.2e}"


def test_stack_gradient_slots_follow_the_model_dtype():
    """Gradient slots in float64 for a float64 model, float32 otherwise."""
    forest = dtree.Forest.from_sequences([[1, 2, 3], [1, 2, 4]])
    for dtype, want in ((torch.float64, torch.float64), (torch.float32, torch.float32)):
        rt = dtree.TreeRuntime(make_model("llama", dtype=dtype), mode="retain")
        rt.forward_backward(forest, dtree.losses.nll())
        (kv,) = rt.stack.kv  # one KV stack: every layer has one K/V shape
        assert kv.grad_k.dtype == kv.grad_v.dtype == want


def test_fields_keep_their_precision():
    """Tensor fields are stored at their own precision: float64 bit for bit, float32 and
    bfloat16 widened exactly (from_sequences, with_fields, from_padded)."""
    x64 = torch.tensor([0.1, 0.2, 1 / 3], dtype=torch.float64)
    f = dtree.Forest.from_sequences([[1, 2, 3]], a=[x64], b=x64[:1], c=[x64.float()], d=[x64.bfloat16()])
    assert f.fields["a"].tolist() == x64.tolist() and f.fields["a"][0] == 0.1
    assert f.fields["b"].tolist() == [0.1] * 3
    assert f.fields["c"].tolist() == x64.float().double().tolist()
    assert f.fields["d"].tolist() == x64.bfloat16().double().tolist()
    g = f.with_fields(e=[x64[1:]])  # prediction-aligned
    assert g.fields["e"].tolist() == [0.0, 0.2, 1 / 3]
    a = torch.tensor([[9.0, 0.1, 0.2, 1 / 3]], dtype=torch.float64)
    p = dtree.Forest.from_padded(torch.tensor([[5, 1, 2, 3]]), torch.tensor([[0, 1, 1, 1]]), a=a)
    assert p.fields["a"].tolist() == [0.1, 0.2, 1 / 3]


def test_logprob_round_trip_is_exact_in_float64():
    """``with_fields(old_logprobs=rt.logprobs(f))`` on a float64 model keeps every bit,
    so a PPO step right after is exactly on-policy (ratio 1: the surrogate's loss is
    -mean advantage to the last bit, and nothing clips)."""
    model = make_golden_model("qwen2")
    seqs = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 10, 11]]
    rt = dtree.TreeRuntime(model)
    forest = dtree.Forest.from_sequences(seqs, advantages=[0.5, -1.0, 0.25])
    lps = rt.logprobs(forest)
    assert all(lp.dtype == torch.float64 for lp in lps)
    forest = forest.with_fields(old_logprobs=lps)
    for s, lp in enumerate(lps):
        assert np.array_equal(forest.field("old_logprobs", s)[1:], lp.numpy())
    out = rt.forward_backward(forest, dtree.losses.ppo_clip(reduction="sum"))
    assert out.metrics["clip_ratio/region_mean"] == 0.0
    assert out.loss == pytest.approx(-(0.5 * 3 - 1.0 * 2 + 0.25 * 4), abs=1e-14)
