"""Layer checkpointing inside dtree's runtime: its own (``checkpoint_layers=True``) and
HF's gradient checkpointing (reentrant and not), which work because K/V seeds enter
inside the attention backward (``seed_from_stack``) of whatever graph computes the K/V.

Against HF run on each path (tests/reference.py), every parameter gradient, in every
mode and group budget (node by node; a few segments per call, with in-call ancestors;
one call); with frozen parts, PEFT LoRA, a custom TreeModule; dropout replayed (the
same gradients with and without checkpointing under one seed); and the memory autograd
keeps (saved-tensor hooks): the layers' inputs, not their internals."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from nanogpt import NanoGPT, NanoGPTWithoutLayerList
from reference import grad_errors
from setups import GROUP_TOKENS, MODES, SEQS, assert_exact, reference, run_dtree
from test_frozen import SETUPS as FROZEN
from test_runtime_memory import SavedBytes

import dtree


def hf_checkpointing(model, reentrant: bool):
    """HF gradient checkpointing on (``activation_checkpointing_enable`` in newer transformers)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


@pytest.mark.parametrize("offload", [False, True], ids=["inputs on the device", "inputs on the host"])
@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_checkpoint_layers_matches_per_path(arch, mode, group_tokens, offload):
    """``offload_checkpoints``: the inputs wait in host memory (:mod:`dtree.models.host_checkpoints`;
    cloned on CPU: the same steps)."""
    model = make_model(arch, tied=arch == "qwen2")
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=group_tokens, checkpoint_layers=True,
                                offload_checkpoints=offload)
    assert out.metrics["memory_plan"]["checkpoint_layers"] == model.config.num_hidden_layers
    assert out.metrics["memory_plan"]["offload_checkpoints"] is offload
    assert_exact(tree_model, ref_model, out, ref_loss)


def three_layer_model(arch: str):
    from hf_models import _common, make_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = type(make_config(arch))(**{**_common(False, 4096), "num_hidden_layers": 3})
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("count", [1, 2])
def test_part_of_the_layers_checkpointed_matches_per_path(count, mode, group_tokens):
    """``checkpoint_layers=k``: the first k of 3 layers checkpointed in every call."""
    model = three_layer_model("llama")
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=group_tokens, checkpoint_layers=count)
    assert out.metrics["memory_plan"]["checkpoint_layers"] == count
    assert_exact(tree_model, ref_model, out, ref_loss)


@pytest.mark.parametrize("mode", ["auto", "retain"])
@pytest.mark.parametrize("leaf,path", [(0, 3), (3, 0), (1, 2)])
def test_path_and_leaf_calls_checkpoint_different_layers(leaf, path, mode, monkeypatch):
    """The memory plan checkpoints one count of layers in calls without child groups (and
    recomputed re-runs) and another in the retained groups with children (the path):
    exact in each combination; the layers are restored after every call."""
    import dataclasses

    from dtree.plan import step_plan

    model = three_layer_model("qwen2")
    ref_model, ref_loss = reference(model)
    plan_memory = step_plan.plan_memory

    def planned(*args, **kwargs):
        plan = plan_memory(*args, **kwargs)
        return dataclasses.replace(plan, checkpoint_layers=leaf, path_checkpoint_layers=path)

    monkeypatch.setattr(step_plan, "plan_memory", planned)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=8)
    assert (out.metrics["memory_plan"]["checkpoint_layers"], out.metrics["memory_plan"]["path_checkpoint_layers"]) == (
        leaf, path)
    assert_exact(tree_model, ref_model, out, ref_loss)
    assert not any(type(m).__name__ == "CheckpointedLayer" for m in tree_model.modules())


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hf_gradient_checkpointing_matches_per_path(reentrant, mode, group_tokens):
    model = make_model("qwen2")
    ref_model, ref_loss = reference(model)
    ckpt_model = hf_checkpointing(copy.deepcopy(model), reentrant)
    out, tree_model = run_dtree(ckpt_model, copy_model=False, mode=mode, group_tokens=group_tokens)
    assert_exact(tree_model, ref_model, out, ref_loss)
    # the model still runs as a plain HF model afterwards (its attention is switched back)
    assert ckpt_model.config._attn_implementation != "dtree"


def test_hf_checkpointing_needs_the_step_scope(monkeypatch):
    """What the adapter's ``dtree_scope`` prevents: HF re-runs the layer in backward with
    the model's own attention (no stack), and checkpointing sees other tensors."""
    import contextlib

    from dtree.models.hf import HFTreeModel

    monkeypatch.setattr(HFTreeModel, "dtree_scope", lambda self: contextlib.nullcontext())
    model = hf_checkpointing(make_model("qwen2"), reentrant=False)
    with pytest.raises(Exception):
        run_dtree(model, mode="retain", group_tokens=8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["embed_and_layer0", "embed_and_layer0_tied", "head_only"])
