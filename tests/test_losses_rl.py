"""The RL loss variants (dtree.losses.policy_losses, dtree.losses.sequence_loss) against HF run per
path with the losses and aggregations written the way TRL writes them and verl's
aggregations through verl's own agg_loss (tests/rl_reference.py): every parameter's
gradient, on CPU in float32. verl's whole actor loss: tests/test_losses_verl.py.

The forest is a GRPO group with a deeper multi-turn branch, a duplicate, a sequence
whose completion is fully masked (counted by TRL's ``grpo`` and verl's trainer, left
out by verl's ``agg_loss`` called alone), and a second tree."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_models import make_model
from reference import grad_errors, path_logprobs
from rl_reference import aggregate, batch_tensors, loss_matrix, reference_step
from test_runtime_exact import FP32_TOL, assert_exact

import dtree
from dtree.baselines import LinearizedTrainer
from dtree.losses import (
    Normalization,
    TokenLoss,
    add_metric_sums,
    aggregation,
    cispo,
    gspo,
    kl_penalty,
    masked_metric_sums,
    metric_means,
    ppo_clip,
    sapo,
)

PROMPT = [3, 17, 42, 8]
SEQS = [
    PROMPT + [5, 9, 11],
    PROMPT + [5, 9, 23, 7, 1],
    PROMPT + [6, 2],
    PROMPT + [5, 9, 11],  # a duplicate, with its own advantage
    PROMPT + [6],
    PROMPT + [5, 9, 23, 7, 1, 30, 31, 2],  # a second turn after a tool token (30, masked)
    PROMPT + [40, 41],  # completion fully masked (TRL's mask_truncated_completions)
    [60, 61, 62],  # another tree
]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2, 0.3, 1.5, 0.9, -0.8]  # one per sequence (broadcast)
MAX_COMPLETION = 16


def _loss_mask():
    masks = []
    for s in SEQS:
        m = [0.0] * len(PROMPT) + [1.0] * (len(s) - len(PROMPT)) if s[: len(PROMPT)] == PROMPT else [0.0] + [1.0] * (len(s) - 1)
        masks.append(m)
    masks[5][len(PROMPT) + 5] = 0.0  # the tool token
    masks[6] = [0.0] * len(SEQS[6])
    return masks


def make_fields(seed: int = 0, per_token_advantages: bool = False) -> dict:
    g = np.random.default_rng(seed)
    fields = {
        "loss_mask": _loss_mask(),
        "advantages": [g.uniform(-2, 2, len(s)).tolist() for s in SEQS] if per_token_advantages else ADVANTAGES,
        "old_logprobs": [g.uniform(-5.6, -3.6, len(s)).tolist() for s in SEQS],
        "ref_logprobs": [g.uniform(-5.6, -3.6, len(s)).tolist() for s in SEQS],
    }
    return fields


def reference_fields(fields: dict) -> dict:
    """The fields as per-token lists (the reference reads no dtree broadcast)."""
    out = dict(fields)
    if not isinstance(fields["advantages"][0], list):
        out["advantages"] = [[a] * len(s) for a, s in zip(fields["advantages"], SEQS)]
    return out


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2", tied=True)


def run_case(model, loss, variant, agg, constant=None, fields=None, rt_kw=None, **kw):
    fields = fields or make_fields()
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    out = dtree.TreeRuntime(tree_model, **(rt_kw or {})).forward_backward(forest, loss)
    ref = reference_step(ref_model, SEQS, reference_fields(fields), variant, agg, constant, **kw)
    assert_exact(out, ref, grad_errors(tree_model, ref_model))
    return out


AGGREGATIONS = [
    ("grpo", None),
    ("bnpo", None),
    ("dr_grpo", MAX_COMPLETION),
    ("dapo", None),
    ("luspo", None),
    ("token-mean", None),
    ("token-sum", None),
    ("seq-mean-token-mean", None),
    ("seq-mean-token-sum", None),
    ("seq-mean-token-sum-norm", MAX_COMPLETION),
]


@pytest.mark.parametrize("agg,constant", AGGREGATIONS)
def test_clip_higher_under_every_aggregation(model, agg, constant):
    loss = ppo_clip(epsilon_low=0.2, epsilon_high=0.28, **aggregation(agg, max_completion_length=constant))
    run_case(model, loss, "ppo", agg, constant, eps_low=0.2, eps_high=0.28)


def test_empty_sequences_counted_as_verls_trainer_counts_them(model):
    """verl's trainer divides the sequence modes by every row (global_batch_size), as
    TRL's grpo does; agg_loss alone leaves the row without a loss token out."""
    forest = dtree.Forest.from_sequences(SEQS, **make_fields())
    trl = ppo_clip(**aggregation("grpo")).weights(forest)
    verl = ppo_clip(**aggregation("seq-mean-token-mean")).weights(forest)
    alone = ppo_clip(**{**aggregation("seq-mean-token-mean"), "count_empty_sequences": False}).weights(forest)
    np.testing.assert_array_equal(trl, verl)
    assert np.allclose(verl * len(SEQS), alone * (len(SEQS) - 1))  # 8 sequences, one without a loss token


