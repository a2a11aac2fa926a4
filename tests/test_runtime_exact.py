"""dtree's gradients, losses and log-probs equal linearized HF training on every path.

The reference (tests/reference.py) runs the same transformers model on each sequence
on its own; every parameter's gradient is compared (relative L2 error)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import ARCHS, make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from nanogpt import NanoGPT
from reference import grad_errors, linearized_step, path_logprobs
from strategies import batches_with_fields

import dtree

FP32_TOL = 1e-5


def run_both(model, seqs, fields=None, kind="nll", reduction="token_mean", rt_kw=None, loss_kw=None, compile=False):
    """(dtree output, reference loss, per-param errors); ``compile``: dtree's copy of the
    model gets ``dtree.compile_layers`` first."""
    loss_kw = loss_kw or {}
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    if compile:
        dtree.compile_layers(tree_model)
    forest = dtree.Forest.from_sequences(seqs, **(fields or {}))
    loss = dtree.losses.nll(reduction=reduction) if kind == "nll" else dtree.losses.ppo_clip(reduction=reduction, **loss_kw)
    out = dtree.TreeRuntime(tree_model, **(rt_kw or {})).forward_backward(forest, loss)
    ref_loss, _ = linearized_step(ref_model, seqs, fields, kind, reduction, **loss_kw)
    return out, ref_loss, grad_errors(tree_model, ref_model)


def assert_exact(out, ref_loss, errs, tol=FP32_TOL):
    worst = max(errs, key=errs.get)
    assert errs[worst] < tol, f"gradient of {worst} off by {errs[worst]:.2e} (all: {errs})"
    assert abs(out.loss - ref_loss) <= tol * max(1.0, abs(ref_loss)), (out.loss, ref_loss)


# --- docs/design.md section 1 edge cases, each on its own and all together
EDGE_CASES = {
    "duplicates": [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]],
    "prefix_of_another": [[5, 6, 7], [5, 6, 7, 8, 9, 10], [5, 6]],
    "branch_point_many_children": [[1, 2, 3, 10], [1, 2, 3, 11, 4], [1, 2, 3, 12], [1, 2, 3, 13, 4, 4]],
    "single_token_nodes": [[1, 2], [1, 3], [1, 2, 4], [1, 2, 5], [1, 3, 6, 7]],
    "one_sequence": [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]],
    "one_token_sequences": [[7], [7, 8, 9], [11]],
    "several_trees": [[1, 2, 3], [4, 5], [1, 2, 6], [4, 7, 8], [9]],
    "same_token_siblings_at_depth": [[1, 2, 2, 2], [1, 2, 3, 2, 2], [1, 3, 2, 2, 2]],
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_edge_cases_all_archs(arch, tied):
    model = make_model(arch, tied)
    seqs = [s for case in EDGE_CASES.values() for s in case]
    out, ref, errs = run_both(model, seqs, rt_kw=dict(group_tokens=0))
    assert_exact(out, ref, errs)


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
@pytest.mark.parametrize("mode", ["retain", "recompute"])
@pytest.mark.parametrize("attention", ["reference", "sdpa"])
def test_edge_cases(case, mode, attention):
    out, ref, errs = run_both(make_model("llama"), EDGE_CASES[case], rt_kw=dict(mode=mode, attention=attention, chunk_size=2))
    assert_exact(out, ref, errs)


def test_per_path_attributes_on_shared_tokens():
    """Sequences share tokens but keep their own advantages and masks (PPO)."""
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 5]]
    fields = {
        "advantages": [[0, 1.0, -0.5, 2.0, 1.0], [0, -1.0, 0.7, -2.0, 0.5], [0, 0.3, 0.3, 0.3, -3.0]],
        "old_logprobs": [[0, -4.5, -4.6, -4.4, -4.5], [0, -4.7, -4.5, -4.6, -4.4], [0, -4.1, -4.9, -4.5, -4.6]],
        "ref_logprobs": [[0, -4.6, -4.6, -4.5, -4.5], [0, -4.5, -4.5, -4.5, -4.4], [0, -4.2, -4.8, -4.5, -4.6]],
        "loss_mask": [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 0, 1]],
    }
    for reduction in dtree.losses.REDUCTIONS:
        out, ref, errs = run_both(
            make_model("qwen2", tied=True), seqs, fields, "ppo", reduction, loss_kw=dict(clip_eps=0.1, kl_coef=0.05)
        )
        assert_exact(out, ref, errs)


def check_random_forest(batch, data):
    seqs, fields = batch
    arch = data.draw(st.sampled_from(ARCHS), label="arch")
    kind = data.draw(st.sampled_from(["nll", "ppo"]), label="loss")
    reduction = data.draw(st.sampled_from(dtree.losses.REDUCTIONS), label="reduction")
    rt_kw = dict(
        mode=data.draw(st.sampled_from(["retain", "recompute", "auto"]), label="mode"),
        chunk_size=data.draw(st.sampled_from([1, 3, 64]), label="chunk"),
        group_tokens=data.draw(st.sampled_from([0, 5, 64]), label="group_tokens"),
    )
    loss_kw = dict(kl_coef=0.1) if kind == "ppo" else {}
    out, ref, errs = run_both(make_model(arch, tied=arch in ("qwen2", "qwen3")), seqs, fields, kind, reduction, rt_kw, loss_kw)
    assert_exact(out, ref, errs)


@given(batch=batches_with_fields(max_sequences=6, max_len=12, alphabet=5), data=st.data())
def test_random_forests(batch, data):
    """The seeded CI subset (tests/conftest.py sets the example count)."""
    check_random_forest(batch, data)


@pytest.mark.slow
@settings(max_examples=400, derandomize=False)
@given(batch=batches_with_fields(max_sequences=9, max_len=20, alphabet=4), data=st.data())
def test_random_forests_sweep(batch, data):
    """The long sweep: ``pytest -m slow``; larger forests, fresh examples each run."""
    check_random_forest(batch, data)


def test_logprobs_match_reference():
    model = make_model("qwen3")
    seqs = [s for case in EDGE_CASES.values() for s in case]
    rt, forest = dtree.TreeRuntime(model, chunk_size=3, group_tokens=7), dtree.Forest.from_sequences(seqs)
    got, ent = rt.logprobs_and_entropy(forest)
    for a, b in zip(got + ent, rt.logprobs(forest) + rt.entropy(forest)):  # the one-output calls agree
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        for s, lp, e in zip(seqs, got, ent):
            want = path_logprobs(model, s)
            assert lp.shape == want.shape and torch.allclose(lp, want, atol=1e-5, rtol=1e-5)
            logits = model(input_ids=torch.tensor([s])).logits[0, :-1].float()
            p = torch.log_softmax(logits, -1)
            assert torch.allclose(e, -(p.exp() * p).sum(-1), atol=1e-5)


def test_float64_model():
    """HF's RMSNorm computes in float32 even in a float64 model, so ~1e-7 is the floor."""
    model = make_model("llama", dtype=torch.float64)
    out, ref, errs = run_both(model, EDGE_CASES["branch_point_many_children"] + EDGE_CASES["prefix_of_another"])
    assert_exact(out, ref, errs, tol=1e-6)


