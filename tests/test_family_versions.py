"""The family adapters under another transformers release than the one they were
written for (dtree/models/families.py): a method that moved onto transformers'
attention interface needs no adapter; one that changed otherwise is refused by name,
with the installed and the last tested transformers versions, before any compute.

The classes here stand in for a transformers release's attention classes: the adapter
registry keys them by module and class name, exactly as it keys the real ones."""

from __future__ import annotations

import pytest
import torch
import transformers

from dtree.models import families

_BLOOM = "transformers.models.bloom.modeling_bloom"
_GPTJ = "transformers.models.gptj.modeling_gptj"


def _attention_class(module: str, name: str, body: dict) -> type:
    cls = type(name, (torch.nn.Module,), body)
    cls.__module__ = module
    return cls


def test_renamed_parameters_are_refused_with_both_versions():
    def forward(self, hidden, residual, alibi, attention_mask):  # "hidden_states" renamed
        return hidden

    cls = _attention_class(_BLOOM, "BloomAttention", {"forward": forward})
    with pytest.raises(ValueError) as info:
        families.install(cls())
    message = str(info.value)
    assert "bloom" in message and "BloomAttention.forward" in message
    assert transformers.__version__ in message and families.LAST_TESTED_TRANSFORMERS in message


def test_vanished_method_without_the_interface_is_refused():
    def forward(self, hidden_states, position_embeddings):  # neither _attn nor the interface
        return hidden_states

    cls = _attention_class(_GPTJ, "GPTJAttention", {"forward": forward})
    with pytest.raises(ValueError, match=r"gptj: transformers .* changed GPTJAttention\._attn\b.*5\.23\.0"):
        families.install(cls())


def test_family_moved_onto_the_attention_interface_needs_no_adapter():
    def forward(self, hidden_states, position_embeddings):
        interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS  # noqa: F841 (the marker dtree reads)
        return hidden_states

    cls = _attention_class(_GPTJ, "GPTJAttention", {"forward": forward})
    module = cls()
    assert families.install(module) == []
    assert families.attention_dropout(module) is None  # treated like any interface layer
    assert "_attn" not in cls.__dict__


def test_unchanged_method_gets_the_adapter():
    def _attn(self, query, key, value, attention_mask=None):
        return query

    cls = _attention_class(_GPTJ, "GPTJAttention", {"_attn": _attn})
    assert families.install(cls()) == ["GPTJAttention"]
    assert getattr(cls.__dict__["_attn"], "__dtree_adapter__", None) is not None
    # outside a dtree call the original runs
    q = torch.ones(1)
    assert cls()._attn(q, q, q) is q


def test_installed_transformers_is_within_the_tested_range():
    """pyproject.toml bounds transformers to the releases CI runs; the adapters' last
    tested release is the newest of them."""
    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    last = tuple(int(x) for x in families.LAST_TESTED_TRANSFORMERS.split(".")[:2])
    assert major_minor <= last, f"transformers {transformers.__version__} is newer than dtree was tested with"
