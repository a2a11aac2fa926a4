"""End to end on CUDA: the fused Triton path (in-call subtrees, packed siblings,
chunk chains, recompute) against HF run on each path, every parameter gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from reference import grad_errors, linearized_step
from test_runtime_exact import EDGE_CASES

import dtree

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["retain", "recompute", "auto"])
@pytest.mark.parametrize("group_tokens", [0, 7, 4096])
def test_triton_runtime_matches_per_path_reference(mode, group_tokens):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    seqs = [s for case in EDGE_CASES.values() for s in case]
    seqs += [torch.randint(0, 97, (300,)).tolist()]
    seqs += [seqs[-1][:150] + torch.randint(0, 97, (90,)).tolist()]
    model = make_model("qwen2", tied=True).cuda()
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    rt = dtree.TreeRuntime(tree_model, mode=mode, attention="triton", chunk_size=64, group_tokens=group_tokens)
    out = rt.forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll("sum"))
    ref_loss, _ = linearized_step(ref_model, seqs, None, "nll", "sum")
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < 1e-4, errs  # fp32 kernels (no tf32), different summation order
    assert abs(out.loss - ref_loss) < 1e-4 * abs(ref_loss)
