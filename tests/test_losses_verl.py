"""dtree's verl names (dtree.integrations.verl_losses, dtree.losses.aggregation) against
verl 0.9.1's own actor loss (tests/verl_reference.py: ``ppo_loss`` and ``core_algos``
imported when verl is installed, else their written copy), run on HF log-probs per row
of a padded batch with shared prefixes: every parameter's gradient, CPU, float32.

The batch (tests/test_losses_rl.py's): a GRPO group with a duplicate, a sequence that is
a prefix of another, a multi-turn row with a masked tool token, a row whose response is
fully masked (what tells verl's trainer counts from agg_loss's own), and a second tree."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hf_models import make_model
from reference import grad_errors
from rl_reference import path_logprobs_entropy
from test_losses_rl import PROMPT, SEQS, make_fields
from test_runtime_exact import FP32_TOL, assert_exact
from verl_reference import (
    HAVE_VERL,
    VerlSettings,
    response_batch,
    verl_loss,
    written_agg_loss,
    written_kl_penalty,
)

import dtree
from dtree.baselines import LinearizedTrainer
from dtree.integrations.verl_losses import verl_actor_loss, verl_kl_estimator
from dtree.losses import LossPart, TokenLoss, aggregation, sapo

PROMPT_LENS = [len(PROMPT) if s[: len(PROMPT)] == PROMPT else 1 for s in SEQS]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KL_TYPES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k2+", "k3+", "low_var_kl+", "abs+", "mse+"]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2", tied=True)


def per_token_fields(seed: int = 0, per_token_advantages: bool = False) -> dict:
    fields = make_fields(seed, per_token_advantages)
    if not per_token_advantages:
        fields["advantages"] = [[a] * len(s) for a, s in zip(fields["advantages"], SEQS)]
    return fields


def reference(model, st: VerlSettings, fields, rows=None, **counts) -> float:
    """verl's loss on HF log-probs of ``rows`` (default: all), gradient into ``model``."""
    rows = list(range(len(SEQS))) if rows is None else rows
    seqs = [SEQS[i] for i in rows]
    sub = {k: [v[i] for i in rows] for k, v in fields.items()}
    batch = response_batch(seqs, [PROMPT_LENS[i] for i in rows], sub)
    lps, ents = zip(*(path_logprobs_entropy(model, s, TEMPERATURE) for s in seqs))
    loss = verl_loss(st, batch, list(lps), list(ents) if st.entropy_coeff else None, **counts)
    loss.backward()
    return float(loss.detach())


def dtree_step(model, st: VerlSettings, fields, rows=None, *, width=None, **counts):
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    if rows is not None:
        forest = forest.subset(rows)
    loss, norm = verl_actor_loss(
        st.config(forest.num_sequences), forest, with_entropy=bool(st.entropy_coeff), temperature=TEMPERATURE,
        response_width=width or max(len(s) - p for s, p in zip(SEQS, PROMPT_LENS)),
        global_batch_size=counts.get("global_batch_size", forest.num_sequences),
        batch_num_tokens=counts.get("batch_num_tokens"),
    )
    return dtree.TreeRuntime(model, group_tokens=5).forward_backward(forest, loss, normalization=norm)


def check(model, st: VerlSettings, fields=None, **counts):
    fields = fields or per_token_fields()
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    out = dtree_step(tree_model, st, fields, **counts)
    ref = reference(ref_model, st, fields, **counts)
    assert_exact(out, ref, grad_errors(tree_model, ref_model))
    return out


@pytest.mark.parametrize("agg", AGG_MODES)
def test_vanilla_under_every_loss_agg_mode(model, agg):
    check(model, VerlSettings(loss_agg_mode=agg, clip_ratio_c=1.5))


@pytest.mark.parametrize("c", [1.1, 1.3, 3.0])
def test_dual_clip(model, c):
    check(model, VerlSettings(clip_ratio_c=c))


@pytest.mark.parametrize("low,high", [(0.2, 0.28), (0.05, 0.05), (0.6, 2.0)])
def test_cispo_bounds(model, low, high):
    check(model, VerlSettings(loss_mode="cispo", clip_ratio_low=low, clip_ratio_high=high))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", ["vanilla", "cispo", "sapo", "gspo"])
def test_policy_losses_with_kl_and_entropy(model, mode, agg):
    st = VerlSettings(loss_mode=mode, loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.05,
                      entropy_coeff=0.0 if mode == "gspo" else 0.01)
    check(model, st)


def test_seq_mean_token_sum_norm_with_loss_scale_factor(model):
    check(model, VerlSettings(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16, use_kl_loss=True))


@pytest.mark.parametrize("kl", KL_TYPES)
def test_every_kl_type(model, kl):
    check(model, VerlSettings(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kl))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_with_per_token_advantages_is_verls_token_level_form(model, agg):
    check(model, VerlSettings(loss_mode="gspo", loss_agg_mode=agg, clip_ratio_low=0.05, clip_ratio_high=0.08),
          fields=per_token_fields(seed=4, per_token_advantages=True))


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
def test_two_micro_batches_with_verls_global_counts(model, agg):
    """verl's trainer passes global_batch_size = every row of the mini-batch (the fully
    masked row included) and batch_num_tokens to each micro-batch's loss."""
    st = VerlSettings(loss_mode="sapo", loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.05)
    fields = per_token_fields()
    tokens = sum(sum(m[p:]) for m, p in zip(fields["loss_mask"], PROMPT_LENS))
    counts = dict(global_batch_size=len(SEQS), batch_num_tokens=tokens)
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    total_ref = 0.0
    for rows in ([0, 2, 5, 6], [1, 3, 4, 7]):
        dtree_step(tree_model, st, fields, rows, **counts)
        total_ref += reference(ref_model, st, fields, rows, **counts)
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < 1e-5, errs


