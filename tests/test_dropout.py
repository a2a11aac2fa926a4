"""Dropout (LoRA's, on the LM head's adapter too, and residual dropout in a custom
module) is replayed exactly: under the same seed, retain, recompute and auto give the
same gradients, and the two-pass path the same as the one-pass one. Per-path HF cannot
be the reference with dropout on (a shared token draws one mask in a tree, one per
path when linearized), so these modes are compared with each other; in eval mode the
same models are exact against HF per path. Attention dropout is refused in train mode."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from hf_models import make_model
from nanogpt import NanoGPT
from reference import grad_errors
from setups import GROUP_TOKENS, MODES, SEQS, assert_exact, reference, run_dtree

import dtree

peft = pytest.importorskip("peft")

NANO_SEQS = [[s % 61 for s in seq] for seq in SEQS]


def lora_with_dropout(p: float = 0.3):
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=p, init_lora_weights=False, target_modules=["q_proj", "v_proj", "o_proj", "lm_head"]
    )
    return peft.get_peft_model(make_model("qwen2"), config).train()


def nano_with_dropout(p: float = 0.2):
    torch.manual_seed(0)
    return NanoGPT(dropout=p).train()


MODELS = {"lora": (lora_with_dropout, SEQS), "residual": (nano_with_dropout, NANO_SEQS)}


def step(model, seqs, seed: int, mode: str, group_tokens, loss=None):
    """A step of a fresh copy of ``model`` under ``torch.manual_seed(seed)``. ``auto``
    gets a tiny retain budget, so it mixes retained and recomputed groups."""
    tree_model = copy.deepcopy(model)
    budget = 6 if mode == "auto" else None
    torch.manual_seed(seed)
    rt = dtree.TreeRuntime(tree_model, mode=mode, group_tokens=group_tokens, chunk_size=3, retain_budget_tokens=budget)
    out = rt.forward_backward(dtree.Forest.from_sequences(seqs), loss or dtree.losses.nll())
    return out, tree_model


def max_error(a, b) -> float:
    return max(grad_errors(a, b).values())


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_modes_agree_under_the_same_seed(kind, group_tokens):
    make, seqs = MODELS[kind]
    model = make()
    outs = {mode: step(model, seqs, 11, mode, group_tokens) for mode in MODES}
    if group_tokens is not None:  # several calls: groups were recomputed
        assert outs["recompute"][0].metrics["recomputed_tokens"] > 0
        assert 0 < outs["auto"][0].metrics["recomputed_tokens"] < outs["recompute"][0].metrics["recomputed_tokens"]
    for mode in ("recompute", "auto"):
        assert max_error(outs[mode][1], outs["retain"][1]) < 1e-5, mode
        assert abs(outs[mode][0].loss - outs["retain"][0].loss) < 1e-5
    if group_tokens == 0:  # the masks matter: another seed gives other gradients
        other = step(model, seqs, 12, "retain", group_tokens)[1]
        assert max_error(other, outs["retain"][1]) > 1e-2


def test_without_replay_recompute_would_differ(monkeypatch):
    """What the replay prevents (the issue's 116%): recomputed groups drawing fresh masks."""
    model = lora_with_dropout()
    retain = step(model, SEQS, 11, "retain", 0)[1]
    monkeypatch.setattr(dtree.device.rng, "seeded", lambda seed, device: contextlib.nullcontext())
    recompute = step(model, SEQS, 11, "recompute", 0)[1]
    assert max_error(recompute, retain) > 1e-2


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_two_pass_replays_the_first_pass(kind):
    """The two-pass path's backward draws the masks its log-probs were computed with:
    a per-token loss written as a sequence-level callable gives the one-pass gradient."""
    make, seqs = MODELS[kind]
    model = make()
    n = sum(len(s) - 1 for s in seqs)
    one, m1 = step(model, seqs, 5, "recompute", 8)
    two, m2 = step(model, seqs, 5, "recompute", 8, loss=lambda lps, f: -sum(lp.sum() for lp in lps) / n)
    assert max_error(m2, m1) < 1e-5
    assert abs(one.loss - two.loss) < 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_eval_mode_is_exact_per_path(kind, mode):
    """model.eval() turns dropout off: HF per path is the reference again."""
    make, seqs = MODELS[kind]
    model = make().eval()
    if kind == "residual":  # NanoGPT's reference is its own forward (tests/nanogpt.py)
        ref_model = copy.deepcopy(model)
        for s in seqs:
            x = torch.tensor(s)
            lp = torch.log_softmax(ref_model(x)[:-1], -1).gather(-1, x[1:, None]).squeeze(-1)
            (-lp.sum() / sum(len(q) - 1 for q in seqs)).backward()
        out, tree_model = run_dtree(model, seqs, mode=mode, group_tokens=8)
        assert_exact(tree_model, ref_model)
        return
    ref_model, ref_loss = reference(model, seqs)
    out, tree_model = run_dtree(model, seqs, mode=mode, group_tokens=8)
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_attention_dropout_refused_in_train_mode():
    torch.manual_seed(0)
    from hf_models import make_config
    from transformers import AutoModelForCausalLM

    config = make_config("llama")
    config.attention_dropout = 0.1
    model = AutoModelForCausalLM.from_config(config).train()
    rt = dtree.TreeRuntime(model, chunk_size=3)
    forest = dtree.Forest.from_sequences(SEQS)
    for call in (lambda: rt.forward_backward(forest, dtree.losses.nll()), lambda: rt.logprobs(forest)):
        with pytest.raises(ValueError, match=r"attention_dropout=0.1.*model.eval\(\)"):
            call()
    assert all(p.grad is None for p in model.parameters())
    model.eval()  # HF turns attention dropout off in eval mode: exact again
    ref_model, ref_loss = reference(model)
    assert_exact(model, ref_model, rt.forward_backward(forest, dtree.losses.nll()), ref_loss)
