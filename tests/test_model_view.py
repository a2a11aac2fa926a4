"""The model as a step reads it (:func:`dtree.plan.model_view.model_view`) and the attribute reads of the per-step
checks (:func:`dtree.models.instance_attrs.module_attr`): the same answers as ``module.parameters()`` and
``getattr``, without a second walk of the module tree or nn.Module's AttributeError for a missing name."""

from __future__ import annotations

import pytest
import torch

from dtree.models.instance_attrs import module_attr
from dtree.models.lean_layers import _compiled
from dtree.plan.model_view import model_view
from dtree.presets import build_model


class _Marked(torch.nn.Linear):
    gradient_checkpointing = False  # a class default, as transformers' GradientCheckpointingLayer has
    scale = property(lambda self: 2.0)


def _nested() -> torch.nn.Module:
    shared = torch.nn.Linear(4, 4)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), shared, _Marked(4, 4))
    outer = torch.nn.ModuleDict({"a": inner, "b": torch.nn.Sequential(shared, torch.nn.LayerNorm(4))})
    outer.register_parameter("empty", None)
    outer.b[1].weight.requires_grad_(False)
    return outer


@pytest.mark.parametrize("make", [_nested, lambda: build_model("tiny", dtype=torch.float32)], ids=["nested", "tiny"])
def test_view_parameters_are_module_parameters(make):
    """Every parameter once, in ``module.parameters()``'s order: shared and tied ones (the tiny model's embedding and
    head) where they first appear, frozen ones too, a None slot skipped."""
    module = make()
    view = model_view(module)
    assert [id(p) for p in view.parameters] == [id(p) for p in module.parameters()]
    assert view.modules == tuple(module.modules())


def test_hf_checkpointing_reads_the_instance_over_the_class_default():
    module = _nested()
    assert not model_view(module).hf_checkpointing
    marked = module["a"][2]
    marked.gradient_checkpointing = True
    assert model_view(module).hf_checkpointing
    module.eval()  # only a module in training mode checkpoints
    assert not model_view(module).hf_checkpointing


def test_module_attr_is_getattr_for_plain_attributes():
    m = _Marked(2, 2)
    m.flag = 3
    assert module_attr(m, "flag") == 3 == m.flag
    assert module_attr(m, "gradient_checkpointing", None) is False  # the class's
    assert module_attr(m, "missing", "default") == "default"
    assert module_attr(m, "training") is True
    m.eval()
    assert module_attr(m, "training") is False
    assert isinstance(module_attr(m, "scale"), property)  # not for properties: their descriptor, as documented


def test_compiled_modules_are_found_without_getattr():
    plain = torch.nn.Linear(2, 2)
    assert not _compiled(plain)
    compiled_in_place = torch.nn.Linear(2, 2)
    compiled_in_place.compile()
    assert _compiled(compiled_in_place)
    wrapper = torch.compile(torch.nn.Linear(2, 2))
    assert _compiled(wrapper)
    marked = torch.nn.Linear(2, 2)
    marked._dtree_compiled = True
    assert _compiled(marked)
