"""Liger-Kernel's fused layers (``dtree.models.fused``) keep dtree exact.

CPU: Liger's Triton kernels run under the interpreter (a worker subprocess,
``interpreter_worker``), with two shims for interpreter gaps that compiled Triton does
not have (float arguments as float32 scalars, see ``patch_interpreter``; Liger's
``libdevice`` ``rsqrt``/``tanh`` imports, which the interpreter leaves unimplemented,
replaced by ``tl.math`` versions). A model patched with :func:`apply_fused_kernels`
runs dtree's TreeRuntime and is compared, on the loss and every parameter gradient,
with the unpatched model trained on each path (HF, ``tests/reference.py``), float32,
relative error <= 1e-5; and a packed row whose positions restart (tree depths, batch 1)
gives the unpatched model's logits and gradients. Each case restores the transformers
modeling module afterwards (Liger patches it process-wide).

GPU (``-m gpu``): the same end to end in bf16 by the flash-attention rule, patched
dtree against the unpatched model per path in float32 / bf16.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("liger_kernel")
import triton.language as tl  # noqa: E402
from interpreter_worker import InterpreterWorker  # noqa: E402

import dtree  # noqa: E402
from dtree.models import fused  # noqa: E402

# Trees with several calls (chunk_size 2): branch points, a sequence that is a prefix of
# another, positions that are depths across the stack.
SEQS = [[1, 2, 3, 10], [1, 2, 3, 11, 4], [1, 2, 3, 12], [1, 2, 3, 13, 4, 4], [1, 2, 6], [4, 5], [4, 7, 8, 9, 3]]
FP32_TOL = 1e-5


def gemma_model(seed=0):
    """Tiny Gemma (GeGLU MLP, ``1 + weight`` RMSNorm, scaled embeddings)."""
    from transformers import AutoModelForCausalLM, GemmaConfig

    torch.manual_seed(seed)
    config = GemmaConfig(
        vocab_size=97, hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=4096, attn_implementation="eager",
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # Gemma's norms start at weight 0 (scale 1): move them off it
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.1)
    return model


def make(arch):
    from hf_models import make_model

    return gemma_model() if arch == "gemma" else make_model(arch)


@contextlib.contextmanager
def restored_modeling_module(model):
    """Undo Liger's process-wide patches of ``model``'s transformers modeling module."""
    module = sys.modules[type(model).__module__]
    saved = dict(vars(module))
    try:
        yield
    finally:
        for name in [n for n in vars(module) if n not in saved]:
            delattr(module, name)
        for name, value in saved.items():
            setattr(module, name, value)


# --------------------------------------------------------------------------- interpreted cases
@triton.jit
def _rsqrt(x):
    return tl.math.rsqrt(x)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


def _liger_on_interpreter():
    """Liger imports ``rsqrt``/``tanh`` from Triton's libdevice, which the interpreter
    does not implement (calls return None): give its kernels ``tl.math`` versions."""
    from liger_kernel.ops import geglu, layer_norm, rms_norm

    rms_norm.rsqrt = layer_norm.rsqrt = _rsqrt
    geglu.tanh = _tanh


def _case_runtime_exact(arch, mode):
    """dtree on the patched model == HF per path on the unpatched one, every gradient."""
    from reference import grad_errors, linearized_step

    _liger_on_interpreter()
    model = make(arch)
    ref = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref, SEQS)  # before any patch: Liger's rotary is process-wide
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())  # Qwen3: q/k norms too
    with restored_modeling_module(model):
        report = fused.apply_fused_kernels(model)
        assert report.model_type == model.config.model_type
        assert sum(n for name, n in report.modules.items() if "Norm" in name) == norms, report
        assert sum(n for name, n in report.modules.items() if "MLP" in name) == model.config.num_hidden_layers, report
        assert "apply_rotary_pos_emb" in report.module_globals, report
        forest = dtree.Forest.from_sequences(SEQS)
        out = dtree.TreeRuntime(model, attention="reference", chunk_size=2, mode=mode).forward_backward(
            forest, dtree.losses.nll()
        )
    errs = grad_errors(model, ref)
    worst = max(errs, key=errs.get)
    assert errs[worst] < FP32_TOL, f"{arch}: gradient of {worst} off by {errs[worst]:.2e}"
    assert abs(out.loss - ref_loss) <= FP32_TOL * max(1.0, abs(ref_loss)), (out.loss, ref_loss)


def _case_packed_row_positions():
    """One packed row, batch 1, positions restarting per sequence and jumping (tree
    depths): Liger's rotary reads the per-token cos/sin rows, so logits and gradients
    equal the unpatched model's."""
    _liger_on_interpreter()
    model = make("qwen2")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 9, 10, 11, 12, 13, 40, 41, 42, 0, 1, 2, 3]])
    want = ref(input_ids=ids, position_ids=pos).logits
    want.pow(2).mean().backward()
    with restored_modeling_module(model):
        fused.apply_fused_kernels(model)
        got = model(input_ids=ids, position_ids=pos).logits
        got.pow(2).mean().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _case_switches_and_restore():
    """rope/mlp off leave those alone; the restore helper puts the module back."""
    _liger_on_interpreter()
    import transformers.models.llama.modeling_llama as modeling

    original = modeling.apply_rotary_pos_emb
    model = make("llama")
    with restored_modeling_module(model):
        report = fused.apply_fused_kernels(model, rope=False, mlp=False)
        assert modeling.apply_rotary_pos_emb is original
        assert set(report.modules) == {"LigerRMSNorm"}, report
    assert modeling.apply_rotary_pos_emb is original and modeling.LlamaRMSNorm.__name__ == "LlamaRMSNorm"


