"""dtree's lean layers (``dtree.models.lean_layers``) keep dtree exact.

CPU, float32: a model with lean RMSNorm and SwiGLU MLP modules trained through
TreeRuntime against the unpatched model run on each path by HF (``tests/reference.py``),
every parameter gradient, for Llama, Qwen2 (tied), Qwen3 (per-head q/k norms) and
Mistral, in every mode, with checkpointed layers, with PEFT LoRA on every linear layer
(the down projection is then called as a module); the patched model's own forward is
HF's; removing the layers restores them; other families are refused by name. The
runtime runs them during its steps by default and gives the model its own modules back
afterwards (also after a failed step). Under the
Triton interpreter the kernels run end to end. GPU (``-m gpu``): bf16 by the
flash-attention rule.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hf_models import ARCHS, make_model
from interpreter_worker import worker_fixture
from setups import GROUP_TOKENS, MODES, SEQS, assert_exact, assert_model_flash_rule, reference, run_dtree

import dtree
from dtree.models import lean_layers


def lean(model):
    model = copy.deepcopy(model)
    info = lean_layers.apply_lean_layers(model)
    return model, info


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_lean_layers_match_per_path(arch, mode):
    model = make_model(arch, tied=arch == "qwen2")
    ref_model, ref_loss = reference(model)
    patched, info = lean(model)
    norms = 2 * 2 + 1 + (4 if arch == "qwen3" else 0)  # two per layer, the final one, Qwen3's q/k norms
    assert (info.norms, info.mlps, info.fused_down, info.qkv) == (norms, 2, 2, 2)
    out, tree_model = run_dtree(patched, copy_model=False, mode=mode, group_tokens=8)
    assert_exact(tree_model, ref_model, out, ref_loss)


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("checkpoint_layers", [False, True, 1])
def test_lean_layers_with_checkpointing_and_budgets(checkpoint_layers, group_tokens):
    model = make_model("llama")
    ref_model, ref_loss = reference(model)
    patched, _ = lean(model)
    out, tree_model = run_dtree(patched, copy_model=False, group_tokens=group_tokens,
                                checkpoint_layers=checkpoint_layers)
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_lean_layers_under_lora_call_adapted_projections_as_modules():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = make_model("qwen2")
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    model = peft.get_peft_model(copy.deepcopy(base), config)
    ref_model, ref_loss = reference(model)
    patched = copy.deepcopy(model)
    info = lean_layers.apply_lean_layers(patched.base_model.model)
    assert info.fused_down == 0 and info.mlps == 2  # LoRA-wrapped down projections: called as modules
    assert info.qkv == 0  # and the q, k, v projections too
    out, tree_model = run_dtree(patched, copy_model=False, mode="retain", group_tokens=8)
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_the_patched_models_own_forward_is_hfs_and_removal_restores_it():
    model = make_model("qwen3")
    ids = torch.tensor([SEQS[0]])
    want = model(input_ids=ids).logits
    patched, _ = lean(model)
    assert lean_layers.lean_layers_applied(patched)
    torch.testing.assert_close(patched(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    assert lean_layers.apply_lean_layers(patched).norms > 0  # applying twice is harmless
    lean_layers.remove_lean_layers(patched)
    assert not lean_layers.lean_layers_applied(patched)
    assert not any("forward" in vars(m) for m in patched.modules())


def test_other_families_are_refused_by_name():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert not lean_layers.lean_layers_supported(gpt2)
    with pytest.raises(ValueError, match="model_type is 'gpt2'"):
        lean_layers.apply_lean_layers(gpt2)
    assert lean_layers.lean_layers_supported(make_model("mistral"))


# --------------------------------------------------------------------------- during dtree's steps
def _lean_seen(model) -> list[bool]:
    """A hook on the first norm: per forward run, whether it ran the lean kernel."""
    seen: list[bool] = []
    norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    norm.register_forward_hook(lambda m, args, out: seen.append(getattr(m, "_dtree_lean", False)))
    return seen


def test_the_lean_mlp_hands_gate_and_up_to_its_backward_in_step_graphs_only(monkeypatch):
    """In a step's graph (:mod:`dtree.ops.backward_once`: the runtime's training calls) the lean MLP's
    down projection owns ``gate`` and ``up`` and writes their gradients over them; in a user's own
    forward through a model that keeps the lean layers it does not, so ``backward(retain_graph=True)``
    twice gives the same gradients twice."""
    model = make_model("qwen2", tied=True)
    owned: list[bool] = []
    original = lean_layers.swiglu_down
    monkeypatch.setattr(lean_layers, "swiglu_down",
                        lambda *a, **kw: owned.append(kw.get("inputs_owned", False)) or original(*a, **kw))
    run_dtree(copy.deepcopy(model), copy_model=False, mode="retain", group_tokens=8)
    assert owned and all(owned)
    owned.clear()
    mine, _ = lean(model)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    loss = mine(input_ids=ids).logits.float().square().mean()
    first = torch.autograd.grad(loss, list(mine.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(mine.parameters()))
    assert owned and not any(owned)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_the_runtime_runs_lean_layers_during_its_steps_only(mode):
    """By default (``lean_layers=True``) every forward of a dtree step runs the lean
    modules, gradients stay exact against the unpatched model per path, and the model
    is the user's own again after the step; ``lean_layers=False`` leaves it alone."""
    model = make_model("qwen2", tied=True)
    ref_model, ref_loss = reference(model)
    tree_model = copy.deepcopy(model)
    seen = _lean_seen(tree_model)
    out, _ = run_dtree(tree_model, copy_model=False, mode=mode, group_tokens=8)
    assert seen and all(seen), seen
    assert not lean_layers.lean_layers_applied(tree_model)
    assert not any("forward" in vars(m) for m in tree_model.modules())
    assert_exact(tree_model, ref_model, out, ref_loss)

    plain = copy.deepcopy(model)
    seen = _lean_seen(plain)
    run_dtree(plain, copy_model=False, mode=mode, group_tokens=8, lean_layers=False)
    assert seen and not any(seen)