@pytest.mark.parametrize("delta", [1.25, 4.0])
def test_trl_delta(model, delta):
    run_case(model, ppo_clip(0.2, delta=delta, **aggregation("grpo")), "ppo", "grpo", delta=delta)


def test_delta_equals_dual_clip_above_the_clip():
    """TRL's delta and verl's clip_ratio_c are one loss when the cap is >= 1 + eps_high."""
    g = torch.Generator().manual_seed(0)
    logp = (torch.rand(400, generator=g) * 3 - 6).requires_grad_(True)
    f = {"advantages": torch.randn(400, generator=g), "old_logprobs": torch.rand(400, generator=g) * 3 - 6}
    a = ppo_clip(0.2, delta=1.5).per_token(logp, f)
    b = ppo_clip(0.2, clip_ratio_c=1.5).per_token(logp, f)
    torch.testing.assert_close(a, b)
    ga, = torch.autograd.grad(a.sum(), logp)
    gb, = torch.autograd.grad(b.sum(), logp)
    torch.testing.assert_close(ga, gb)
    c = ppo_clip(0.2, delta=1.1).per_token(logp, f)  # below 1 + eps_high: not the same loss
    d = ppo_clip(0.2, clip_ratio_c=1.1).per_token(logp, f)
    assert not torch.allclose(c, d)


def test_cispo_trl(model):
    run_case(model, cispo(ratio_max=1.1, **aggregation("cispo")), "cispo_trl", "cispo", eps_high=1.1)


def test_sapo(model):
    run_case(model, sapo(1.0, 1.05, **aggregation("sapo")), "sapo", "sapo", tau_pos=1.0, tau_neg=1.05)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+"])
def test_kl_estimators(model, estimator):
    loss = ppo_clip(0.2, kl_coef=0.05, kl_estimator=estimator, **aggregation("bnpo"))
    run_case(model, loss, "ppo", "bnpo", beta=0.05, kl=estimator)


def test_trl_kl_bias_correction_with_per_token_advantages(model):
    fields = make_fields(seed=3, per_token_advantages=True)
    loss = ppo_clip(0.2, epsilon_high=0.28, kl_coef=0.04, kl_bias_correction=True, **aggregation("dapo"))
    run_case(model, loss, "ppo", "dapo", fields=fields, eps_high=0.28, beta=0.04, bias_correction=True)


def test_kl_estimator_values_and_straight_through():
    lp = torch.linspace(-6, -1, 50, dtype=torch.float64).requires_grad_(True)
    ref = torch.linspace(-2, -5, 50, dtype=torch.float64)
    d = ref - lp
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert torch.all(kl_penalty(lp, ref, "k3") >= 0)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d.square())
    big = kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert float(big) == 10.0  # verl clamps ref - logp to 20 and the estimate to 10
    torch.testing.assert_close(kl_penalty(lp, ref, "k2+"), kl_penalty(lp, ref, "k2"))  # verl accepts it
    for name in ("k1+", "k2+", "k3+", "low_var_kl+", "abs+"):
        value = kl_penalty(lp, ref, name)
        torch.testing.assert_close(value, kl_penalty(lp, ref, name[:-1]))
        g, = torch.autograd.grad(value.sum(), lp)
        torch.testing.assert_close(g, lp.detach() - ref)  # k2's gradient
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k4")


