"""The memory policy's decisions as pure functions of (model shape, dtype, memory,
forest size), for the H100 cases of issue 11 (qwen2.5-1.5b, bf16, 80 GB), a 7B model and
CPU; its byte figures against the H100 measurements they were fit to; and the runtime
using the plan (CPU: no device memory to read)."""

from __future__ import annotations

import math

import pytest
import torch
from hf_models import make_model
from setups import SEQS

import dtree
from dtree import memory_policy as mp
from dtree.models import ModelSpec

GIB = 2.0**30
QWEN_1_5B = ModelSpec(num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, hidden_size=1536,
                      vocab_size=151936, intermediate_size=8960)
QWEN_7B = ModelSpec(num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, hidden_size=3584,
                    vocab_size=152064, intermediate_size=18944)
AGENTIC_64K = mp.StepShape(65606, 8499)  # the tree (agentic, seed 0, target 65,536 unique)
AGENTIC_21K = mp.StepShape(21266, 7849)
CASE_1 = mp.StepShape(6144, 2560)
H100 = dict(available=76 * GIB, allocated=2.9 * GIB, expandable_segments=True, fused_head=True,
            missing_grads=2.9 * GIB)


def plan(shape=AGENTIC_64K, spec=QWEN_1_5B, **kw):
    return mp.plan_step(spec, 2, shape, on_cuda=True, **{**H100, **kw})


def test_byte_figures_match_the_h100_measurements():
    # 21.70 GiB of decoder-layer activations for an 8,262-token call at the peak
    measured = 21.70 * GIB / 8262
    assert mp.layer_activation_bytes(QWEN_1_5B, 2) == pytest.approx(measured, rel=0.03)
    assert QWEN_1_5B.activation_bytes_per_token(2) > 1.1 * measured  # the spec's estimate errs high
    assert mp.layer_input_bytes(QWEN_1_5B, 2) == 30 * 1536 * 2
    # 1.16 GiB of KV stack (bf16 values, float32 gradients) for a 14,419-slot plan
    assert mp.stack_slot_bytes(QWEN_1_5B, 2) * 14419 == pytest.approx(1.16 * GIB, rel=0.02)
    # the chunked torch LM head at 4096 rows: 5.49 GiB at the peak (logits, their
    # gradient, the weight-gradient accumulator); the fused one far less
    assert mp.head_bytes(QWEN_1_5B, 2, 4096, 16384, fused=False) == pytest.approx(5.49 * GIB, rel=0.15)
    assert mp.head_bytes(QWEN_1_5B, 2, 4096, 16384, fused=True) < 0.45 * mp.head_bytes(QWEN_1_5B, 2, 4096, 16384, False)


def test_default_on_an_80gb_h100_is_the_fastest_plan_that_fits():
    p = plan()
    assert (p.group_tokens, p.checkpoint_layers) == (16384, False)
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert p.budget_bytes == pytest.approx(0.9 * 76 * GIB)
    # one call of the whole 21k tree, and of case 1
    assert plan(AGENTIC_21K).group_tokens >= AGENTIC_21K.unique_tokens
    assert plan(CASE_1).checkpoint_layers is False


def test_less_memory_turns_checkpointing_on_with_large_calls():
    p = plan(setting=20)
    assert p.checkpoint_layers and p.group_tokens == 32768
    assert p.predicted_peak_bytes + 2.9 * GIB <= 20 * GIB
    tight = plan(available=14 * GIB)
    assert tight.checkpoint_layers and tight.predicted_peak_bytes <= tight.budget_bytes
    # nothing fits: the leanest plan, said so
    hopeless = plan(available=3 * GIB)
    assert "no plan" in hopeless.reason
    assert hopeless.predicted_peak_bytes == min(
        plan(available=3 * GIB, group_tokens=g, checkpoint_layers=c, logprob_chunk=k).predicted_peak_bytes
        for g in mp.GROUP_TOKENS for c in (False, True) for k in mp.LOGPROB_CHUNKS
    )


def test_fragmentation_margin_without_expandable_segments():
    assert plan(expandable_segments=False).budget_bytes == pytest.approx(0.8 * 76 * GIB)


def test_low_setting_is_the_lean_recipe():
    for shape in (AGENTIC_21K, AGENTIC_64K):
        p = plan(shape, setting="low")
        assert (p.group_tokens, p.checkpoint_layers, p.logprob_chunk) == (8192, True, 1024)
        # weights (2.9) + the rest: the issue's <= 12 GB on the 21k tree, with room for fragmentation
        assert p.predicted_peak_bytes + 2.9 * GIB < 11 * GIB
    seven = plan(spec=QWEN_7B, setting="low", missing_grads=15.2e9, available=64 * GIB)
    assert seven.checkpoint_layers


def test_explicit_options_are_kept():
    p = plan(group_tokens=4096, checkpoint_layers=True, logprob_chunk=2048)
    assert (p.group_tokens, p.checkpoint_layers, p.logprob_chunk) == (4096, True, 2048)
    assert plan(setting="low", checkpoint_layers=False).checkpoint_layers is False
    assert plan(hf_checkpointing=True).checkpoint_layers is True  # HF checkpoints the layers itself