def test_the_step_runs_dtrees_rotary_and_puts_hfs_back(monkeypatch):
    """During the scope HF's ``apply_rotary_pos_emb`` global is dtree's (one kernel each
    way), put back after it, also after an error; a runtime step goes through it and
    stays exact against HF per path."""
    from transformers.models.qwen2 import modeling_qwen2

    original = modeling_qwen2.apply_rotary_pos_emb
    model = make_model("qwen2", tied=True)
    with lean_layers.lean_layers_during(model) as info:
        assert info.rotary and "rotary" in info.describe()
        assert modeling_qwen2.apply_rotary_pos_emb is not original
        assert modeling_qwen2.apply_rotary_pos_emb._dtree_lean
    assert modeling_qwen2.apply_rotary_pos_emb is original
    with pytest.raises(RuntimeError, match="inside"):
        with lean_layers.lean_layers_during(model):
            raise RuntimeError("inside")
    assert modeling_qwen2.apply_rotary_pos_emb is original

    calls = []
    supported = lean_layers.rotary_supported
    monkeypatch.setattr(lean_layers, "rotary_supported", lambda *a: calls.append(1) or supported(*a))
    ref_model, ref_loss = reference(model)
    out, tree_model = run_dtree(model, mode="retain", group_tokens=8)
    assert len(calls) >= model.config.num_hidden_layers
    assert modeling_qwen2.apply_rotary_pos_emb is original
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_lean_layers_during_keeps_the_callers_and_restores_after_an_error():
    model = make_model("llama")
    applied = lean_layers.apply_lean_layers(copy.deepcopy(model))
    with lean_layers.lean_layers_during(model) as info:
        assert info == dataclasses.replace(applied, rotary=True) and lean_layers.lean_layers_applied(model)
    assert not lean_layers.lean_layers_applied(model)
    with pytest.raises(RuntimeError, match="inside"):
        with lean_layers.lean_layers_during(model):
            raise RuntimeError("inside")
    assert not lean_layers.lean_layers_applied(model)
    lean_layers.apply_lean_layers(model)  # the caller's own: kept after the block
    with lean_layers.lean_layers_during(model) as info:
        assert info is None
    assert lean_layers.lean_layers_applied(model)
    with lean_layers.lean_layers_during(make_model("llama"), enabled=False) as info:
        assert info is None


def test_lean_layers_during_keeps_forwards_patched_by_someone_else():
    """A module whose ``forward`` the user patched (here: the float64 golden model's
    norms) keeps that forward during the block and after it; the MLPs still go lean."""
    from hf_models import make_golden_model

    model = make_golden_model("qwen2")
    patched = {m: vars(m)["forward"] for m in model.modules() if "forward" in vars(m)}
    assert patched
    with lean_layers.lean_layers_during(model) as info:
        assert info.norms == 0 and info.mlps == 2
        assert all(vars(m)["forward"] is f for m, f in patched.items())
    assert {m: vars(m)["forward"] for m in model.modules() if "forward" in vars(m)} == patched


