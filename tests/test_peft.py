"""PEFT adapters through dtree, against the same PEFT model run on each path by HF:
LoRA on its default targets (q_proj, v_proj), on every linear layer, on lm_head too,
and a fully trained lm_head copy (modules_to_save); every parameter's gradient, in
all modes, node by node, a few segments per call and one call."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_models import make_model
from setups import GROUP_TOKENS, MODES, assert_exact, assert_logprobs_exact, reference, run_dtree

import dtree

peft = pytest.importorskip("peft")

ADAPTERS = ("qv", "all_linear", "lm_head", "modules_to_save")


def lora_config(kind: str):
    # init_lora_weights=False: random A and B, so the adapters change the output and
    # both get non-zero gradients (PEFT's default B = 0 would hide a skipped adapter)
    common = dict(r=4, lora_alpha=8, init_lora_weights=False)
    return {
        "qv": lambda: peft.LoraConfig(**common),  # PEFT's default targets for Qwen2: q_proj, v_proj
        "all_linear": lambda: peft.LoraConfig(target_modules="all-linear", **common),
        "lm_head": lambda: peft.LoraConfig(target_modules=["q_proj", "v_proj", "lm_head"], **common),
        "modules_to_save": lambda: peft.LoraConfig(modules_to_save=["lm_head"], **common),
    }[kind]()


def peft_model(kind: str, seed: int = 0, max_positions: int = 4096):
    torch.manual_seed(seed)
    return peft.get_peft_model(make_model("qwen2", seed=seed, max_positions=max_positions), lora_config(kind))


@functools.cache
def setup(kind: str):
    model = peft_model(kind)
    return model, *reference(model)


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ADAPTERS)
def test_peft_model_matches_per_path(kind, mode, group_tokens):
    model, ref_model, ref_loss = setup(kind)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=group_tokens)
    if group_tokens is not None:
        assert out.num_model_calls > 1
    assert_exact(tree_model, ref_model, out, ref_loss)
    # the adapters' parameters got their gradients, on the PeftModel the optimizer sees
    trainable = [n for n, p in tree_model.named_parameters() if p.requires_grad]
    assert any("lora_" in n or "modules_to_save" in n for n in trainable)
    assert all(p.grad is not None for p in tree_model.parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", ["lm_head", "modules_to_save"])
def test_wrapped_head_logprobs(kind):
    """The head goes through its module: log-probs are those of the adapted head."""
    model = peft_model(kind)
    assert_logprobs_exact(model, dict(group_tokens=8))


def test_adapters_injected_after_wrapping():
    """TreeRuntime(base) first, get_peft_model(base, ...) after: dtree reads the head
    and the parameters at every call, so the new adapters are trained, lm_head's too."""
    base = make_model("qwen2", seed=1)
    rt = dtree.TreeRuntime(base, chunk_size=3, group_tokens=8)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, lora_config("lm_head"))
    ref_model, ref_loss = reference(model)
    out = rt.forward_backward(dtree.Forest.from_sequences(__import__("setups").SEQS), dtree.losses.nll())
    assert_exact(model, ref_model, out, ref_loss)
    assert model.base_model.model.lm_head.lora_A["default"].weight.grad is not None


def test_long_tree_needing_several_calls():
    """The issue's crash, scaled down for CPU: one long tree (a 420-token prompt, four
    40-token answers) in several calls, LoRA on the default targets."""
    torch.manual_seed(3)
    prompt = torch.randint(0, 97, (420,)).tolist()
    seqs = [prompt + torch.randint(0, 97, (40,)).tolist() for _ in range(4)]
    model = peft_model("qv", seed=3)
    ref_model, ref_loss = reference(model, seqs)
    out, tree_model = run_dtree(model, seqs, chunk_size=128, group_tokens=160)
    assert out.num_model_calls > 1
    assert_exact(tree_model, ref_model, out, ref_loss)


@pytest.mark.slow
def test_issue_tree_default_settings():
    """The issue's exact case: one 8,280-token tree with the default settings (which
    need more than one call for it), LoRA on the default targets."""
    torch.manual_seed(4)
    prompt = torch.randint(0, 97, (8000,)).tolist()
    seqs = [prompt + torch.randint(0, 97, (70,)).tolist() for _ in range(4)]
    model = peft_model("qv", seed=4, max_positions=8192)
    model.base_model.model.set_attn_implementation("sdpa")  # eager's [L, L] weights are 1.5 GB per path
    ref_model, ref_loss = reference(model, seqs)
    model.base_model.model.set_attn_implementation("eager")
    out, tree_model = run_dtree(model, seqs, chunk_size=2048)
    assert out.num_model_calls > 1
    assert_exact(tree_model, ref_model, out, ref_loss, tol=5e-5)  # 8k-token sums in float32


def test_prompt_learning_adapters_are_refused():
    model = peft.get_peft_model(make_model("qwen2"), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with pytest.raises(ValueError, match="prompt-learning adapter"):
        dtree.TreeRuntime(model)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_peft_lora_on_cuda(mode):
    """LoRA on q/v and lm_head on the GPU (the fused Triton attention, the head's module
    path on CUDA), float32 without tf32, against the same model per path."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = peft_model("lm_head").cuda()
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=8)
    assert out.metrics["attention"] == "triton"
    assert_exact(tree_model, ref_model, out, ref_loss, tol=1e-4)  # fp32 kernels, another summation order
