"""A torch.compile'd model (and a compiled PeftModel) passed straight to TreeRuntime:
dtree runs the module inside (``_orig_mod``), gradients land in the parameters the
user's optimizer holds, exact against HF per path in every mode and group budget.
Anything that is not a causal LM gets a TypeError naming what dtree accepts."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hf_models import make_model
from setups import GROUP_TOKENS, MODES, assert_exact, reference, run_dtree

import dtree


@functools.cache
def setup():
    model = make_model("qwen3", tied=True, seed=7)
    return model, *reference(model)


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
def test_compiled_model_matches_per_path(mode, group_tokens):
    model, ref_model, ref_loss = setup()
    compiled = torch.compile(copy.deepcopy(model))
    out, _ = run_dtree(compiled, mode=mode, group_tokens=group_tokens, copy_model=False)
    assert_exact(compiled._orig_mod, ref_model, out, ref_loss)
    assert all(p.grad is not None for p in compiled.parameters())  # what an optimizer over it sees


def test_compiled_peft_model():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ref_model, ref_loss = reference(model)
    out, _ = run_dtree(torch.compile(model), group_tokens=8, copy_model=False)
    assert_exact(model, ref_model, out, ref_loss)


def test_not_a_causal_lm_is_a_type_error():
    from hf_models import make_config
    from transformers import AutoModel

    for bad in (torch.nn.Linear(3, 3), torch.compile(torch.nn.Linear(3, 3)), AutoModel.from_config(make_config("llama"))):
        with pytest.raises(TypeError, match="dtree accepts a transformers causal LM|has no LM head"):
            dtree.TreeRuntime(bad)