# ---------------------------------------------------------------------- GSPO (two-pass)
@pytest.mark.parametrize(
    "agg,kw",
    [
        ("grpo", dict(count_empty_sequences=True)),
        ("dapo", dict()),
        ("seq-mean-token-mean", dict(log_ratio_max=10.0)),
    ],
)
def test_gspo_two_pass(model, agg, kw):
    red = {**aggregation(agg), **kw}
    loss = gspo(0.2, epsilon_high=0.28, **red)
    run_case(model, loss, "gspo", agg, eps_low=0.2, eps_high=0.28)


def test_gspo_with_kl_bias_correction(model):
    loss = gspo(0.2, kl_coef=0.05, kl_bias_correction=True, count_empty_sequences=True)
    run_case(model, loss, "gspo", "grpo", beta=0.05, bias_correction=True)


def test_gspo_takes_token_aligned_logprobs_and_checks_temperature(model):
    forest = dtree.Forest.from_sequences(SEQS, **make_fields())
    lps = dtree.TreeRuntime(copy.deepcopy(model)).logprobs(forest)
    loss = gspo(0.2, count_empty_sequences=True)
    token_aligned = [torch.cat([lp.new_zeros(1), lp]) for lp in lps]
    torch.testing.assert_close(loss(lps, forest), loss(token_aligned, forest))
    with pytest.raises(ValueError, match="temperature 0.7"):
        gspo(temperature=0.7)(lps, forest)
    with pytest.raises(ValueError, match=r"log-probs of sequence 2 have shape \(4,\); expected \[5\] or \[6\]"):
        loss([*lps[:2], lps[2][:-1], *lps[3:]], forest)
    with pytest.raises(ValueError, match="ref_logprobs"):
        gspo(kl_coef=0.1)(lps, dtree.Forest.from_sequences(SEQS, advantages=ADVANTAGES, old_logprobs=make_fields()["old_logprobs"]))


