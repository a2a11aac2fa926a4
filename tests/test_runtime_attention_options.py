"""Models whose attention needs options, end to end: dtree's gradients equal HF's
per-path training (eager attention, so HF applies its own window mask, softcap and
sinks) on every parameter.

* Mistral with a sliding window of 8 on paths 4x longer, every mode and grouping;
* Qwen2 whose layers alternate full and sliding attention (max_window_layers);
* Gemma2 with attention logit softcapping (and its alternating windows);
* GPT-OSS with attention sinks (a parameter: its gradient is compared too);
* DeepSeek-V3 (multi-head latent attention: keys 24 wide, values 16).

Each family first checks that the feature changes HF's own output on these inputs,
so a dtree that ignored it could not pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import VOCAB
from reference import grad_errors, linearized_step, path_logprobs
from transformers import AutoConfig, AutoModelForCausalLM

import dtree

FP32_TOL = 1e-5
WINDOW = 8

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


def family_model(name: str, seed: int = 0, **overrides):
    """A tiny random ``name`` model (float32, eager attention) with the feature of
    interest switched on; q/k projections scaled up where scores must be large enough
    for softcapping to bite."""
    config = AutoConfig.for_model(name, **{**SMALL, **FAMILIES[name], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or pname.endswith("sinks"):
                p.normal_(0, 0.5 if pname.endswith("sinks") else 0.02)
            if name == "gemma2" and (pname.endswith("q_proj.weight") or pname.endswith("k_proj.weight")):
                p.mul_(8)
    return model


FAMILIES = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, 1 sliding
    "gemma2": dict(attn_logit_softcapping=2.0, final_logit_softcapping=None, sliding_window=WINDOW,
                   query_pre_attn_scalar=12),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32,
                        n_group=1, topk_group=1, num_key_value_heads=4, head_dim=8),  # head_dim: the rope part
}


def long_forest(seed: int = 0) -> list[list[int]]:
    """Paths of 33-40 tokens (4-5x the window) sharing a 14-token prompt, with a
    nested branch and a path that is a prefix of another."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    prompt, mid = tokens(14), tokens(9)
    return [
        prompt + mid + tokens(17),
        prompt + mid + tokens(12),
        prompt + tokens(22),
        prompt + mid,
        prompt + mid + tokens(17)[:3] + tokens(10),
    ]


class Reference:
    """HF per-path training of a model on a forest, run once; ``check`` compares a
    dtree run on a fresh copy against it."""

    def __init__(self, model, seqs):
        self.model, self.seqs = model, seqs
        self.ref_model = copy.deepcopy(model)
        self.loss, _ = linearized_step(self.ref_model, seqs)

    def check(self, tol=FP32_TOL, **rt_kw):
        tree_model = copy.deepcopy(self.model)
        out = dtree.TreeRuntime(tree_model, **rt_kw).forward_backward(dtree.Forest.from_sequences(self.seqs), dtree.losses.nll())
        errs = grad_errors(tree_model, self.ref_model)
        worst = max(errs, key=errs.get)
        assert errs[worst] < tol, f"{rt_kw}: gradient of {worst} off by {errs[worst]:.2e}"
        assert abs(out.loss - self.loss) <= tol * max(1.0, abs(self.loss)), (rt_kw, out.loss, self.loss)
        return out


def assert_feature_matters(name: str, seqs, **without):
    """HF's own log-probs change when the feature is switched off (so these inputs test it)."""
    with torch.no_grad():
        on, off = family_model(name), family_model(name, **without)
        diff = max((path_logprobs(on, s) - path_logprobs(off, s)).abs().max().item() for s in seqs)
    assert diff > 1e-3, f"{name}: switching {without} off changes log-probs by only {diff:.1e}"


@pytest.fixture(scope="module")
def mistral_reference():
    seqs = long_forest()
    assert_feature_matters("mistral", seqs, sliding_window=None)
    return Reference(family_model("mistral"), seqs)


