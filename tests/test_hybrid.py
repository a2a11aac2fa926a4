"""Hybrid models (recurrent layers through the state stack) in the setups beyond
tests/test_families.py's sweep, against HF run on each path (every parameter gradient):
log-probs, HF gradient checkpointing (reentrant and not), frozen parts and trainable
parts that only some layers reach, the linearized baseline, the state plan, and the
refusals (tree-mask training, a recurrent layer that bypasses its adapter, an adapted
class a transformers release changed).

The models are tests/family_configs.py's tiny ones (float32): Qwen3.5 (gated
DeltaNet, a conv window and a delta-rule state per layer), Nemotron-H (Mamba2, MLP and
MoE layers without a token mixer), LFM2 (a short convolution only) and Gemma 4 (global
layers with another head dim: a KV stack per shape)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from reference import linearized_step
from setups import SEQS, assert_exact, assert_logprobs_exact, reference, run_dtree
from test_checkpoint_layers import hf_checkpointing
from test_families import build

import dtree
from dtree.baselines import LinearizedTrainer, TreeMaskTrainer
from dtree.models import mixers
from dtree.plan.schedule import build_schedule
from dtree.plan.state_plan import plan_states

HYBRIDS = ("qwen3_5_text", "nemotron_h", "lfm2")


@pytest.mark.parametrize("group_tokens", [0, 8, None])
@pytest.mark.parametrize("name", HYBRIDS + ("gemma4_text",))
def test_logprobs_match_per_path(name, group_tokens):
    assert_logprobs_exact(build(name), dict(group_tokens=group_tokens))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_hf_gradient_checkpointing(mode, reentrant):
    """HF re-runs each layer in backward: the re-run re-reads its initial states and
    re-seeds its final ones (the same values)."""
    model = build("qwen3_5_text")
    ref_model, ref_loss = reference(model)
    ckpt_model = hf_checkpointing(copy.deepcopy(model), reentrant)
    out, tree_model = run_dtree(ckpt_model, copy_model=False, mode=mode, group_tokens=8)
    assert_exact(tree_model, ref_model, out, ref_loss)


def _freeze(model, keep) -> None:
    for pname, p in model.named_parameters():
        p.requires_grad_(keep(pname))


@pytest.mark.parametrize(
    "keep",
    [
        lambda n: ".layers.1." in n,  # the recurrent layer 0 and the embeddings frozen: no state needs grad
        lambda n: "linear_attn" in n or "mixer" in n,  # only the recurrent mixers train
        lambda n: "v_proj" in n or "lm_head" in n,  # LoRA-like: attention values and the head
    ],
    ids=["after_recurrent", "mixers_only", "values_and_head"],
)
@pytest.mark.parametrize("mode", ["retain", "recompute"])
@pytest.mark.parametrize("name", ["qwen3_5_text", "nemotron_h"])
def test_frozen_parts(name, mode, keep):
    model = build(name)
    _freeze(model, keep)
    if not any(p.requires_grad for p in model.parameters()):
        pytest.skip("nothing trainable in this model under this rule")
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=8)
    assert_exact(tree_model, ref_model, out, ref_loss)


@pytest.mark.parametrize("name", HYBRIDS)
def test_linearized_baseline_matches_per_path(name):
    """Packed sequences each start their recurrent states from zeros."""
    model = build(name)
    ref_model, ref_loss = reference(model)
    trainer = LinearizedTrainer(copy.deepcopy(model), max_tokens_per_batch=24)
    out = trainer.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert out.metrics["micro_batches"] > 1
    assert_exact(trainer.module, ref_model, out, ref_loss)


def test_tree_mask_refuses_recurrent_layers():
    with pytest.raises(ValueError, match=r"has recurrent layers \(layers \[0\]\): tree-mask training cannot express"):
        TreeMaskTrainer(build("qwen3_5_text"))


def test_per_layer_kv_shapes_get_a_stack_each():
    model = build("gemma4_text")
    ref_model, ref_loss = reference(model)
    rt = dtree.TreeRuntime(copy.deepcopy(model), chunk_size=3, group_tokens=8)
    out = rt.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert sorted((s.num_layers, s.head_dim) for s in rt.stack.kv) == [(1, 16), (1, 32)]
    assert rt.spec.kv_elements_per_token() == 2 * 2 * (16 + 32)
    assert_exact(rt.module, ref_model, out, ref_loss)


def test_hybrid_stacks_hold_only_their_layers():
    rt = dtree.TreeRuntime(build("nemotron_h"), group_tokens=0, chunk_size=3)
    rt.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert rt.spec.attention_layers == (2,) and rt.spec.recurrent_layers == (0,)
    (kv,) = rt.stack.kv
    assert kv.num_layers == 1
    assert set(rt.stack.states.shapes) == {(0, "conv"), (0, "recurrent")}


def test_runtime_plans_the_state_slots_once_and_counts_them(monkeypatch):
    """The memory policy's refined peak gets the step's state slots (the state stack's
    bytes), and the walk uses the same state plan, with a state stack of that size."""
    import dtree.engine.walk
    import dtree.plan.step_plan

    seen, planned, walked = [], [], []
    refine = dtree.plan.step_plan.refine
    monkeypatch.setattr(dtree.plan.step_plan, "refine", lambda *a, **k: seen.append(a[-1]) or refine(*a, **k))
    monkeypatch.setattr(dtree.plan.step_plan, "plan_states", lambda sched: planned.append(plan_states(sched)) or planned[-1])
    init = dtree.engine.walk.TreeWalk.__init__
    monkeypatch.setattr(
        dtree.engine.walk.TreeWalk, "__init__", lambda self, plan: walked.append(plan.states) or init(self, plan)
    )
    rt = dtree.TreeRuntime(build("nemotron_h"), group_tokens=0, chunk_size=2)
    forest = dtree.Forest.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9]])
    rt.forward_backward(forest, dtree.losses.nll())
    assert seen == [3] and len(planned) == 1 and planned[0].capacity == 3  # test_state_plan_slots: 3 slots
    assert walked == planned  # the walk reads the planned slots
    assert rt.stack.state_slots == rt.stack.states.capacity == 3


def test_state_plan_slots():
    """Slots of segments with children in later calls, stacked like K/V tokens; reads
    from the stack, in-call parents, roots."""
    forest = dtree.Forest.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9]])
    sched = build_schedule(forest, chunk_size=2, group_tokens=0)
    plan = plan_states(sched)
    parent = sched.segment_parent
    for g, (group, layout) in enumerate(zip(sched.groups, plan.layouts)):
        for i, s in enumerate(group.segments):
            p = int(parent[s])
            has_later_child = any(parent[c] == s for c in range(sched.num_segments))
            assert (layout.push_slot[i] >= 0) == has_later_child  # one segment per call here
            assert (layout.read_slot[i] >= 0) == (p >= 0) and layout.call_parent[i] == -1
    # the root chain [1 2] -> [3] holds two slots at once, then the branch [4 5] one more
    assert plan.capacity == 3
    packed = plan_states(build_schedule(forest, chunk_size=2, group_tokens=64))
    (layout,) = packed.layouts
    assert packed.capacity == 0 and (layout.read_slot == -1).all()
    assert (layout.call_parent[1:] >= 0).all() and layout.call_parent[0] == -1


def test_mixer_that_bypasses_its_adapter_is_refused():
    """The guard counts every recurrent layer's states once per call: a mixer running
    its own forward on the packed row is refused, and param.grad stays untouched."""
    model = build("lfm2")
    runtime = dtree.TreeRuntime(model)
    cls = type(next(m for m in model.modules() if mixers.adapter_of(m) is not None))
    dispatch = cls.forward
    try:
        cls.forward = dispatch.__wrapped__
        with pytest.raises(ValueError, match=r"decoder layer 0 ran its recurrent mixer without dtree's adapter"):
            runtime.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    finally:
        cls.forward = dispatch
    assert all(p.grad is None for p in model.parameters())


def test_changed_mixer_class_is_refused_by_name():
    """A module of an adapted class without an attribute the adapter reads (as a
    transformers release that changed the class would have) is refused when wrapped."""
    model = build("qwen3_5_text")
    mixer = next(m for m in model.modules() if mixers.adapter_of(m) is not None)
    del mixer.in_proj_z
    with pytest.raises(ValueError, match=r"Qwen3_5GatedDeltaNet has no attribute 'in_proj_z' in transformers"):
        dtree.TreeRuntime(model)


def test_state_gradient_accumulates_over_children():
    """A GRPO-like group: one prompt, many answers, node by node: the prompt's final state
    takes one gradient per answer before its backward, summed in float32."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 97, (6,), generator=gen).tolist()
    seqs = [prompt + torch.randint(3, 97, (3,), generator=gen).tolist() for _ in range(6)]
    model = build("nemotron_h")
    ref_model, ref_loss = reference(model, seqs)
    out, tree_model = run_dtree(model, seqs, group_tokens=0, mode="recompute")
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_ppo_loss_on_hybrid_matches_per_path():
    """A per-path loss with advantages and old log-probs (GRPO's) through the recurrent layers."""
    gen = torch.Generator().manual_seed(0)
    model = build("qwen3_5_text")
    forest = dtree.Forest.from_sequences(SEQS)
    old = dtree.TreeRuntime(model).logprobs(forest)
    adv = [float(a) for a in torch.randn(len(SEQS), generator=gen)]
    fields = {
        "advantages": [np.full(len(s), a) for s, a in zip(SEQS, adv)],
        "old_logprobs": [np.concatenate([[0.0], o.numpy() + 0.05]) for o in old],
    }
    ref_model = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref_model, SEQS, fields, "ppo", "token_mean", clip_eps=0.2)
    tree_model = copy.deepcopy(model)
    rt = dtree.TreeRuntime(tree_model, chunk_size=3, group_tokens=8, mode="recompute")
    out = rt.forward_backward(forest.with_fields(**fields), dtree.losses.ppo_clip(clip_eps=0.2))
    assert_exact(tree_model, ref_model, out, ref_loss)