def test_lean_layers_during_leaves_compiled_layers_alone():
    model = make_model("qwen3")
    dtree.compile_layers(model)
    with lean_layers.lean_layers_during(model) as info:
        assert info is None and not lean_layers.lean_layers_applied(model)


def test_compiled_layers_run_the_lean_modules_eagerly_and_stay_exact():
    """Lean layers applied, then ``dtree.compile_layers``: the lean forwards are opaque to
    dynamo (a graph break each), so the compiled layers run them as they are and the
    gradients match HF per path."""
    model = make_model("qwen2", tied=True)
    ref_model, ref_loss = reference(model)
    patched, _ = lean(model)
    dtree.compile_layers(patched)
    seen = _lean_seen(patched)
    out, tree_model = run_dtree(patched, copy_model=False, chunk_size=2)
    assert seen and all(seen)
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_a_failed_step_gives_the_model_its_own_layers_back():
    model = make_model("mistral")
    forest = dtree.Forest.from_sequences(SEQS)
    rt = dtree.TreeRuntime(model, chunk_size=2)

    def bad_loss(logprobs, forest):
        raise RuntimeError("the loss failed")

    with pytest.raises(RuntimeError, match="the loss failed"):
        rt.forward_backward(forest, bad_loss)
    assert not lean_layers.lean_layers_applied(model)


# --------------------------------------------------------------------------- interpreter
def _case_runtime_exact(arch: str, scope: bool):
    """``scope``: the runtime's own lean scope (with dtree's rotary kernel), else the
    caller's ``apply_lean_layers`` (HF's rotary)."""
    from dtree.ops.rms_norm import interface as rms_norm
    from dtree.ops.swiglu import triton_kernels as swiglu_triton

    assert swiglu_triton._INTERPRET and rms_norm.load_triton_kernels(torch.zeros(1)) is not None
    model = make_model(arch)
    ref_model, ref_loss = reference(model)
    patched = copy.deepcopy(model) if scope else lean(model)[0]
    out, tree_model = run_dtree(patched, copy_model=False, mode="retain", group_tokens=8)
    assert_exact(tree_model, ref_model, out, ref_loss)


worker = worker_fixture("test_lean_layers")


@pytest.mark.parametrize("arch,scope", [("qwen3", False), ("llama", True)])
def test_triton_kernels_end_to_end(worker, arch, scope):
    worker.run("runtime_exact", arch=arch, scope=scope)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_compiled_lean_layers_by_the_flash_rule():
    """On CUDA the lean kernels are Triton launches, which dynamo failed to trace with
    dynamic shapes (``dtree bench --compile`` on the H100, session F): compiled layers
    call them eagerly, and bf16 training stays within the flash-attention rule."""
    from reference import linearized_step

    base = make_model("qwen2", tied=True).cuda()
    exact, bf16_ref = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16)
    model = copy.deepcopy(base).to(torch.bfloat16)
    exact_loss, _ = linearized_step(exact, SEQS)
    bf16_loss, _ = linearized_step(bf16_ref, SEQS)
    lean_layers.apply_lean_layers(model)
    dtree.compile_layers(model)
    out = dtree.TreeRuntime(model, chunk_size=2).forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert_model_flash_rule(model, exact, bf16_ref, out.loss, exact_loss, bf16_loss, "qwen2 lean compiled")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_gpu_bf16_flash_rule_end_to_end(arch):
    """bf16 dtree on the lean model against the unpatched model per path: every
    gradient's error vs the float32 per-path reference at most 3x (loss: 2x) that of the
    unpatched bf16 model per path, plus a floor."""
    from reference import linearized_step

    base = make_model(arch, tied=arch == "qwen2").cuda()
    exact = copy.deepcopy(base)
    bf16_ref = copy.deepcopy(base).to(torch.bfloat16)
    model = copy.deepcopy(base).to(torch.bfloat16)
    exact_loss, _ = linearized_step(exact, SEQS)
    bf16_loss, _ = linearized_step(bf16_ref, SEQS)
    lean_layers.apply_lean_layers(model)
    out = dtree.TreeRuntime(model, chunk_size=2).forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert_model_flash_rule(model, exact, bf16_ref, out.loss, exact_loss, bf16_loss, f"{arch} lean")
