"""TreeRuntime under ``torch.autocast`` (bf16 over a float32 model, as accelerate's mixed
precision runs it): as accurate as HF per path under the same autocast, by the
flash-attention rule (dtree's gradient error against the float32 reference at most 3x
HF's own bf16 error, plus a floor), in every walk variant."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from reference import grad_errors, linearized_step
from setups import SEQS

import dtree


@pytest.mark.parametrize("kw", [dict(mode="retain"), dict(mode="recompute", chunk_size=3),
                                dict(group_tokens=0, chunk_size=3)], ids=["retain", "recompute", "node-by-node"])
def test_bf16_autocast_over_float32(kw):
    model = make_model("qwen2")
    ref32 = copy.deepcopy(model)
    linearized_step(ref32, SEQS)
    ref16 = copy.deepcopy(model)
    ref16.set_attn_implementation("sdpa")
    tree = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linearized_step(ref16, SEQS)
        dtree.TreeRuntime(tree, **kw).forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    hf_err, tree_err = grad_errors(ref16, ref32), grad_errors(tree, ref32)
    for name, err in tree_err.items():
        assert err <= 3 * hf_err[name] + 1e-4, f"{name}: {err:.2e} against HF's bf16 {hf_err[name]:.2e}"
    assert max(tree_err.values()) > 1e-4  # it ran in bf16 (float32 would be ~1e-6)
