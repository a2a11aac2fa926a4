"""Deterministic mode (dtree.ops.determinism): RuntimeConfig(deterministic=True) and
torch.use_deterministic_algorithms(True) route to backends with a deterministic backward,
refuse (or, under warn_only, warn about) one without, leave torch's setting as it was, and
give bitwise-identical gradients run after run. The GPU check on a real model is
benchmarks/csrc_gpu.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_models import make_model
from setups import CHUNK, SEQS

import dtree
from dtree.ops import determinism
from dtree.ops.linear_recurrence import BACKENDS as RECURRENCE_BACKENDS
from dtree.ops.registry import resolve_backend
from dtree.ops.stack_attention import BACKENDS as STACK_BACKENDS
from dtree.ops.stack_attention import AttentionOptions, StackSlots, stack_attention
from dtree.ops.stack_ops import interface as stack_ops


@pytest.fixture
def torch_mode():
    """Restore torch's deterministic setting after the test."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def triton_runs_here(monkeypatch):
    """The triton backend as if on a GPU, in a version without a deterministic backward."""
    monkeypatch.setitem(STACK_BACKENDS.unavailable, "triton", lambda target: None)
    monkeypatch.setitem(STACK_BACKENDS.nondeterministic, "triton", lambda target: "adds prefix dK/dV with float atomics")


def test_config_checks_the_flag():
    assert dtree.RuntimeConfig(deterministic=True).deterministic is True
    with pytest.raises(ValueError, match="deterministic must be True or False, got 'yes'"):
        dtree.RuntimeConfig(deterministic="yes")


def test_requested_follows_the_flag_and_torch(torch_mode):
    assert not determinism.requested() and determinism.requested(True)
    torch.use_deterministic_algorithms(True)
    assert determinism.requested(False)


def test_auto_skips_a_backend_without_a_deterministic_backward(triton_runs_here, torch_mode):
    assert resolve_backend("stack_attention", "auto", "cuda", torch.bfloat16) == "triton"
    assert resolve_backend("stack_attention", "auto", "cuda", torch.bfloat16, deterministic=True) == "sdpa"