def test_checkpoint_layers_with_frozen_parts(kind, mode):
    """Frozen layer 0: its checkpointed re-run has no graph to seed; nothing is lost."""
    model = FROZEN[kind]()
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=8, checkpoint_layers=True)
    assert_exact(tree_model, ref_model, out, ref_loss)


@pytest.mark.parametrize("hf", [False, True], ids=["dtree_checkpoint", "hf_checkpointing"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_layers_with_peft_lora(mode, hf):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "lm_head"])
    model = peft.get_peft_model(make_model("qwen2"), config)
    ref_model, ref_loss = reference(model)
    tree_model = copy.deepcopy(model)
    if hf:
        hf_checkpointing(tree_model, reentrant=False)
    out, tree_model = run_dtree(tree_model, copy_model=False, mode=mode, group_tokens=8, checkpoint_layers=not hf)
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_checkpoint_layers_on_a_custom_tree_module():
    """tests/nanogpt.py keeps its blocks in a ModuleList; its own causal forward per
    path is the reference."""
    torch.manual_seed(0)
    model = NanoGPT()
    seqs = [[s % 61 for s in seq] for seq in SEQS]
    ref = copy.deepcopy(model)
    n = sum(len(s) - 1 for s in seqs)
    for s in seqs:
        x = torch.tensor(s)
        (-torch.log_softmax(ref(x)[:-1], -1).gather(-1, x[1:, None]).sum() / n).backward()
    for mode in MODES:
        out, tree_model = run_dtree(model, seqs, mode=mode, group_tokens=8, checkpoint_layers=True)
        errs = grad_errors(tree_model, ref)
        assert max(errs.values()) < 1e-5, (mode, errs)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_is_replayed_under_checkpoint_layers(mode):
    """LoRA dropout in train mode: a checkpointed layer's re-run draws the forward's
    masks (torch.utils.checkpoint preserves the RNG state inside dtree's per-group
    seeds), so the gradients are those of the unchecked step under the same seed."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, init_lora_weights=False,
                             target_modules=["q_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(make_model("qwen2"), config).train()
    grads = {}
    for ckpt in (False, True):
        torch.manual_seed(11)
        out, tree_model = run_dtree(model, mode=mode, group_tokens=8, checkpoint_layers=ckpt)
        grads[ckpt] = tree_model
    assert max(grad_errors(grads[True], grads[False]).values()) < 1e-5


def test_checkpoint_layers_keeps_the_layer_inputs_only():
    """Saved-tensor hooks count what autograd keeps between forward and backward: outside
    the checkpointed layers (the final norm's float32 tensors, the LM head's rows: a few
    [T, hidden] tensors whatever the depth) and one [T, hidden] input per layer. For this
    2-layer model that is a quarter of the unchecked step's (each layer keeps ~13
    [T, hidden]-sized tensors unchecked)."""
    torch.manual_seed(0)
    model = make_model("llama")
    seqs = [torch.randint(0, 97, (160,)).tolist()]
    seqs += [seqs[0][:100] + torch.randint(0, 97, (60,)).tolist() for _ in range(3)]
    forest = dtree.Forest.from_sequences(seqs)

    def saved_peak(checkpoint: bool) -> int:
        rt = dtree.TreeRuntime(model, mode="retain", group_tokens=4096, checkpoint_layers=checkpoint,
                               lean_layers=False)  # the counts above are HF's eager layers
        rt.forward_backward(forest, dtree.losses.nll("sum"))  # allocates the stack, so it can be excluded
        model.zero_grad(set_to_none=True)
        tracker = SavedBytes(list(model.parameters()) + rt.stack.tensors())
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            out = rt.forward_backward(forest, dtree.losses.nll("sum"))
        model.zero_grad(set_to_none=True)
        assert out.num_model_calls == 1
        return tracker.peak

    plain, ckpt = saved_peak(False), saved_peak(True)
    config = model.config
    row = forest.num_unique_tokens * config.hidden_size * 4  # one float32 [T, hidden]
    layer_inputs = config.num_hidden_layers * row
    assert layer_inputs <= ckpt <= 6 * row + layer_inputs, (ckpt, row)
    assert ckpt < 0.25 * plain, (ckpt, layer_inputs, plain)


def test_checkpoint_layers_needs_a_layer_list():
    with pytest.raises(ValueError, match="ModuleList attribute named"):
        dtree.TreeRuntime(NanoGPTWithoutLayerList(), checkpoint_layers=True)
    with pytest.raises(ValueError, match="checkpoint_layers must be None"):
        dtree.TreeRuntime(NanoGPT(), checkpoint_layers="yes")
    dtree.TreeRuntime(NanoGPTWithoutLayerList())  # the policy leaves such a model unchecked


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_rerun_skips_the_mlp_down_projection_and_stays_exact(monkeypatch, arch):
    """A checkpointed lean layer's re-run keeps what the backward saves and skips the
    MLP's down projection (its output only reaches the residual add, which the re-run's
    caller drops): the SiLU product is not computed in the re-run, and the gradients are
    HF's per path, with the skip and without it."""
    from dtree.models import lean_layers
    from dtree.ops import rerun
    from dtree.ops.swiglu import interface as swiglu

    original, in_place = swiglu._forward, swiglu._backward_in_place
    model = make_model(arch)
    ref_model, ref_loss = reference(model)
    products = {}
    for skip in (True, False):
        seen: list = []
        monkeypatch.setattr(swiglu, "_forward", lambda *a, seen=seen: seen.append(rerun.in_rerun()) or original(*a))
        # a re-run's backward forms the product inside its in-place kernel
        monkeypatch.setattr(swiglu, "_backward_in_place",
                            lambda *a, seen=seen: seen.append(rerun.in_rerun()) or in_place(*a))
        monkeypatch.setattr(lean_layers, "in_rerun", rerun.in_rerun if skip else (lambda: False))
        out, tree_model = run_dtree(model, checkpoint_layers=True, mode="retain", group_tokens=16)
        assert_exact(tree_model, ref_model, out, ref_loss)
        products[skip] = seen
    assert products[True] and not any(products[True]), "the re-run computed the SiLU product"
    in_reruns = sum(products[False])
    assert in_reruns > 0 and len(products[False]) - len(products[True]) == in_reruns


