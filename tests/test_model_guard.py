"""The model-side guard (dtree/models/guard.py, probe.py, families.py): nothing a
transformers model does outside dtree's view may make dtree silently wrong.

Each check is provoked on a model that is otherwise exact (a tiny Llama), by the
change it must catch: an attention layer that bypasses the attention interface (on
every call path: one childless call, one segment per call, log-probs), K/V shapes
other than the config's, logits post-processed in ``forward``, tokens mixed outside
attention. Refusals are ValueErrors that name the model class and leave ``param.grad``
untouched. Then: the family adapters leave the model's own forward unchanged outside
dtree, the attention callback reaches layers that drop ``**kwargs`` and checkpointed
recomputes (a context variable, not a keyword), and the probe runs once per placement.
Under layer recomputes (``checkpoint_layers``, ``memory="low"``, HF gradient
checkpointing), in the inference paths (log-probs, entropy) and in the baselines, the
guard, the adapters and the head transform keep every family exact.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from family_configs import small_config
from hf_models import make_model
from reference import grad_errors, linearized_step
from test_families import forest_sequences
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import eager_attention_forward

import dtree
from dtree.baselines import LinearizedTrainer
from dtree.models import probe
from dtree.ops.logprobs import as_output_head

SEQS = forest_sequences()
FOREST = dtree.Forest.from_sequences(SEQS)


def _bypass_interface(attention: torch.nn.Module) -> None:
    """Make one LlamaAttention compute its attention inline (HF's eager function called
    directly, with no mask: what a model that bypasses the interface does under dtree)."""
    original = attention.forward

    def forward(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        import transformers.models.llama.modeling_llama as llama

        interface = llama.ALL_ATTENTION_FUNCTIONS  # shadow its lookup for this call only
        interface.get_interface = lambda name, default: eager_attention_forward
        try:
            return original(hidden_states, position_embeddings, attention_mask, **kwargs)
        finally:
            del interface.get_interface

    attention.forward = forward


@pytest.mark.parametrize(
    "call",
    [
        lambda rt: rt.forward_backward(FOREST, dtree.losses.nll()),
        lambda rt: rt.logprobs(FOREST),
    ],
    ids=["forward_backward", "logprobs"],
)
@pytest.mark.parametrize("group_tokens", [None, 0], ids=["one_call", "per_segment"])
def test_attention_that_bypasses_dtree_is_refused_on_every_call(call, group_tokens):
    """After a first exact step (the probe has run), layer 1 stops using the interface:
    every later model call (the whole forest in one childless call, or one segment per
    call, training or log-probs) raises, naming the attention class."""
    model = make_model("llama")
    rt = dtree.TreeRuntime(model, group_tokens=group_tokens)
    rt.forward_backward(FOREST, dtree.losses.nll())
    model.zero_grad(set_to_none=True)
    _bypass_interface(model.model.layers[1].self_attn)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: decoder layer 1 ran without dtree's attention.*"
                                         r"attention of LlamaAttention does not use transformers' attention interface"):
        call(rt)
    assert all(p.grad is None for p in model.parameters())


def test_kv_shapes_other_than_the_config_are_refused():
    model = make_model("llama")
    model.config.num_key_value_heads = 3  # the layers were built with 2
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: the attention of layer 0 \(LlamaAttention\) gives K of "
                                         r"\(2, 12\).*for K \(3, 12\)"):
        dtree.TreeRuntime(model).forward_backward(FOREST, dtree.losses.nll())
    assert all(p.grad is None for p in model.parameters())


class DoubledLogits(LlamaForCausalLM):
    """A causal LM whose forward post-processes the head's logits (as Granite does)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_logits_post_processed_in_forward_are_refused():
    torch.manual_seed(0)
    model = DoubledLogits(make_model("llama").config)
    with pytest.raises(ValueError, match=r"DoubledLogits post-processes its logits.*logit_scale=1"):
        dtree.TreeRuntime(model).forward_backward(FOREST, dtree.losses.nll())
    with pytest.raises(ValueError, match="DoubledLogits post-processes its logits"):
        LinearizedTrainer(model).forward_backward(FOREST, dtree.losses.nll())
    assert all(p.grad is None for p in model.parameters())