def test_loss_parts_run_in_one_pass_in_every_method(model):
    """A loss whose KL and entropy have their own reduction (verl's SAPO): the runtime in
    every mode and the baselines give the same gradient, from one forward_backward."""
    from dtree.baselines import TreeMaskTrainer

    loss = sapo(1.0, 1.05, **aggregation("seq-mean-token-mean"), kl_coef=0.1, entropy_coef=0.05,
                regularizer_aggregation=aggregation("token-mean"))
    assert set(loss.parts) == {"regularizers"} and loss.parts["regularizers"].reduction == "token_mean"
    assert sapo(kl_coef=0.1).parts is None
    forest = dtree.Forest.from_sequences(SEQS, **per_token_fields())
    ref_model = copy.deepcopy(model)
    ref = LinearizedTrainer(ref_model).forward_backward(forest, loss)
    for make in (lambda m: dtree.TreeRuntime(m, mode="recompute", group_tokens=5), TreeMaskTrainer):
        m = copy.deepcopy(model)
        out = make(m).forward_backward(forest, loss)
        assert out.loss == pytest.approx(ref.loss, rel=1e-5)
        assert max(grad_errors(m, ref_model).values()) < FP32_TOL
    # the parts are the sum of their own reductions: the policy part alone plus the regularizers alone
    alone = [sapo(1.0, 1.05, **aggregation("seq-mean-token-mean")),
             TokenLoss(loss.parts["regularizers"].per_token, reduction="token_mean",
                                    required_fields=("old_logprobs", "ref_logprobs"), needs_entropy=True)]
    total = sum(LinearizedTrainer(copy.deepcopy(model)).forward_backward(forest, part).loss for part in alone)
    assert total == pytest.approx(ref.loss, rel=1e-5)
    with pytest.raises(TypeError, match="LossPart"):
        TokenLoss(lambda lp, f: lp, parts={"x": "token_mean"})
    with pytest.raises(ValueError, match="reduction must be"):
        LossPart(lambda lp, f: lp, reduction="token-mean")
    with pytest.raises(ValueError, match="regularizer_aggregation takes"):
        sapo(kl_coef=0.1, regularizer_aggregation={"reduction": "token_mean", "clip": 1})


def test_kl_type_names():
    assert verl_kl_estimator("k3") == "low_var_kl" and verl_kl_estimator("k3+") == "low_var_kl+"
    assert verl_kl_estimator("mse") == "k2" and verl_kl_estimator("kl") == "k1"
    with pytest.raises(ValueError, match="full"):
        verl_kl_estimator("full")
    with pytest.raises(ValueError, match="geo_mean"):
        verl_actor_loss(dataclasses.replace(VerlSettings(), loss_mode="geo_mean"),
                        dtree.Forest.from_sequences(SEQS, **per_token_fields()))


# ---------------------------------------------------------------------- the written copy against verl's code
@pytest.mark.skipif(not HAVE_VERL, reason="needs verl (pip install dtree[verl]): checks the written copy against it")
def test_written_copy_equals_verls_code():
    """The fallback reference of the main stage (no verl there) is verl's code: loss and
    gradients of every loss_mode x loss_agg_mode, local and global counts, every KL type."""
    from verl.trainer.ppo import core_algos

    g = torch.Generator().manual_seed(7)
    fields = per_token_fields(seed=2, per_token_advantages=True)
    batch = response_batch(SEQS, PROMPT_LENS, fields)
    lps = [(torch.rand(len(s) - 1, generator=g) * 3 - 6).requires_grad_(True) for s in SEQS]
    ents = [(torch.rand(len(s) - 1, generator=g) * 4).requires_grad_(True) for s in SEQS]
    for mode in ("vanilla", "cispo", "sapo", "gspo", "gpg"):
        for agg in AGG_MODES:
            st = VerlSettings(loss_mode=mode, loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.1,
                              kl_loss_type="k3+", entropy_coeff=0.02, clip_ratio_c=1.4)
            for kw in (dict(), dict(global_batch_size=12, batch_num_tokens=40.0, dp_size=2)):
                got = verl_loss(st, batch, lps, ents, written=True, **kw)
                want = verl_loss(st, batch, lps, ents, **kw)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{mode} {agg} {kw}")
                for a, b in zip(torch.autograd.grad(got, lps + ents), torch.autograd.grad(want, lps + ents)):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{mode} {agg} {kw}")
        mat, mask = torch.randn(5, 7, generator=g), (torch.rand(5, 7, generator=g) > 0.4).float()
        mask[2] = 0
        for agg in AGG_MODES:
            torch.testing.assert_close(written_agg_loss(mat, mask, agg), core_algos.agg_loss(mat, mask, agg))
    lp, ref = torch.linspace(-30, 2, 40), torch.linspace(-3, -1, 40)
    for kl in KL_TYPES:
        torch.testing.assert_close(written_kl_penalty(lp, ref, kl), core_algos.kl_penalty(lp, ref, kl))


def test_engine_without_verl_names_the_install_command(monkeypatch):
    """dtree.integrations.verl without verl: an ImportError naming the extra (the loss
    mapping above needs no verl)."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "verl", None)
    for name in [m for m in sys.modules if m.startswith(("verl.", "dtree.integrations.verl"))]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install 'dtree\[verl\]'"):
        importlib.import_module("dtree.integrations.verl")