@pytest.mark.parametrize("rows", [1, 5, 0])
def test_the_rerun_backward_in_row_chunks_stays_exact(monkeypatch, rows):
    """The re-run's MLP backward in row chunks (gradients written over the re-run's gate
    and up, the down projection's weight gradient summed over chunks) gives HF's gradients
    per path; every call here is longer than a chunk. ``rerun_chunk_rows=0``: each call's in one."""
    from dtree.ops.swiglu import interface as swiglu

    chunks = []
    original = swiglu._backward_in_place
    monkeypatch.setattr(swiglu, "_backward_in_place", lambda *a: chunks.append(a[0].shape[0]) or original(*a))
    model = make_model("qwen2", tied=True)
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, checkpoint_layers=True, mode="recompute", group_tokens=16, rerun_chunk_rows=rows)
    assert_exact(tree_model, ref_model, out, ref_loss)
    assert out.metrics["rerun_chunk_rows"] == rows
    if rows:
        assert chunks and max(chunks) == rows
        return
    from setups import CHUNK

    from dtree.plan.schedule import build_schedule

    calls = {g.num_tokens for g in build_schedule(dtree.Forest.from_sequences(SEQS), CHUNK, 16).groups}
    assert chunks and set(chunks) <= calls and max(chunks) == max(calls) > 5  # each call in one chunk


def test_the_rerun_chunk_rows_follow_the_memory_setting():
    """A re-run's SwiGLU backward runs each call in one chunk, as the memory probe prices it, but under
    ``memory="low"`` in :data:`~dtree.plan.memory_policy.LOW_RERUN_CHUNK_ROWS`-row chunks; the
    runtime's ``rerun_chunk_rows`` overrides both, and a bad value is refused by name."""
    from dtree.plan.memory_policy import LOW_RERUN_CHUNK_ROWS, rerun_chunk_rows

    assert (rerun_chunk_rows("auto", None), rerun_chunk_rows(12.5, None)) == (0, 0)
    assert rerun_chunk_rows("low", None) == LOW_RERUN_CHUNK_ROWS == 4096
    assert (rerun_chunk_rows("low", 0), rerun_chunk_rows("auto", 512)) == (0, 512)
    model = make_model("qwen2")
    for options, want in (({}, 0), ({"memory": "low"}, 4096), ({"memory": "low", "rerun_chunk_rows": 7}, 7)):
        out, _ = run_dtree(model, checkpoint_layers=True, group_tokens=16, **options)
        assert out.metrics["rerun_chunk_rows"] == want, options
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="rerun_chunk_rows"):
            dtree.TreeRuntime(model, rerun_chunk_rows=bad)