def test_a_bigger_model_takes_smaller_calls_before_checkpointing():
    p = plan(spec=QWEN_7B, missing_grads=15.2e9, available=64 * GIB)
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert p.group_tokens < 16384


def test_cpu_keeps_the_fixed_defaults():
    p = mp.plan_step(QWEN_1_5B, 4, AGENTIC_64K, on_cuda=False)
    assert (p.group_tokens, p.checkpoint_layers, p.logprob_chunk) == (8192, False, 4096)
    assert math.isinf(p.retain_bytes)
    low = mp.plan_step(QWEN_1_5B, 4, AGENTIC_64K, on_cuda=False, setting="low")
    assert (low.group_tokens, low.checkpoint_layers, low.logprob_chunk) == (8192, True, 1024)


@pytest.mark.parametrize("bad", ["fast", 0, -2, True, None])
def test_bad_settings_name_the_choices(bad):
    with pytest.raises(ValueError, match="memory must be one of"):
        plan(setting=bad)
    with pytest.raises(ValueError, match="memory must be one of"):
        dtree.TreeRuntime(make_model("llama"), memory=bad)


def test_retain_budget():
    unchecked, checked = plan(), plan(checkpoint_layers=True)
    shape = dict(unique_tokens=65606, num_groups=6, nonleaf_tokens=6157, nonleaf_groups=1)  # the schedule at 16k
    assert math.isinf(mp.retain_budget(unchecked, QWEN_1_5B, "retain", **shape))
    assert mp.retain_budget(unchecked, QWEN_1_5B, "recompute", **shape) == 0
    # the 64k tree's trunk: retaining it saves ~4% of the step, for ~17 GB: recomputed
    assert mp.retain_budget(unchecked, QWEN_1_5B, "auto", **shape) == 0
    # a tree that is mostly trunk: retained, within the memory left over
    deep = dict(unique_tokens=65606, num_groups=12, nonleaf_tokens=40000, nonleaf_groups=6)
    assert mp.retain_budget(unchecked, QWEN_1_5B, "auto", **deep) == pytest.approx(unchecked.retain_tokens())
    # checkpointed groups keep their layer inputs only: retained
    assert mp.retain_budget(checked, QWEN_1_5B, "auto", **shape) == pytest.approx(checked.retain_tokens())
    assert checked.retain_tokens() > 50000


def test_runtime_plans_every_step_on_cpu():
    model = make_model("qwen2")
    rt = dtree.TreeRuntime(model, chunk_size=3)
    assert rt.memory_plan is None and rt.logprob_chunk == 4096
    out = rt.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    plan_ = out.metrics["memory_plan"]
    assert plan_["group_tokens"] == 8192 and plan_["checkpoint_layers"] is False and plan_["setting"] == "auto"
    low = dtree.TreeRuntime(model, chunk_size=3, memory="low", logprob_chunk=7)
    out = low.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert out.metrics["memory_plan"]["checkpoint_layers"] is True and low.logprob_chunk == 7
    assert low.memory_plan.logprob_chunk == 7


def test_missing_grad_bytes_counts_tied_weights_once():
    model = make_model("qwen2", tied=True)
    params = list(model.parameters())
    want = sum(p.numel() * p.element_size() for p in params)  # .parameters() lists a tied weight once
    assert mp.missing_grad_bytes(params + params) == want
    params[0].grad = torch.zeros_like(params[0])
    assert mp.missing_grad_bytes(params) == want - params[0].numel() * params[0].element_size()


def test_runtime_passes_the_cuda_inputs_to_the_policy(monkeypatch):
    """The runtime's side of a CUDA step without a GPU: what the allocator can hand out,
    the gradients still to allocate, the stack held, the fused head, HF checkpointing."""
    model = make_model("qwen2")
    rt = dtree.TreeRuntime(model, chunk_size=3)
    seen = {}

    def fake_available(device):
        seen["device"] = device
        return 5 * GIB, 1 * GIB

    monkeypatch.setattr(mp, "available_bytes", fake_available)
    rt._placement = (torch.device("cuda", 0), torch.bfloat16)
    forest = dtree.Forest.from_sequences(SEQS)
    plan_ = rt._plan_memory(forest)
    assert seen["device"] == torch.device("cuda", 0)
    assert plan_.budget_bytes == pytest.approx((1 - mp.MARGIN_FRAGMENTED) * 5 * GIB)
    assert plan_.parts["gradients"] == mp.missing_grad_bytes(model.parameters()) > 0
    assert plan_.predicted_peak_bytes <= plan_.budget_bytes and plan_.reason.startswith("fastest")
    capped = dtree.TreeRuntime(model, chunk_size=3, memory=1.5)
    capped._placement = rt._placement
    assert capped._plan_memory(forest).budget_bytes == pytest.approx(0.5 * GIB)
    model.gradient_checkpointing_enable()
    model.train()
    assert rt._plan_memory(forest).checkpoint_layers is True  # HF checkpoints: planned as checkpointed
