"""The backend registries (dtree/ops/backends.py): what ``auto`` picks per device, the
errors for unknown and unavailable names, and that the ops' dispatchers run the
registered functions. The choices are checked against the ones the runtime and the
baselines make on their own (``TreeRuntime._pick_backend``, ``LinearizedTrainer``,
``TreeMaskTrainer``), so a call site can switch to :func:`resolve_backend` unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import make_model

import dtree
from dtree.baselines import LinearizedTrainer, TreeMaskTrainer
from dtree.baselines.kernels import tree_mask_attention as tm
from dtree.baselines.kernels import varlen_attention as va
from dtree.baselines.kernels import varlen_interface as vi
from dtree.baselines.kernels.tree_mask_attention import TreeMaskLayout, tree_mask_attention, tree_mask_attention_sdpa
from dtree.baselines.kernels.varlen_attention import VarlenLayout, varlen_attention_reference
from dtree.baselines.kernels.varlen_interface import varlen_attention
from dtree.ops import backends, registry
from dtree.ops.registry import backend_names
from dtree.ops.stack_attention import (
    BACKENDS as STACK_BACKENDS,
)
from dtree.ops.stack_attention import (
    AttentionOptions,
    SegmentLayout,
    StackSlots,
    stack_attention,
    stack_attention_reference,
    stack_attention_sdpa,
)
from dtree.ops.stack_ops.kv_stack import KVStack

REGISTRIES = {"stack_attention": STACK_BACKENDS, "varlen_attention": vi.BACKENDS, "tree_mask_attention": tm.BACKENDS}
OPS = tuple(REGISTRIES)


def resolve_backend(op, name, device, dtype=None, **target):
    return REGISTRIES[op].resolve(name, device, dtype, **target)


def implementation(op, name):
    return REGISTRIES[op].function(name)


def test_names():
    assert STACK_BACKENDS.names() == backend_names("stack_attention") == ("reference", "sdpa", "triton", "flash-attn")
    assert vi.BACKENDS.names() == ("reference", "sdpa", "flash", "flash-attn")
    assert tm.BACKENDS.names() == ("sdpa", "flex")
    assert backend_names("linear_recurrence") == ("reference", "chunked", "fla")
    with pytest.raises(ValueError, match="unknown op 'attention'"):
        backend_names("attention")
    assert registry.resolve_backend("stack_attention", "auto", "cpu") == "sdpa"


@pytest.mark.parametrize("op", OPS)
def test_auto_on_cpu_is_sdpa(op):
    assert resolve_backend(op, "auto", "cpu", torch.float32, num_heads=4, num_kv_heads=2, head_dim=8) == "sdpa"
    assert resolve_backend(op, "auto", torch.device("cpu")) == "sdpa"


@pytest.mark.parametrize("op", OPS)
def test_unknown_name(op):
    with pytest.raises(ValueError, match=r"attention must be 'auto' or one of \("):
        resolve_backend(op, "flash9", "cpu")
    with pytest.raises(ValueError, match="backend 'flash9'; choose one of"):
        implementation(op, "flash9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU messages")
def test_unavailable_names_say_why_on_cpu():
    with pytest.raises(ValueError, match="attention='flash' needs torch.nn.attention.varlen.varlen_attn"):
        resolve_backend("varlen_attention", "flash", "cpu", torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="attention='flash-attn' needs the flash-attn package"):
        resolve_backend("varlen_attention", "flash-attn", "cpu", torch.bfloat16, head_dim=8)
    with pytest.raises(ValueError, match="attention='flex' trains on CUDA only"):
        resolve_backend("tree_mask_attention", "flex", "cpu")
    from dtree.ops.stack_attention import triton_autograd as sat

    if not sat._INTERPRET:
        with pytest.raises(ValueError, match="attention='triton' cannot run here: .*CUDA"):
            resolve_backend("stack_attention", "triton", "cpu", torch.float32)


def test_triton_rules_on_a_cuda_target(monkeypatch):
    """On a CUDA target where Triton runs (``require_triton`` stubbed to pass: no GPU
    here), ``auto`` takes Triton only for its dtypes and head dims, as the runtime's
    own choice does; an explicit ``triton`` outside them is a ValueError."""
    from dtree.ops.stack_attention import triton_autograd as sat

    monkeypatch.setattr(sat, "require_triton", lambda device: None)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert resolve_backend("stack_attention", "auto", "cuda", dtype, head_dim=256) == "triton"
    assert resolve_backend("stack_attention", "auto", "cuda", torch.float64, head_dim=64) == "sdpa"
    assert resolve_backend("stack_attention", "auto", "cuda", torch.bfloat16, head_dim=257) == "sdpa"
    with pytest.raises(ValueError, match="attention='triton' runs"):
        resolve_backend("stack_attention", "triton", "cuda", torch.float64)
    with pytest.raises(ValueError, match="head dims up to 256"):
        resolve_backend("stack_attention", "triton", "cuda", torch.bfloat16, head_dim=512)


def test_flash_preferences(monkeypatch):
    """``auto`` for the varlen op: flash-attn, then flash, then sdpa, on any device
    (the checks reject CPU themselves; a stand-in reported available is taken, as the
    baseline did); flex for the tree mask on CUDA (availability stubbed: no GPU here)."""
    shapes = dict(num_heads=4, num_kv_heads=2, head_dim=64)
    monkeypatch.setattr(va, "flash_attn_available", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(va, "flash_available", lambda *a: True)
    assert resolve_backend("varlen_attention", "auto", "cuda", torch.bfloat16, **shapes) == "flash-attn"
    assert resolve_backend("varlen_attention", "auto", "cpu", torch.bfloat16, **shapes) == "flash-attn"
    monkeypatch.setattr(va, "flash_attn_available", lambda device, dtype, head_dim: False)
    assert resolve_backend("varlen_attention", "auto", "cuda", torch.bfloat16, **shapes) == "flash"
    monkeypatch.setattr(va, "flash_available", lambda *a: False)
    assert resolve_backend("varlen_attention", "auto", "cuda", torch.bfloat16, **shapes) == "sdpa"
    assert resolve_backend("tree_mask_attention", "auto", "cuda") == "flex"


@pytest.mark.parametrize("attention", ["auto", "sdpa", "reference"])
def test_agrees_with_the_runtime_and_baselines_choices(attention):
    model = make_model("llama")
    spec = dtree.TreeRuntime(model).spec
    rt = dtree.TreeRuntime(model, attention=attention)
    rt.plan(dtree.Forest.from_sequences([[1, 2, 3]]))
    target = dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    assert rt.attention == resolve_backend("stack_attention", attention, "cpu", torch.float32, **target)
    assert LinearizedTrainer(model, attention=attention).attention == resolve_backend(
        "varlen_attention", attention, "cpu", torch.float32, **target
    )
    if attention != "reference":
        assert TreeMaskTrainer(model, attention=attention).attention == resolve_backend(
            "tree_mask_attention", attention, "cpu", torch.float32, **target
        )


def test_dispatchers_run_the_registered_functions():
    assert implementation("stack_attention", "sdpa") is stack_attention_sdpa
    assert implementation("stack_attention", "reference") is stack_attention_reference
    assert implementation("varlen_attention", "reference") is varlen_attention_reference
    assert implementation("tree_mask_attention", "sdpa") is tree_mask_attention_sdpa
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, h, 8, generator=gen) for h in (4, 2, 2))
    stack = KVStack(1, 20, 2, 8, dtype=torch.float32, device="cpu")
    stack.k.normal_(generator=gen)
    stack.v.normal_(generator=gen)
    layout = SegmentLayout(np.array([0, 4, 9]), np.array([5, 9]), [((0, 5),), ((0, 3),)])
    torch.testing.assert_close(
        stack_attention(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=0.3), "reference"),
        stack_attention_reference(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=0.3)),
    )
    varlen = VarlenLayout([0, 4, 9])
    torch.testing.assert_close(
        varlen_attention(q, k, v, varlen, 0.3, "reference"), varlen_attention_reference(q, k, v, varlen, 0.3)
    )
    tree = TreeMaskLayout([9] * 9)
    torch.testing.assert_close(
        tree_mask_attention(q, k, v, tree, 0.3, "sdpa"), tree_mask_attention_sdpa(q, k, v, tree, 0.3)
    )


def test_registry_imports_no_op_module():
    """The ops import the registry machinery, never the reverse (no import cycle)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(backends))
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(not (isinstance(n, ast.ImportFrom) and n.level) for n in top_level)
