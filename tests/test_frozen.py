"""Frozen parameters: a full fine-tune with the embeddings and layer 0 frozen (untied,
and tied so the head is frozen too), only the LM head trainable, only the last MLP
trainable; against HF per path, every parameter, all modes and group budgets. A model
with nothing to train, and trainable parts only some tokens reach, get clear errors."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_models import make_model
from nanogpt import NanoGPT
from setups import GROUP_TOKENS, MODES, SEQS, assert_exact, reference, run_dtree

import dtree


def freeze(model, trainable) -> torch.nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    return model


SETUPS = {
    # layer 0 and the embeddings frozen: layer 0's K/V have no graph, layer 1's do
    "embed_and_layer0": lambda: freeze(make_model("llama"), lambda n: not ("embed" in n or "layers.0." in n)),
    # tied: freezing the embeddings freezes the head too
    "embed_and_layer0_tied": lambda: freeze(
        make_model("qwen2", tied=True), lambda n: not ("embed" in n or "layers.0." in n)
    ),
    # no K/V of any layer needs grad: only the loss is backpropagated
    "head_only": lambda: freeze(make_model("mistral"), lambda n: n.startswith("lm_head")),
    "last_mlp_only": lambda: freeze(make_model("qwen3"), lambda n: "layers.1.mlp" in n),
}


@functools.cache
def setup(kind: str):
    model = SETUPS[kind]()
    return model, *reference(model)


@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(SETUPS))
def test_frozen_parts_match_per_path(kind, mode, group_tokens):
    model, ref_model, ref_loss = setup(kind)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=group_tokens)
    assert_exact(tree_model, ref_model, out, ref_loss)
    assert all(p.grad is None for p in tree_model.parameters() if not p.requires_grad)


def test_nothing_trainable_is_an_error():
    model = freeze(make_model("llama"), lambda n: False)
    rt = dtree.TreeRuntime(model)
    with pytest.raises(ValueError, match="no parameter of the model requires grad"):
        rt.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert rt.stack is None  # refused before anything was allocated
    rt.logprobs(dtree.Forest.from_sequences(SEQS))  # inference needs no trainable parameter


class TokenGatedGPT(NanoGPT):
    """Trainable only through ``extra``, which the model adds when token 0 is in the
    call: whether K/V need grad depends on the data."""

    def __init__(self):
        super().__init__()
        self.requires_grad_(False)
        self.extra = torch.nn.Parameter(torch.randn(self.d))

    def dtree_hidden_states(self, input_ids, position_ids, attend):
        x = self.wte(input_ids) + self.wpe(position_ids)
        if bool((input_ids == 0).any()):
            x = x + self.extra
        scale = (self.d // self.heads) ** -0.5
        for i, b in enumerate(self.blocks):
            x = b(x, lambda q, k, v, i=i: attend(i, q, k, v, scale))
        return self.ln_f(x)


def test_data_dependent_trainable_path_is_an_error():
    torch.manual_seed(0)
    model = TokenGatedGPT()
    forest = dtree.Forest.from_sequences([[0, 1, 2, 3], [0, 1, 2, 4, 5]])  # the root has token 0, the rest not
    with pytest.raises(ValueError, match="K/V need gradients differ between model calls"):
        dtree.TreeRuntime(model, chunk_size=2, group_tokens=0).forward_backward(forest, dtree.losses.nll())
    assert model.extra.grad is None