def test_gspo_metrics_match_trl_sequence_level(model):
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    lps = dtree.TreeRuntime(copy.deepcopy(model)).logprobs(forest)
    got = gspo(0.02, kl_coef=0.1, count_empty_sequences=True).metric_values(lps, forest)
    with torch.no_grad():
        t = batch_tensors(model, SEQS, reference_fields(fields))
        mask = t["mask"]
        coef = torch.exp(((t["lp"] - t["old"]) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
        adv = torch.tensor(ADVANTAGES)
        low = ((coef < 0.98) & (adv < 0)).float().mean()
        high = ((coef > 1.02) & (adv > 0)).float().mean()
        kl = torch.exp(t["ref"] - t["lp"]) - (t["ref"] - t["lp"]) - 1
    assert got["clip_ratio/low_mean"] == pytest.approx(float(low), abs=1e-6)
    assert got["clip_ratio/high_mean"] == pytest.approx(float(high), abs=1e-6)
    assert got["clip_ratio/region_mean"] == pytest.approx(float(low + high), abs=1e-6)
    assert got["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), rel=1e-5)
    assert 0 < low + high < 1  # the data clips some sequences and not others


# ---------------------------------------------------------------------- gradient accumulation
@pytest.mark.parametrize(
    "loss",
    [
        ppo_clip(0.2, **aggregation("dapo")),
        ppo_clip(0.2, **aggregation("grpo")),
        ppo_clip(0.2, reduction="sequence_mean"),
        ppo_clip(0.2, **aggregation("dr_grpo", max_completion_length=MAX_COMPLETION)),
        gspo(0.2, count_empty_sequences=True),
    ],
    ids=["dapo", "grpo", "sequence_mean", "dr_grpo", "gspo"],
)
def test_micro_batches_with_global_normalization_equal_one_step(model, loss):
    forest = dtree.Forest.from_sequences(SEQS, **make_fields())
    parts = [forest.subset([0, 2, 5, 6]), forest.subset([1, 3, 4, 7])]
    whole_model, acc_model = copy.deepcopy(model), copy.deepcopy(model)
    whole = dtree.TreeRuntime(whole_model).forward_backward(forest, loss)
    norm = Normalization.from_forests(parts, loss)
    assert norm == dtree.losses.local_normalization(forest)
    rt = dtree.TreeRuntime(acc_model)
    total = 0.0
    for part in parts:
        if isinstance(loss, TokenLoss):
            total += rt.forward_backward(part, loss, normalization=norm).loss
        else:
            total += rt.forward_backward(part, loss.with_normalization(norm)).loss
    errs = grad_errors(acc_model, whole_model)
    assert max(errs.values()) < FP32_TOL, errs
    assert total == pytest.approx(whole.loss, rel=1e-5)


def test_bnpo_accumulates_local_means(model):
    """TRL's bnpo divides each micro-batch by its own token count and by the number of
    accumulation steps: the local Normalization with scale 1/steps."""
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    ids = [[0, 2, 5, 6], [1, 3, 4, 7]]
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    rt = dtree.TreeRuntime(tree_model)
    for part in ids:
        rt.forward_backward(forest.subset(part), ppo_clip(0.2, **aggregation("bnpo"), scale=0.5))
    ref_fields = reference_fields(fields)
    for part in ids:
        t = batch_tensors(ref_model, [SEQS[i] for i in part], {k: [v[i] for i in part] for k, v in ref_fields.items()})
        (aggregate(loss_matrix(t, "ppo"), t["mask"], "bnpo") / 2).backward()
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < FP32_TOL, errs


def test_normalization_counts_and_missing_num_sequences():
    forest = dtree.Forest.from_sequences(SEQS, **make_fields())
    norm = Normalization.from_forests([forest])
    assert (norm.loss_tokens, norm.loss_sequences, norm.num_sequences) == (23.0, 7.0, 8.0)
    assert Normalization.from_forests([forest], dtree.losses.nll()) == norm
    assert Normalization.from_forests([forest], TokenLoss(lambda lp, f: -lp, use_loss_mask=False)).loss_tokens == 47.0
    with pytest.raises(ValueError, match="num_sequences"):
        ppo_clip(count_empty_sequences=True, reduction="sequence_mean").weights(forest, Normalization(23.0, 7.0))
    assert dtree.Normalization is Normalization


# ---------------------------------------------------------------------- metrics
def reference_ppo_metrics(model, fields, eps_low, eps_high, temperature=None):
    with torch.no_grad():
        t = batch_tensors(model, SEQS, reference_fields(fields), temperature)
        r, adv, m = torch.exp(t["lp"] - t["old"]), t["adv"], t["mask"]
        low, high = ((r < 1 - eps_low) & (adv < 0)).float(), ((r > 1 + eps_high) & (adv > 0)).float()
        kl = torch.exp(t["ref"] - t["lp"]) - (t["ref"] - t["lp"]) - 1

        def mean(x):
            return float((x * m).sum() / m.sum())

        out = {
            "clip_ratio/low_mean": mean(low),
            "clip_ratio/high_mean": mean(high),
            "clip_ratio/region_mean": mean(torch.maximum(low, high)),
            "ratio/mean": mean(r),
            "kl": mean(kl),
        }
        if t["entropy"] is not None:
            out["entropy"] = mean(t["entropy"])
        return out


@pytest.mark.parametrize("budget", [16384, 5])
def test_baseline_reports_trl_metrics(model, budget):
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    loss = ppo_clip(0.1, epsilon_high=0.15, kl_coef=0.05)
    out = LinearizedTrainer(copy.deepcopy(model), max_tokens_per_batch=budget).forward_backward(forest, loss)
    want = reference_ppo_metrics(model, fields, 0.1, 0.15)
    for name, value in want.items():
        assert out.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert 0 < want["clip_ratio/low_mean"] and 0 < want["clip_ratio/high_mean"]


def test_metric_sums_add_up():
    v = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.0, 1.0, 1.0])}
    m = torch.tensor([1.0, 0.0, 1.0])
    s = add_metric_sums(masked_metric_sums(v, m), masked_metric_sums({"a": torch.tensor([5.0]), "b": torch.tensor([1.0])}, torch.tensor([2.0])))
    assert metric_means(s) == pytest.approx({"a": (1 + 3 + 10) / 4, "b": (1 + 2) / 4})
    assert metric_means({}) == {}
    assert np.isnan(metric_means(masked_metric_sums(v, torch.zeros(3)))["a"])