# --------------------------------------------------------------------------- worker tests
@pytest.fixture(scope="module")
def worker():
    w = InterpreterWorker("test_fused")
    yield w
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_runtime_on_patched_model_is_exact(worker, arch):
    worker.run("runtime_exact", arch=arch, mode="retain")


def test_recompute_mode_on_patched_model_is_exact(worker):
    worker.run("runtime_exact", arch="qwen2", mode="recompute")


def test_rotary_takes_packed_rows_and_tree_depths(worker):
    worker.run("packed_row_positions")


def test_switches_and_restore(worker):
    worker.run("switches_and_restore")


# --------------------------------------------------------------------------- in process
def test_missing_liger_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        fused.apply_fused_kernels(make("llama"))


def test_unsupported_model_names_the_supported_types():
    with pytest.raises(ValueError, match="config.model_type"):
        fused.apply_fused_kernels(torch.nn.Linear(2, 2))
    model = make("llama")
    model.config.model_type = "not_a_model"
    with pytest.raises(ValueError, match="supported: .*qwen2"):
        fused.apply_fused_kernels(model)


def test_switches_follow_family_defaults():
    """A switch is on only where the caller and Liger's family default both want it; the
    loss kernels are always off."""
    fns = fused._liger_apply_functions()
    kw = fused._switches(fns["qwen2"], rms_norm=True, rope=True, mlp=True)
    assert kw == {"rms_norm": True, "swiglu": True, "rope": True, "cross_entropy": False,
                  "fused_linear_cross_entropy": False}
    assert fused._switches(fns["glm4"], True, True, True)["rope"] is False  # Liger's default for GLM-4
    assert fused._switches(fns["gemma"], True, True, False)["geglu"] is False
    granite = fused._switches(fns["granite"], True, True, True)
    assert granite["cross_entropy"] is False and granite["fused_linear_cross_entropy"] is False


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma"])
def test_gpu_bf16_flash_rule_end_to_end(arch):
    """bf16 dtree on the patched model against the unpatched model per path: every
    gradient's error vs the float32 per-path reference at most 3x (loss: 2x) that of the
    unpatched bf16 model per path, plus a floor."""
    from reference import linearized_step
    from setups import assert_model_flash_rule

    base = make(arch).cuda()
    exact = copy.deepcopy(base)  # float32 per path: the reference
    bf16_ref = copy.deepcopy(base).to(torch.bfloat16)  # the unpatched bf16 model per path
    model = copy.deepcopy(base).to(torch.bfloat16)
    exact_loss, _ = linearized_step(exact, SEQS)
    bf16_loss, _ = linearized_step(bf16_ref, SEQS)
    with restored_modeling_module(model):
        fused.apply_fused_kernels(model)
        out = dtree.TreeRuntime(model, chunk_size=2).forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert_model_flash_rule(model, exact, bf16_ref, out.loss, exact_loss, bf16_loss, f"{arch} fused")