def test_a_named_nondeterministic_backend_raises_or_warns_as_torch_does(triton_runs_here, torch_mode):
    with pytest.raises(RuntimeError, match=r"attention='triton' does not have a deterministic implementation.*float "
                       r"atomics.*use attention='auto'"):
        resolve_backend("stack_attention", "triton", "cuda", torch.bfloat16, deterministic=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
        assert resolve_backend("stack_attention", "triton", "cuda", torch.bfloat16, deterministic=True) == "triton"


def test_the_dispatcher_passes_deterministic_or_alerts(monkeypatch, torch_mode):
    """The dispatcher resolves ``options.deterministic`` (the flag or torch's setting)
    for the backend, and alerts for a backend registered without a deterministic
    backward."""
    seen = []
    monkeypatch.setitem(STACK_BACKENDS.functions, "reference", lambda q, k, v, slots, options: seen.append(options))
    slots = StackSlots(None, 0, None)
    stack_attention(torch.zeros(1), None, None, slots, AttentionOptions(scale=1.0), "reference")
    stack_attention(torch.zeros(1), None, None, slots, AttentionOptions(scale=1.0, deterministic=True), "reference")
    torch.use_deterministic_algorithms(True)
    stack_attention(torch.zeros(1), None, None, slots, AttentionOptions(scale=1.0), "reference")
    assert [o.deterministic for o in seen] == [False, True, True]
    monkeypatch.setitem(STACK_BACKENDS.nondeterministic, "reference", lambda target: "adds with float atomics")
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        stack_attention(torch.zeros(1), None, None, slots, AttentionOptions(scale=1.0), "reference")


def test_only_the_registered_backends_lack_a_deterministic_backward():
    assert set(STACK_BACKENDS.nondeterministic) == set()
    assert set(RECURRENCE_BACKENDS.nondeterministic) == {"fla"}


def test_missing_extension_is_noted_once_on_a_gpu_only(monkeypatch):
    monkeypatch.setitem(stack_ops._state, "noted", False)
    with stack_ops.extension_disabled():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stack_ops.note_missing_extension("cpu")  # nothing to say on CPU
        with pytest.warns(UserWarning, match="without the KV-stack CUDA extension.*pip install --no-build-isolation"):
            stack_ops.note_missing_extension("cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stack_ops.note_missing_extension("cuda")  # once


@pytest.mark.parametrize("how", ["config", "torch"])
def test_deterministic_runs_give_identical_gradients_equal_to_the_default(how, torch_mode):
    """CPU: the same bits in two deterministic runs, and the same bits as the default
    run (deterministic mode changes only the order of sums that CPU kernels fix anyway)."""
    grads = []
    forest = dtree.Forest.from_sequences(SEQS)
    for deterministic in (False, True, True):
        model = make_model("qwen2")
        config = dtree.RuntimeConfig(chunk_size=CHUNK, group_tokens=8, retain_budget_tokens=4)
        if how == "torch":
            torch.use_deterministic_algorithms(deterministic)
        else:
            config = config.replace(deterministic=deterministic)
        dtree.TreeRuntime(model, config=config).forward_backward(forest, dtree.losses.nll())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for run in grads[1:]:
        for name, g in grads[0].items():
            assert torch.equal(run[name], g), name


def test_recurrent_layers_in_deterministic_mode(monkeypatch, torch_mode):
    """Hybrid models: fla's kernels (not checked for a fixed order) are skipped by auto and
    refused when named; on CUDA the state ops need torch's own mode, else a RuntimeError."""
    from dtree.models import ModelSpec
    from dtree.ops.linear_recurrence import fla_backend as linear_recurrence_fla
    from dtree.plan.backend_choice import pick_recurrence

    monkeypatch.setattr(linear_recurrence_fla, "fla_unavailable", lambda target: None)  # as if installed on a GPU
    dense = ModelSpec(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=11)
    hybrid = ModelSpec(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=11,
                       layer_kv=(None, (1, 4, 4)), recurrent_states=((0, "recurrent", (2, 4, 4)),))
    cuda = (torch.device("cuda", 0), torch.bfloat16)
    assert pick_recurrence("auto", cuda, hybrid) == "fla"
    assert pick_recurrence("auto", cuda, dense, deterministic=True) is None  # nothing recurrent: nothing to refuse
    with pytest.raises(RuntimeError, match=r"recurrent layers on CUDA without torch.use_deterministic_algorithms"
                       r"\(True\) does not have a deterministic implementation"):
        pick_recurrence("auto", cuda, hybrid, deterministic=True)
    assert pick_recurrence("auto", (torch.device("cpu"), torch.float32), hybrid, deterministic=True) == "reference"
    torch.use_deterministic_algorithms(True)
    assert pick_recurrence("auto", cuda, hybrid, deterministic=True) == "chunked"  # torch ops
    with pytest.raises(RuntimeError, match=r"recurrence='fla' does not have a deterministic implementation.*"
                       r"summation order.*use recurrence='auto'"):
        pick_recurrence("fla", cuda, hybrid, deterministic=True)


def test_deterministic_hybrid_runs_give_identical_gradients(torch_mode):
    """CPU: a hybrid (its state stack, recurrences and convolutions) gives the same bits in
    deterministic runs as in the default run."""
    from test_families import build

    grads = []
    forest = dtree.Forest.from_sequences(SEQS)
    for deterministic in (False, True, True):
        model = build("qwen3_5_text")
        config = dtree.RuntimeConfig(chunk_size=CHUNK, group_tokens=8, retain_budget_tokens=4)
        dtree.TreeRuntime(model, config=config.replace(deterministic=deterministic)).forward_backward(
            forest, dtree.losses.nll()
        )
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0]
    for run in grads[1:]:
        assert run.keys() == grads[0].keys() and all(torch.equal(run[n], g) for n, g in grads[0].items())


@pytest.mark.gpu
def test_gpu_deterministic_runs_are_bitwise_identical_with_and_without_the_extension():
    """bf16 on CUDA, packed calls with in-call subtrees and recompute: two deterministic
    runs give the same bits, and the extension gives the same bits as the torch ops
    (every stack op is bitwise equal to its fallback)."""
    torch.manual_seed(0)
    seqs = [torch.randint(0, 97, (200,)).tolist()]
    seqs += [seqs[0][:120] + torch.randint(0, 97, (60,)).tolist() for _ in range(3)]
    seqs += [s[:150] + torch.randint(0, 97, (30,)).tolist() for s in seqs[1:]]
    forest = dtree.Forest.from_sequences(seqs)
    config = dtree.RuntimeConfig(chunk_size=64, group_tokens=128, retain_budget_tokens=64, deterministic=True)

    def run():
        model = make_model("qwen2", dtype=torch.bfloat16).cuda()
        dtree.TreeRuntime(model, config=config).forward_backward(forest, dtree.losses.nll())
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    first, second = run(), run()
    with stack_ops.extension_disabled():
        fallback = run()
    for name, g in first.items():
        assert torch.equal(second[name], g), name
        assert torch.equal(fallback[name], g), name