def test_cispo_and_sapo_metrics():
    g = torch.Generator().manual_seed(1)
    logp = torch.rand(200, generator=g) * 3 - 6
    f = {"advantages": torch.randn(200, generator=g), "old_logprobs": torch.rand(200, generator=g) * 3 - 6}
    r = torch.exp(logp - f["old_logprobs"])
    m = cispo(ratio_max=1.2, ratio_min=0.7).metrics(logp, f)
    torch.testing.assert_close(m["cispo_clip_ratio"], ((r > 1.2) & (f["advantages"] > 0)).float())
    torch.testing.assert_close(m["clip_ratio/low_mean"], (r < 0.7).float())
    torch.testing.assert_close(m["ratio/mean"], r)
    assert set(sapo().metrics(logp, f)) == {"ratio/mean"}


# ---------------------------------------------------------------------- entropy and temperature
def test_entropy_bonus_and_metric_at_the_loss_level():
    """The loss-level contract of the entropy bonus and metric (the runtime end to end:
    test_runtime_entropy_bonus_and_temperature)."""
    g = torch.Generator().manual_seed(2)
    logp = (torch.rand(64, generator=g) * 3 - 6).requires_grad_(True)
    ent = (torch.rand(64, generator=g) * 4).requires_grad_(True)
    f = {"advantages": torch.randn(64, generator=g), "old_logprobs": torch.rand(64, generator=g) * 3 - 6, "entropy": ent}
    with_bonus = ppo_clip(0.2, entropy_coef=0.01)
    assert with_bonus.needs_entropy and not ppo_clip(0.2).needs_entropy and ppo_clip(log_entropy=True).needs_entropy
    torch.testing.assert_close(with_bonus.per_token(logp, f), ppo_clip(0.2).per_token(logp, f) - 0.01 * ent)
    gl, = torch.autograd.grad(with_bonus.per_token(logp, f).sum(), ent)
    torch.testing.assert_close(gl, torch.full_like(ent, -0.01))
    torch.testing.assert_close(with_bonus.metrics(logp, f)["entropy"], ent.detach())
    for build in (cispo, sapo):
        loss = build(1.2, entropy_coef=0.5) if build is cispo else build(entropy_coef=0.5)
        torch.testing.assert_close(loss.per_token(logp, f), build(1.2).per_token(logp, f) - 0.5 * ent if build is cispo
                                   else build().per_token(logp, f) - 0.5 * ent)


@pytest.mark.parametrize(
    "loss,match",
    [(ppo_clip(entropy_coef=0.01), "entropy"), (ppo_clip(log_entropy=True), "entropy"), (ppo_clip(temperature=0.7), "temperature=0.7")],
)
def test_a_trainer_without_temperature_or_entropy_refuses_them(loss, match):
    """A third-party trainer that calls check_fields without the support flags gets the
    clear refusal instead of silently computing something else."""
    forest = dtree.Forest.from_sequences(SEQS, **make_fields())
    with pytest.raises(ValueError, match=match):
        loss.check_fields(forest)
    loss.check_fields(forest, supports_temperature=True, supports_entropy=True)  # dtree's runtime and baselines


def test_temperature_is_carried_by_every_loss():
    for loss in (dtree.losses.nll(temperature=0.6), ppo_clip(temperature=0.6), cispo(2.0, temperature=0.6),
                 sapo(temperature=0.6), gspo(temperature=0.6)):
        assert loss.temperature == 0.6
    with pytest.raises(ValueError, match="temperature"):
        ppo_clip(temperature=0.0)