@pytest.mark.parametrize("group_tokens", [0, 8, None])
@pytest.mark.parametrize("mode", ["retain", "recompute"])
@pytest.mark.parametrize("attention", ["reference", "sdpa"])
def test_sliding_window_paths_4x_the_window(mistral_reference, attention, mode, group_tokens):
    """Windows cut through the stack part and the own part: chunks of 5 put a path's
    window across several segments and calls (and, with group_tokens, across in-call
    ancestors)."""
    mistral_reference.check(attention=attention, mode=mode, group_tokens=group_tokens, chunk_size=5)


def test_layers_alternating_full_and_sliding_attention():
    seqs = long_forest(1)
    model = family_model("qwen2")
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert_feature_matters("qwen2", seqs, use_sliding_window=False)
    ref = Reference(model, seqs)
    for attention in ("reference", "sdpa"):
        ref.check(attention=attention, chunk_size=6)


def test_gemma2_logit_softcapping():
    seqs = long_forest(2)
    assert_feature_matters("gemma2", seqs, attn_logit_softcapping=None)
    ref = Reference(family_model("gemma2"), seqs)
    for attention, mode in (("reference", "retain"), ("sdpa", "recompute")):
        ref.check(attention=attention, mode=mode, chunk_size=7)


def test_gpt_oss_attention_sinks():
    seqs = long_forest(3)[:3]
    model = family_model("gpt_oss")
    with torch.no_grad():  # the sinks matter: HF without them (-inf sink logits) differs
        base = family_model("gpt_oss")
        for layer in base.model.layers:
            layer.self_attn.sinks.fill_(-float("inf"))
        diff = max((path_logprobs(model, s) - path_logprobs(base, s)).abs().max().item() for s in seqs)
    assert diff > 1e-3, diff
    ref = Reference(model, seqs)
    for attention in ("reference", "sdpa"):
        ref.check(attention=attention, chunk_size=6)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in ref.ref_model.named_parameters() if "sinks" in n)


def test_deepseek_v3_latent_attention():
    seqs = long_forest(4)[:3]
    model = family_model("deepseek_v3")
    spec = dtree.TreeRuntime(model).spec
    assert (spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (4, 24, 16)
    ref = Reference(model, seqs)
    for attention in ("reference", "sdpa"):
        ref.check(attention=attention, chunk_size=6, group_tokens=10)


def test_unknown_attention_keyword_is_refused_by_name():
    from dtree.models.attention_function import attention_options

    assert attention_options({"sliding_window": 4, "softcap": None, "s_aux": None, "use_cache": False}) == {"window": 4}
    with pytest.raises(ValueError, match="'attn_bias'"):
        attention_options({"attn_bias": torch.zeros(1)})
    with pytest.raises(ValueError, match="is_causal=False"):
        attention_options({"is_causal": False})


def test_baselines_refuse_options_they_do_not_implement():
    from dtree.baselines import LinearizedTrainer

    model = family_model("gemma2")
    forest = dtree.Forest.from_sequences([[1, 2, 3, 4], [1, 2, 5]])  # within the window
    before = [p.grad for p in model.parameters()]
    with pytest.raises(ValueError, match=r"implements plain causal attention, not \['softcap'\]"):
        LinearizedTrainer(model).forward_backward(forest, dtree.losses.nll())
    assert all(p.grad is None for p in model.parameters()) and all(b is None for b in before)
    with pytest.raises(ValueError, match="longer than the model's sliding window"):
        LinearizedTrainer(family_model("mistral")).forward_backward(
            dtree.Forest.from_sequences([list(range(1, 12))]), dtree.losses.nll()
        )


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_triton_on_cuda(family, mode):
    """The compiled fused kernel with each family's options (fp32, no TF32) against HF
    per path on the GPU; windows over paths 4x longer."""
    torch.backends.cuda.matmul.allow_tf32 = False
    seqs = long_forest(5)
    ref = Reference(family_model(family).cuda(), seqs)
    ref.check(tol=1e-4, attention="triton", mode=mode, chunk_size=6, group_tokens=16)