def test_long_chain_deeper_than_recursion_limit():
    """A 2100-token path cut into 1-token chunks: a 2100-deep chain of model calls,
    walked without recursion, plus a branch at the very end."""
    torch.manual_seed(1)
    base = torch.randint(0, 97, (2100,)).tolist()
    seqs = [base, base[:-1] + [(base[-1] + 1) % 97]]
    model = make_model("llama", max_positions=4096)
    out, ref, errs = run_both(model, seqs, rt_kw=dict(chunk_size=1, group_tokens=0, mode="retain"))
    assert out.num_model_calls == 2101
    assert_exact(out, ref, errs, tol=5e-5)  # 2100 stacked sums in float32


def test_gradients_accumulate_into_existing_grad():
    model = make_model("llama")
    forest = dtree.Forest.from_sequences(EDGE_CASES["prefix_of_another"])
    rt = dtree.TreeRuntime(model)
    rt.forward_backward(forest, dtree.losses.nll())
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    rt.forward_backward(forest, dtree.losses.nll())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n])


def _per_path_nll_backward(model, seqs) -> float:
    """The reference for custom modules: each sequence alone through ``model(idx)``,
    summed NLL backpropagated; returns the summed loss."""
    total = 0.0
    for s in seqs:
        x = torch.tensor(s)
        lp = torch.log_softmax(model(x)[:-1], -1).gather(-1, x[1:, None]).squeeze(-1)
        (-lp.sum()).backward()
        total += -lp.sum().item()
    return total


