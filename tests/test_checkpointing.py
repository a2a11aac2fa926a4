"""Checkpointed baselines (``checkpoint=True``, dtree/models/checkpointing.py; and under HF's
gradient checkpointing): the
same loss and every parameter gradient as HF run per path (tests/reference.py) and as
the unchecked baselines, and less activation memory held for backward."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import ARCHS, make_model
from nanogpt import NanoGPT, NanoGPTWithoutLayerList
from reference import grad_errors, linearized_step
from test_baselines import ALL_EDGE_SEQS, PER_PATH, assert_all_exact, run_methods
from test_runtime_memory import SavedBytes

import dtree
from dtree.baselines import LinearizedTrainer, TreeMaskTrainer, make_method
from dtree.models.checkpointing import CheckpointedLayer, checkpointed_layers, decoder_layers

CHECKPOINTED = {
    "tree-mask/ckpt": ("tree-mask", dict(checkpoint=True)),
    "tree-mask/split+ckpt": ("tree-mask", dict(max_tokens_per_batch=5, checkpoint=True)),
    "linearized/ckpt": ("linearized", dict(checkpoint=True)),
    "linearized/split+ckpt": ("linearized", dict(max_tokens_per_batch=7, checkpoint=True)),
}
UNCHECKED = {label.replace("ckpt", "plain"): (m, {**kw, "checkpoint": False}) for label, (m, kw) in CHECKPOINTED.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpointed_baselines_match_hf_per_path(arch):
    tied = arch in ("qwen2", "qwen3")
    ref, results = run_methods(make_model(arch, tied), ALL_EDGE_SEQS, configs=CHECKPOINTED)
    assert_all_exact(ref, results)
    for label, (out, _) in results.items():
        assert out.metrics["checkpoint"] is True, label


@pytest.mark.parametrize("kind", ["nll", "ppo"])
def test_checkpointed_equals_unchecked(kind):
    """Per-path fields (advantages, masks) and every parameter gradient: checkpointing
    changes what is kept, not what is computed."""
    seqs, fields = PER_PATH
    model = make_model("qwen2", tied=True)
    forest = dtree.Forest.from_sequences(seqs, **fields)
    loss = dtree.losses.nll() if kind == "nll" else dtree.losses.ppo_clip(clip_eps=0.1, kl_coef=0.05)
    for (label, (name, kw)), (_, (_, plain_kw)) in zip(CHECKPOINTED.items(), UNCHECKED.items()):
        a, b = copy.deepcopy(model), copy.deepcopy(model)
        out_a = make_method(name, a, **kw).forward_backward(forest, loss)
        out_b = make_method(name, b, **plain_kw).forward_backward(forest, loss)
        assert out_a.loss == pytest.approx(out_b.loss, rel=1e-6), label
        errs = grad_errors(a, b)
        assert max(errs.values()) < 1e-6, (label, errs)


def test_custom_tree_module_is_checkpointed():
    """A TreeModule with its blocks in a ModuleList (tests/nanogpt.py) against its own
    causal forward per path."""
    torch.manual_seed(0)
    model = NanoGPT()
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 7, 7, 7, 8], [4, 4]]
    forest = dtree.Forest.from_sequences(seqs)
    ref = copy.deepcopy(model)
    total = 0.0
    n_terms = sum(len(s) - 1 for s in seqs)
    for s in seqs:
        logits = ref(torch.tensor(s))
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s[1:])[:, None])
        loss_s = -lp.sum() / n_terms
        loss_s.backward()
        total += float(loss_s.detach())
    for cls in (TreeMaskTrainer, LinearizedTrainer):
        m = copy.deepcopy(model)
        out = cls(m, checkpoint=True).forward_backward(forest, dtree.losses.nll())
        assert out.loss == pytest.approx(total, rel=1e-5)
        errs = grad_errors(m, ref)
        assert max(errs.values()) < 1e-5, (cls.__name__, errs)


def test_layers_are_restored_and_hf_checkpointing_stays_off():
    model = make_model("llama")
    layers = decoder_layers(model)
    before = list(layers)
    with pytest.raises(RuntimeError, match="boom"):
        with checkpointed_layers(model):
            assert all(isinstance(layer, CheckpointedLayer) for layer in layers)
            with checkpointed_layers(model):  # nested: wrapped once
                assert not any(isinstance(layer.layer, CheckpointedLayer) for layer in layers)
            raise RuntimeError("boom")
    assert list(layers) == before
    assert not model.is_gradient_checkpointing
    # the model still runs as a plain HF model afterwards
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()


def test_model_without_a_layer_list_is_refused():
    class Flat(NanoGPTWithoutLayerList):
        def dtree_hidden_states(self, input_ids, position_ids, attend):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="ModuleList attribute named"):
        TreeMaskTrainer(Flat(), checkpoint=True)
    TreeMaskTrainer(Flat(), checkpoint=False)  # unchecked baselines do not need it


def _saved_peak(trainer, forest) -> int:
    model = trainer.module
    tracker = SavedBytes(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        trainer.forward_backward(forest, dtree.losses.nll("sum"))
    model.zero_grad(set_to_none=True)
    return tracker.peak


@pytest.mark.parametrize("cls", [TreeMaskTrainer, LinearizedTrainer])
def test_checkpointed_step_holds_less_activation_memory(cls):
    """Saved-tensor hooks see what autograd keeps between forward and backward: outside
    the checkpointed layers, and each layer's input."""
    torch.manual_seed(0)
    model = make_model("llama")
    prompt = torch.randint(0, 97, (160,)).tolist()
    seqs = [prompt + torch.randint(0, 97, (40,)).tolist() for _ in range(4)]
    forest = dtree.Forest.from_sequences(seqs)
    plain = _saved_peak(cls(model, checkpoint=False), forest)
    ckpt = _saved_peak(cls(model, checkpoint=True), forest)
    calls = cls(model).plan(forest)
    tokens = max(b.num_tokens for b in calls)
    config = model.config
    layer_inputs = config.num_hidden_layers * tokens * config.hidden_size * 4  # float32 [T, hidden] per layer
    assert layer_inputs <= ckpt < 0.5 * plain, (ckpt, layer_inputs, plain)