# ---------------------------------------------------------------------- names and arguments
def test_aggregation_names():
    assert aggregation("grpo") == dict(reduction="sequence_mean", count_empty_sequences=True)
    assert aggregation("seq-mean-token-mean") == dict(reduction="sequence_mean", count_empty_sequences=True)
    assert aggregation("token-sum") == dict(reduction="sum")
    assert aggregation("seq-mean-token-sum-norm", loss_scale_factor=16) == dict(
        reduction="seq_mean_token_sum", count_empty_sequences=True, scale=1 / 16)
    assert aggregation("dr_grpo", max_completion_length=256)["scale"] == 1 / 256
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregation("seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="not both"):
        aggregation("dr_grpo", max_completion_length=8, loss_scale_factor=8)
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregation("dr_grpo")
    with pytest.raises(ValueError, match="unknown aggregation 'grpo2'"):
        aggregation("grpo2")
    with pytest.raises(ValueError, match=r"aggregation\('bnpo'"):
        ppo_clip(reduction="bnpo")


def test_clip_argument_names():
    logp = torch.tensor([-1.0, -1.0])
    f = {"advantages": torch.tensor([1.0, -1.0]), "old_logprobs": torch.tensor([-1.5, -0.5])}
    a = ppo_clip(0.2, clip_eps_high=0.28).per_token(logp, f)
    b = ppo_clip(epsilon_low=0.2, epsilon_high=0.28).per_token(logp, f)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, torch.tensor([-1.28, 0.8]))
    with pytest.raises(ValueError, match="not both"):
        ppo_clip(clip_eps_high=0.3, epsilon_high=0.3)
    for bad in (dict(delta=1.0), dict(clip_ratio_c=0.9), dict(epsilon_low=-0.1)):
        with pytest.raises(ValueError):
            ppo_clip(**bad)
    with pytest.raises(ValueError, match="ratio_min"):
        cispo(ratio_max=1.2, ratio_min=1.5)