def test_custom_module_protocol():
    torch.manual_seed(0)
    model = NanoGPT()
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7], [8, 9], [1, 2, 3, 4]]
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    out = dtree.TreeRuntime(tree_model, chunk_size=2).forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll("sum"))
    total = _per_path_nll_backward(ref_model, seqs)
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < FP32_TOL, errs
    assert abs(out.loss - total) < 1e-4


class TransformedHeadGPT(NanoGPT):
    """A custom module whose head is a module (a low-rank-adapted linear) and whose
    logits are scaled and soft-capped: the protocol's OutputHead."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Sequential(torch.nn.Linear(self.d, 5, bias=False), torch.nn.Linear(5, self.vocab))

    def forward(self, idx):
        logits = super().forward(idx) * 0.7
        return 3.0 * torch.tanh(logits / 3.0)

    def dtree_output_layer(self):
        return dtree.OutputHead(module=self.lm_head, logit_scale=0.7, final_softcap=3.0)


@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_custom_module_output_head(mode):
    torch.manual_seed(0)
    model = TransformedHeadGPT()
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7], [8, 9]]
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    forest = dtree.Forest.from_sequences(seqs)
    out = dtree.TreeRuntime(tree_model, mode=mode, chunk_size=2, group_tokens=0).forward_backward(forest, dtree.losses.nll("sum"))
    total = _per_path_nll_backward(ref_model, seqs)
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < FP32_TOL, errs
    assert abs(out.loss - total) < 1e-4


def test_two_pass_non_separable_loss():
    """A loss that is not a sum of per-token terms: squared mean log-prob per sequence."""
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]

    def loss_fn(lps, forest):
        return sum(lp.mean() ** 2 for lp in lps) / len(lps)

    model = make_model("mistral")
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    out = dtree.TreeRuntime(tree_model).forward_backward(dtree.Forest.from_sequences(seqs), loss_fn)
    ref = loss_fn([path_logprobs(ref_model, s) for s in seqs], None)
    ref.backward()
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < FP32_TOL, errs
    assert abs(out.loss - ref.item()) < 1e-5


@pytest.mark.parametrize("mode", ["retain", "recompute"])
@pytest.mark.parametrize("attention", ["reference", "sdpa"])
def test_subtrees_in_one_call(mode, attention):
    """Whole subtrees in one call: segments attend to in-call ancestors through the
    stack, and their gradients come back through it (chunks, branches, deep chains)."""
    seqs = [s for case in EDGE_CASES.values() for s in case]
    for budget in (6, 11, 1000):
        out, ref, errs = run_both(
            make_model("qwen3", tied=True), seqs, rt_kw=dict(mode=mode, attention=attention, chunk_size=3, group_tokens=budget)
        )
        assert_exact(out, ref, errs)
        if budget == 1000:
            assert out.num_model_calls == 1  # the whole forest, every tree, one call


def test_compiled_layers_are_exact():
    """torch.compile'd decoder layers (attention left eager between compiled graphs)."""
    out, ref, errs = run_both(
        make_model("qwen2", tied=True), EDGE_CASES["branch_point_many_children"], rt_kw=dict(chunk_size=3),
        compile=True,
    )
    assert_exact(out, ref, errs)


def test_auto_mode_retains_within_budget_and_recomputes_the_rest():
    """auto mode with a tiny retain budget: outer groups retained, deeper ones
    recomputed, leaf groups run once; gradients unchanged."""
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 10, 11], [1, 2, 3, 12, 13, 14, 15], [1, 2, 16]]
    rt_kw = dict(mode="auto", chunk_size=2, group_tokens=0, retain_budget_tokens=6)
    out, ref, errs = run_both(make_model("llama"), seqs, rt_kw=rt_kw)
    assert_exact(out, ref, errs)
    assert 0 < out.metrics["recomputed_tokens"] < out.num_unique_tokens
    assert out.peak_graph_tokens <= 6 + 2  # budget + one chunk being recomputed


def test_leaf_groups_run_once_in_recompute_mode():
    seqs = [[1, 2, 3, 4] + [10 + i] * 3 for i in range(4)]  # a prompt and 4 leaf answers
    forest = dtree.Forest.from_sequences(seqs)
    # budget 12: the 16-token tree does not fit one call, the 4 answers (12 tokens) do
    rt = dtree.TreeRuntime(make_model("llama"), mode="recompute", group_tokens=12)
    out = rt.forward_backward(forest, dtree.losses.nll())
    assert out.num_model_calls == 3  # prompt: push + recompute; the answers' group: once
    assert out.metrics["recomputed_tokens"] == 4