def test_known_logit_transforms_come_from_the_config():
    """Granite's logits_scaling, Cohere's logit_scale and Gemma2's final soft-capping
    become the head's transform (their exactness: tests/test_families.py)."""
    cases = {
        "granite": (dict(logits_scaling=4.0), 0.25, None),
        "cohere": (dict(logit_scale=0.5), 0.5, None),
        "gemma2": (dict(final_logit_softcapping=3.0), 1.0, 3.0),
    }
    for name, (config, scale, softcap) in cases.items():
        model = AutoModelForCausalLM.from_config(small_config(name, **config))
        head = as_output_head(dtree.TreeRuntime(model).model.dtree_output_layer())
        assert (head.logit_scale, head.final_softcap) == (scale, softcap), name


def test_tokens_mixed_outside_attention_are_refused():
    """A layer that mixes each token with the previous one outside attention (a causal
    convolution, as in hybrid models) leaks one packed sequence into the next."""
    model = make_model("llama")

    def shift_mix(module, args, output):
        return output + 0.5 * torch.roll(output, 1, dims=1)

    model.model.layers[0].mlp.register_forward_hook(shift_mix)
    with pytest.raises(ValueError, match="LlamaForCausalLM: .* packed after another one .* mixes tokens outside"):
        dtree.TreeRuntime(model).logprobs(FOREST)


def test_adapters_leave_the_model_unchanged_outside_dtree():
    """Bloom's adapter is installed on its class; outside a dtree call (in this thread
    and in another) the model computes exactly as before."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("bloom")).eval()
    twin = copy.deepcopy(model)
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    dtree.TreeRuntime(model).forward_backward(FOREST, dtree.losses.nll())
    assert type(model.transformer.h[0].self_attention).forward.__dtree_adapter__ is not None
    results = {}

    def own_forward():
        with torch.no_grad():
            results["thread"] = twin(input_ids=ids).logits

    thread = threading.Thread(target=own_forward)
    thread.start()
    thread.join()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert torch.equal(results["thread"], before)


@pytest.mark.parametrize("family", ["stablelm", "gptj"])
def test_callback_reaches_kwarg_dropping_layers_and_checkpointed_recomputes(family):
    """StableLM's decoder layers drop **kwargs (the callback is a context variable); the
    checkpointed baseline recomputes layers in backward, outside the model call (the
    context is captured); GPT-J runs through its adapter there too."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(family)).eval()
    ref = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref, SEQS)
    for method in (lambda m: dtree.TreeRuntime(m), lambda m: LinearizedTrainer(m, checkpoint=True)):
        trained = copy.deepcopy(model)
        out = method(trained).forward_backward(FOREST, dtree.losses.nll())
        errors = grad_errors(trained, ref)
        assert max(errors.values()) < 1e-5, (family, max(errors, key=errors.get))
        assert out.loss == pytest.approx(ref_loss, rel=1e-5)


def test_probe_runs_once_per_placement(monkeypatch):
    calls = []
    real = probe.check_model
    monkeypatch.setattr(probe, "check_model", lambda adapter, head: calls.append(head) or real(adapter, head))
    model = make_model("qwen2")
    rt = dtree.TreeRuntime(model)
    rt.forward_backward(FOREST, dtree.losses.nll())
    rt.logprobs(FOREST)
    assert len(calls) == 1
    model.to(torch.float64)
    rt.logprobs(FOREST)
    assert len(calls) == 2


def test_state_space_model_refused_at_construction():
    model = AutoModelForCausalLM.from_config(small_config("mamba"))
    with pytest.raises(ValueError, match="MambaForCausalLM has no attention"):
        dtree.TreeRuntime(model)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gptj", "bloom"])