def test_reference_path_logprobs_are_what_the_runtime_sees(model):
    """Sanity of the reference itself: its log-probs are the runtime's."""
    forest = dtree.Forest.from_sequences(SEQS)
    got = dtree.TreeRuntime(copy.deepcopy(model)).logprobs(forest)
    with torch.no_grad():
        for s, seq in enumerate(SEQS):
            torch.testing.assert_close(got[s], path_logprobs(model, seq), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- runtime: temperature, entropy, metrics
# Every mode and group budget (0: node by node, 5: small packed calls, None: the default)
# against HF per path at softmax(logits / T), with the entropy bonus's gradient.
MODES = ["auto", "retain", "recompute"]
BUDGETS = [0, 5, None]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group_tokens", BUDGETS)
def test_runtime_entropy_bonus_and_temperature(model, mode, group_tokens):
    loss = ppo_clip(0.2, entropy_coef=0.05, temperature=0.7, kl_coef=0.04, **aggregation("grpo"))
    run_case(model, loss, "ppo", "grpo", rt_kw=dict(mode=mode, group_tokens=group_tokens),
             temperature=0.7, entropy_coef=0.05, beta=0.04)


def test_runtime_entropy_bonus_at_temperature_one(model):
    loss = ppo_clip(0.2, entropy_coef=0.05, **aggregation("bnpo"))
    run_case(model, loss, "ppo", "bnpo", temperature=1.0, entropy_coef=0.05)


def test_runtime_temperature_without_entropy(model):
    loss = cispo(1.2, temperature=0.6, **aggregation("dapo"))
    assert not loss.needs_entropy
    run_case(model, loss, "cispo_trl", "dapo", temperature=0.6, eps_high=1.2)


@pytest.mark.parametrize("method", ["linearized", "tree-mask"])
def test_baselines_entropy_bonus_and_temperature(model, method):
    """The baselines (test references and benchmark rivals) compute the same loss."""
    from dtree.baselines import TreeMaskTrainer

    fields = make_fields()
    loss = ppo_clip(0.2, entropy_coef=0.05, temperature=0.7, **aggregation("grpo"))
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    trainer = LinearizedTrainer(tree_model, max_tokens_per_batch=12) if method == "linearized" else TreeMaskTrainer(tree_model)
    out = trainer.forward_backward(dtree.Forest.from_sequences(SEQS, **fields), loss)
    ref = reference_step(ref_model, SEQS, reference_fields(fields), "ppo", "grpo", temperature=0.7, entropy_coef=0.05)
    assert_exact(out, ref, grad_errors(tree_model, ref_model))


@pytest.mark.parametrize("mode,group_tokens", [("retain", 0), ("recompute", 5), ("auto", None)])
def test_runtime_reports_metrics(model, mode, group_tokens):
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    loss = ppo_clip(0.1, epsilon_high=0.15, kl_coef=0.05, log_entropy=True, temperature=0.8)
    out = dtree.TreeRuntime(copy.deepcopy(model), mode=mode, group_tokens=group_tokens).forward_backward(forest, loss)
    want = reference_ppo_metrics(model, fields, 0.1, 0.15, temperature=0.8)
    assert set(want) <= set(out.metrics)
    for name, value in want.items():
        assert out.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert 0 < want["clip_ratio/low_mean"] and 0 < want["clip_ratio/high_mean"]


def test_runtime_metrics_equal_the_baselines(model):
    forest = dtree.Forest.from_sequences(SEQS, **make_fields())
    for loss in (cispo(1.1, ratio_min=0.9, log_entropy=True), sapo(kl_coef=0.1), ppo_clip(0.2, clip_ratio_c=1.5)):
        tree = dtree.TreeRuntime(copy.deepcopy(model), group_tokens=5).forward_backward(forest, loss).metrics
        lin = LinearizedTrainer(copy.deepcopy(model)).forward_backward(forest, loss).metrics
        names = [k for k in lin if "/" in k or k in ("kl", "entropy", "cispo_clip_ratio")]
        assert names and all(tree[k] == pytest.approx(lin[k], rel=1e-5, abs=1e-7) for k in names), (names, tree, lin)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_runtime_logprobs_at_a_temperature(model, temperature):
    from rl_reference import path_logprobs_entropy

    forest = dtree.Forest.from_sequences(SEQS)
    rt = dtree.TreeRuntime(copy.deepcopy(model), group_tokens=5)
    got, ent = rt.logprobs_and_entropy(forest, temperature=temperature)
    alone_lp, alone_ent = rt.logprobs(forest, temperature=temperature), rt.entropy(forest, temperature=temperature)
    with torch.no_grad():
        for s, seq in enumerate(SEQS):
            lp, h = path_logprobs_entropy(model, seq, temperature)
            assert got[s].shape == ent[s].shape == (len(seq) - 1,)
            torch.testing.assert_close(got[s], lp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent[s], h, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(alone_lp[s], got[s], rtol=0, atol=0)
            torch.testing.assert_close(alone_ent[s], ent[s], rtol=0, atol=0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            rt.logprobs(forest, temperature=bad)


def test_logprob_round_trip_at_a_temperature(model):
    """old_logprobs from rt.logprobs at the sampling temperature: the ratio is 1, so the
    clipped loss is the plain policy gradient (no clip metric fires)."""
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    rt = dtree.TreeRuntime(copy.deepcopy(model))
    forest = forest.with_fields(old_logprobs=rt.logprobs(forest, temperature=0.7))
    out = rt.forward_backward(forest, ppo_clip(0.2, temperature=0.7))
    assert out.metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert out.metrics["clip_ratio/region_mean"] == 0.0


@pytest.mark.parametrize("two_pass", [False, True])
def test_return_logprobs(model, two_pass):
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    rt = dtree.TreeRuntime(copy.deepcopy(model), group_tokens=5)
    lp, ent = rt.logprobs_and_entropy(forest, temperature=0.7)
    loss = (gspo(0.2, temperature=0.7, log_entropy=True) if two_pass
            else ppo_clip(0.2, temperature=0.7, log_entropy=True))
    out = rt.forward_backward(forest, loss, return_logprobs=True)
    assert rt.forward_backward(forest, loss).logprobs is None  # only when asked
    for s in range(len(SEQS)):
        m = torch.tensor(fields["loss_mask"][s][1:]) != 0
        want_lp, want_ent = lp[s], ent[s]
        if not two_pass:  # one pass: the loss terms only; two passes: every prediction
            want_lp, want_ent = torch.where(m, lp[s], 0.0), torch.where(m, ent[s], 0.0)
        torch.testing.assert_close(out.logprobs[s], want_lp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.entropy[s], want_ent, rtol=1e-5, atol=1e-6)
    without = rt.forward_backward(forest, ppo_clip(0.2, temperature=0.7), return_logprobs=True)
    assert without.entropy is None and len(without.logprobs) == len(SEQS)


# ---------------------------------------------------------------------- runtime: two-pass path
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group_tokens", BUDGETS)
def test_gspo_two_pass_at_a_temperature(model, mode, group_tokens):
    loss = gspo(0.2, epsilon_high=0.28, kl_coef=0.05, kl_bias_correction=True, temperature=0.7,
                count_empty_sequences=True)
    run_case(model, loss, "gspo", "grpo", rt_kw=dict(mode=mode, group_tokens=group_tokens),
             temperature=0.7, eps_low=0.2, eps_high=0.28, beta=0.05, bias_correction=True)


def test_gspo_two_pass_reports_its_metrics(model):
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    loss = gspo(0.02, kl_coef=0.1, count_empty_sequences=True, temperature=0.7, log_entropy=True)
    out = dtree.TreeRuntime(copy.deepcopy(model)).forward_backward(forest, loss)
    lps, ents = dtree.TreeRuntime(copy.deepcopy(model)).logprobs_and_entropy(forest, temperature=0.7)
    want = loss.metric_values(lps, forest, entropy=ents)
    assert set(want) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio/mean", "kl",
                         "entropy"}
    for name, value in want.items():
        assert out.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    with torch.no_grad():
        t = batch_tensors(model, SEQS, reference_fields(fields), temperature=0.7)
    assert want["entropy"] == pytest.approx(float((t["entropy"] * t["mask"]).sum() / t["mask"].sum()), rel=1e-5)
    with pytest.raises(ValueError, match="entropy"):
        loss(lps, forest, temperature=0.7)  # the loss reads the entropy: the caller must pass it


def test_two_pass_normalization_is_honoured_or_refused(model):
    fields = make_fields()
    forest = dtree.Forest.from_sequences(SEQS, **fields)
    norm = Normalization(50.0, 10.0, 12.0)
    loss = gspo(0.2, count_empty_sequences=True)
    a_model, b_model = copy.deepcopy(model), copy.deepcopy(model)
    a = dtree.TreeRuntime(a_model).forward_backward(forest, loss, normalization=norm)
    b = dtree.TreeRuntime(b_model).forward_backward(forest, loss.with_normalization(norm))
    assert a.loss == b.loss
    assert max(grad_errors(a_model, b_model).values()) == 0.0
    assert a.loss != pytest.approx(dtree.TreeRuntime(copy.deepcopy(model)).forward_backward(forest, loss).loss)
    m = copy.deepcopy(model)
    rt = dtree.TreeRuntime(m)
    with pytest.raises(ValueError, match="pass one of them"):
        rt.forward_backward(forest, loss.with_normalization(Normalization(1.0, 1.0, 1.0)), normalization=norm)
    with pytest.raises(ValueError, match="plain two-pass callable"):
        rt.forward_backward(forest, lambda lps, f: sum(lp.sum() for lp in lps), normalization=norm)
    with pytest.raises(ValueError, match="ref_logprobs"):  # fields checked before any compute
        rt.forward_backward(dtree.Forest.from_sequences(SEQS, advantages=ADVANTAGES, old_logprobs=fields["old_logprobs"]),
                            gspo(kl_coef=0.1))
    assert all(p.grad is None for p in m.parameters())


def test_backward_from_logprob_grads_at_a_temperature(model):
    """The second pass alone, seeded with d loss / d logp at T, equals HF per path."""
    from rl_reference import path_logprobs_entropy

    g = torch.Generator().manual_seed(5)
    seeds = [torch.randn(len(s) - 1, generator=g) for s in SEQS]
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    forest = dtree.Forest.from_sequences(SEQS)
    dtree.TreeRuntime(tree_model, group_tokens=5).backward_from_logprob_grads(forest, seeds, temperature=0.6)
    sum((path_logprobs_entropy(ref_model, seq, 0.6)[0] * w).sum() for seq, w in zip(SEQS, seeds)).backward()
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < FP32_TOL, errs