@pytest.mark.parametrize("settings", [dict(group_tokens=0), dict(mode="recompute", group_tokens=6), dict()])
def test_custom_module_with_a_recurrent_layer(settings):
    """The protocol for custom modules: ``layer_kv`` and ``recurrent_states`` in the spec,
    ``attend.states(layer)`` handed to dtree's ops; against the module's own forward per path."""
    from nanogpt import NanoHybrid
    from test_runtime_exact import _per_path_nll_backward

    torch.manual_seed(0)
    model = NanoHybrid()
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    rt = dtree.TreeRuntime(tree_model, chunk_size=2, **settings)
    out = rt.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll("sum"))
    total = _per_path_nll_backward(ref_model, SEQS)
    assert_exact(tree_model, ref_model)
    assert abs(out.loss - total) < 1e-4 * max(1.0, abs(total))


@pytest.mark.slow
def test_compiled_hybrid_layers():
    """torch.compile'd decoder layers run the mixers eagerly (a graph break) and stay exact."""
    model = build("qwen3_5_text")
    ref_model, ref_loss = reference(model)
    compiled = copy.deepcopy(model)
    dtree.compile_layers(compiled)
    out, tree_model = run_dtree(compiled, copy_model=False, group_tokens=8, mode="recompute")
    assert_exact(tree_model, ref_model, out, ref_loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3.5", "nemotron_h"])
def test_bf16_hybrid_on_cuda_by_the_flash_rule(kind):
    """bf16 on CUDA with the recurrence ``auto`` takes (flash-linear-attention's kernels
    where they run, else the chunked torch form): the loss within 2x and every gradient
    within 3x of the bf16 HF model's error per path, plus a floor (benchmarks/hybrid_gpu.py's
    check, on its tiny models)."""
    from benchmarks.hybrid_gpu import branching_sequences, check_model, nemotron_config, qwen35_config

    device = torch.device("cuda")
    config = (qwen35_config if kind == "qwen3.5" else nemotron_config)("tiny")
    rows = check_model(kind, config, device, branching_sequences(config.vocab_size, 3),
                       {"default": {}, "calls": dict(group_tokens=0)})
    assert all(r["ok"] and r["recurrence"] in ("fla", "chunked") for r in rows), rows


def test_lora_on_every_linear_layer():
    """PEFT LoRA on every linear layer, the mixers' projections included (the adapters call
    the projections as modules); the base weights frozen."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    model = peft.get_peft_model(build("qwen3_5_text"), config)
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode="recompute", group_tokens=8)
    assert_exact(tree_model, ref_model, out, ref_loss)
    assert all(p.grad is not None for p in tree_model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "name, targets, what",
    [("qwen3_5_text", ["conv1d"], "convolution"), ("jamba", ["dt_proj"], "dt_proj")],
)
def test_lora_on_weights_a_mixer_reads_directly_is_refused(name, targets, what):
    """Weights the adapters read directly, as transformers does (a mixer's convolution,
    Jamba's dt_proj), cannot carry a LoRA adapter unseen: refused by name."""
    peft = pytest.importorskip("peft")
    model = build(name)
    rank = 64 if what == "convolution" else 2  # PEFT needs a rank divisible by the conv's groups
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, init_lora_weights=False, target_modules=targets))
    with pytest.raises(ValueError, match=rf"{what} is a .*not a plain torch\.nn\..*target modules"):
        dtree.TreeRuntime(model).forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert all(p.grad is None for p in model.parameters())