@pytest.mark.gpu
def test_checkpointed_baselines_on_cuda():
    """fp32 on CUDA: tree-mask on FlexAttention (whole and split) and linearized, each
    checkpointed, against HF per path; the recompute re-runs the same kernels."""
    from test_baselines import cuda_model

    model = cuda_model("qwen3", torch.float32)
    seqs = ALL_EDGE_SEQS
    ref_model = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref_model, seqs)
    forest = dtree.Forest.from_sequences(seqs)
    for name, kw in [("tree-mask", {}), ("tree-mask", dict(max_tokens_per_batch=5)), ("linearized", {})]:
        m = copy.deepcopy(model)
        out = make_method(name, m, checkpoint=True, **kw).forward_backward(forest, dtree.losses.nll())
        assert out.metrics["checkpoint"] is True
        if name == "tree-mask":
            assert out.metrics["attention"] == "flex"
        errs = grad_errors(m, ref_model)
        assert max(errs.values()) < 1e-3, (name, kw, errs)
        assert abs(out.loss - ref_loss) < 1e-4, (name, kw)


@pytest.mark.gpu
def test_checkpointed_tree_mask_holds_less_on_cuda():
    """bf16 tree-mask (FlexAttention) on a 4k-token tree, 8 layers: the checkpointed
    step's peak is lower (it keeps one [T, hidden] input per layer and one layer's
    internals)."""
    from hf_models import make_config
    from transformers import AutoModelForCausalLM

    config = make_config("llama")
    config.head_dim, config.num_hidden_layers = 64, 8
    config.vocab_size = 4096  # the prompt's ids run to 2047
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    prompt = list(range(1, 2048))
    forest = dtree.Forest.from_sequences([prompt + [90 - b] * 512 for b in range(4)])
    peaks = {}
    for ckpt in (False, True):
        trainer = TreeMaskTrainer(model, checkpoint=ckpt)
        trainer.forward_backward(forest, dtree.losses.nll())  # compile and warm up outside the window
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        trainer.forward_backward(forest, dtree.losses.nll())
        torch.cuda.synchronize()
        peaks[ckpt] = torch.cuda.max_memory_allocated() - base
        model.zero_grad(set_to_none=True)
    assert peaks[True] < 0.6 * peaks[False], peaks


@pytest.mark.parametrize("method", ["tree-mask", "linearized"])
def test_baselines_under_hf_gradient_checkpointing(method):
    """HF's own checkpointing re-runs the layers in backward through the adapter's
    attention (the baselines hold its scope over backward too): exact per path."""
    model = make_model("llama")
    ref_model = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref_model, ALL_EDGE_SEQS)
    m = copy.deepcopy(model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    out = make_method(method, m).forward_backward(dtree.Forest.from_sequences(ALL_EDGE_SEQS), dtree.losses.nll())
    assert max(grad_errors(m, ref_model).values()) < 1e-5
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