def test_adapters_inside_compiled_layers(family):
    """``dtree.compile_layers`` compiles the decoder layers around an adapter (its attention call
    breaks the graph, as the registered function does): still exact."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(family)).eval()
    ref = copy.deepcopy(model)
    linearized_step(ref, SEQS)
    dtree.compile_layers(model)
    dtree.TreeRuntime(model).forward_backward(FOREST, dtree.losses.nll())
    errors = grad_errors(model, ref)
    assert max(errors.values()) < 1e-5, max(errors, key=errors.get)


# layer recomputes: dtree's own checkpointing (also what memory="low" picks) and HF's
RECOMPUTES = {
    "checkpoint_layers": (False, None, dict(checkpoint_layers=True)),
    "memory_low": (False, None, dict(memory="low")),
    "hf_non_reentrant": (True, False, {}),
    "hf_reentrant": (True, True, {}),
}


def _recomputing(model: torch.nn.Module, setting: str) -> tuple[torch.nn.Module, dict]:
    """``model`` in train mode with ``setting``'s layer recompute, and the runtime options."""
    hf, reentrant, options = RECOMPUTES.get(setting, (False, None, {}))  # "": none
    if hf:
        from test_checkpoint_layers import hf_checkpointing

        hf_checkpointing(model, reentrant)
    return model.train(), options


@pytest.mark.parametrize("setting", RECOMPUTES)
@pytest.mark.parametrize("family", ["llama", "gptj", "bloom", "opt"])
def test_layer_recomputes_keep_the_guard_and_adapters_exact(family, setting):
    """Checkpointed layers run again inside backward, after the model call's per-layer
    check: the re-run neither counts against it (no false refusal) nor loses the call
    (the context travels into HF's checkpoint function and dtree's), and the family
    adapters dispatch in the re-run. Exact against HF per path, several calls per step.
    (OPT: dtree's checkpointing finds its layers at ``model.decoder.layers``.)"""
    torch.manual_seed(0)
    overrides = dict(dropout=0.0) if family == "opt" else {}  # train mode: no draws, so the reference is exact
    model = AutoModelForCausalLM.from_config(small_config(family, **overrides)) if family != "llama" else make_model("llama")
    ref = copy.deepcopy(model).train()
    ref_loss, _ = linearized_step(ref, SEQS)
    model, options = _recomputing(model, setting)
    out = dtree.TreeRuntime(model, group_tokens=8, **options).forward_backward(FOREST, dtree.losses.nll())
    if not RECOMPUTES[setting][0]:
        assert out.metrics["memory_plan"]["checkpoint_layers"] == len(dtree.models.checkpointing.decoder_layers(model))
    errors = grad_errors(model, ref)
    assert max(errors.values()) < 1e-5, (family, setting, max(errors, key=errors.get))
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.parametrize("setting", ["checkpoint_layers", "hf_non_reentrant"])
def test_attention_that_bypasses_dtree_is_refused_under_layer_recomputes(setting):
    model, options = _recomputing(make_model("llama"), setting)
    _bypass_interface(model.model.layers[1].self_attn)
    with pytest.raises(ValueError, match=r"decoder layer 1 ran without dtree's attention.*LlamaAttention"):
        dtree.TreeRuntime(model, group_tokens=8, **options).forward_backward(FOREST, dtree.losses.nll())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family", ["gptj", "bloom", "granite"])
def test_logprobs_and_entropy_of_adapted_and_transformed_families(family):
    """The inference paths (rt.logprobs, rt.entropy, rt.logprobs_and_entropy) go through
    the guard, the adapters and the head's logit transform too: equal to the model's own
    forward on each sequence (Granite: logits_scaling)."""
    torch.manual_seed(0)
    overrides = dict(logits_scaling=4.0) if family == "granite" else {}
    model = AutoModelForCausalLM.from_config(small_config(family, **overrides)).eval()
    rt = dtree.TreeRuntime(model)
    lps, ents = rt.logprobs_and_entropy(FOREST, temperature=0.7)
    assert all(torch.equal(a, b) for a, b in zip(rt.logprobs(FOREST, temperature=0.7), lps))
    assert all(torch.equal(a, b) for a, b in zip(rt.entropy(FOREST, temperature=0.7), ents))
    with torch.no_grad():
        for seq, lp, ent in zip(SEQS, lps, ents):
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].double() / 0.7
            ref = torch.log_softmax(logits, -1)
            torch.testing.assert_close(lp.double(), ref.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["linearized", "tree-mask"])
