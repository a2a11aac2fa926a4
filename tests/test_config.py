"""RuntimeConfig: one place that checks every TreeRuntime option; the keyword form builds it."""

from __future__ import annotations

import pytest
from hf_models import make_model

import dtree
from dtree.config import RuntimeConfig


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(mode="fast"), "mode must be one of"),
        (dict(attention="flash9"), "attention must be 'auto' or one of"),
        (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
        (dict(chunk_size=None), "chunk_size must be an integer >= 1, got None"),
        (dict(group_tokens=-1), "group_tokens must be an integer >= 0 or None"),
        (dict(logprob_chunk=2.5), "logprob_chunk must be an integer >= 1 or None"),
        (dict(stack_capacity=0), "stack_capacity must be an integer >= 1 or None"),
        (dict(retain_budget_tokens=-3), "retain_budget_tokens must be an integer >= 0 or None"),
        (dict(memory="lots"), "memory must be one of"),
        (dict(memory=True), "memory must be one of"),
        (dict(checkpoint_layers="yes"), "checkpoint_layers must be None"),
        (dict(progress=1), "progress must be True or False"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(**options)
    with pytest.raises(ValueError, match=message):  # the keyword form checks the same way
        dtree.TreeRuntime(make_model("llama"), **options)


def test_keyword_form_builds_the_config():
    model = make_model("llama")
    config = RuntimeConfig(mode="recompute", group_tokens=0, memory=2.0)
    assert dtree.TreeRuntime(model, mode="recompute", group_tokens=0, memory=2.0).config == config
    assert dtree.TreeRuntime(model, config=config).mode == "recompute"
    assert config.replace(mode="retain").mode == "retain" and config.mode == "recompute"
    with pytest.raises(ValueError, match="mode must be one of"):
        config.replace(mode="fast")
    with pytest.raises(ValueError, match="not both"):
        dtree.TreeRuntime(model, config=config, mode="retain")
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunksize'"):
        dtree.TreeRuntime(model, chunksize=3)


def test_compile_is_an_explicit_call():
    """TreeRuntime never recompiles the user's model in place: compile=True names the function."""
    with pytest.raises(ValueError, match=r"call dtree.compile_layers\(model\)"):
        dtree.TreeRuntime(make_model("llama"), compile=True)