def test_baselines_run_adapters_under_hf_checkpointing(method):
    """The baselines call the model through the same adapter: GPT-J's attention adapter
    and HF's checkpoint re-runs in backward, exact per path."""
    from dtree.baselines import make_method

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("gptj"))
    ref = copy.deepcopy(model).train()
    ref_loss, _ = linearized_step(ref, SEQS)
    model, _ = _recomputing(model, "hf_non_reentrant")
    out = make_method(method, model).forward_backward(FOREST, dtree.losses.nll())
    errors = grad_errors(model, ref)
    assert max(errors.values()) < 1e-5, (method, max(errors, key=errors.get))
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)


def test_probe_inside_the_step_scope_runs_the_models_own_attention():
    """The probe compares with the model's own forward; inside ``dtree_scope`` (the
    model's attention switched to dtree's for a whole step) it still runs the model's."""
    from dtree.models.hf import HFTreeModel

    adapter = HFTreeModel(make_model("qwen2"))
    with adapter.dtree_scope():
        adapter.dtree_output_layer()
        assert adapter.model.config._attn_implementation == "dtree"
    assert adapter.model.config._attn_implementation != "dtree"


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["default", "memory_low", "hf_non_reentrant"])
@pytest.mark.parametrize("family", ["granite", "gemma2", "bloom", "gptj"])
def test_families_in_bf16_on_cuda_by_the_flash_rule(family, setting, monkeypatch):
    """bf16 on CUDA, the default backends (fused Triton stack attention and LM head):
    the probe passes at its 16-bit tolerance, the fused head applies the config's logit
    transform (Granite's logits_scaling, Gemma 2's final soft-capping), the adapters
    (Bloom's ALiBi, GPT-J) run in the Triton attention, with and without layer
    recomputes. Every gradient's error against the float32 model per path is at most 3x
    (the loss's 2x) that of the bf16 model per path, plus a floor."""
    from dtree.ops.logprobs import fused_head as fh

    calls = []
    original = fh.token_logprobs_triton
    monkeypatch.setattr(fh, "token_logprobs_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    overrides = dict(logits_scaling=4.0) if family == "granite" else {}
    base = AutoModelForCausalLM.from_config(small_config(family, **overrides)).cuda()
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(3, 97, (120,), generator=gen).tolist()
    seqs = SEQS + [long, long[:60] + torch.randint(3, 97, (50,), generator=gen).tolist()]
    exact, bf16_ref = copy.deepcopy(base).train(), copy.deepcopy(base).to(torch.bfloat16).train()
    exact_loss, _ = linearized_step(exact, seqs)
    bf16_loss, _ = linearized_step(bf16_ref, seqs)
    model, options = _recomputing(copy.deepcopy(base).to(torch.bfloat16), setting if setting != "default" else "")
    out = dtree.TreeRuntime(model, chunk_size=64, **options).forward_backward(
        dtree.Forest.from_sequences(seqs), dtree.losses.nll()
    )
    assert calls, "the fused LM-head op did not run"
    assert abs(out.loss - exact_loss) <= 2 * abs(bf16_loss - exact_loss) + 1e-3 * max(1.0, abs(exact_loss))
    for (name, p), (_, e), (_, b) in zip(model.named_parameters(), exact.named_parameters(), bf16_ref.named_parameters()):
        err = (p.grad.float() - e.grad).abs().max().item()
        base_err = (b.grad.float() - e.grad).abs().max().item()
        assert err <= 3 * base_err + 1e-3 * max(1e-3, e.grad.abs().max().item()), (
            f"{family} {setting} {name}: dtree {err:.3e}, bf16 per path {base_err:.3e}"
        )
