"""Checkpointed layers that keep their stack attention's outputs
(:mod:`dtree.ops.stack_attention.output_memo`): the re-run takes the forward's output and
log-sum-exp back instead of launching the attention forward again.

The Triton kernels run under the interpreter (a worker subprocess, see
``interpreter_worker.py``), in fp32: with the memo, a checkpointed attention's gradients
are bitwise those without it, and its forward kernel runs once instead of twice; a whole
runtime step with every layer checkpointed and outputs kept trains exactly as HF per
path. The policy's side (bytes and cost) is checked on CPU directly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interpreter_worker import worker_fixture
from setups import SEQS, assert_exact, reference, run_dtree

from dtree.models import ModelSpec
from dtree.ops.stack_attention.output_memo import OutputMemo, kept_bytes_per_token
from dtree.plan import memory_policy as mp
from dtree.plan.memory_probe import CallBytes

QWEN_1_5B = ModelSpec(num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, hidden_size=1536,
                      vocab_size=151936, intermediate_size=8960)
# the H100's measured figures with the lean layers (benchmarks/results/h100/session_g/vs_mask_final)
LEAN_H100 = CallBytes(1.5565e6, 0.0927e6, 28, 3072, "measured", 35.8e3, 52.3e3)


def _count_forwards(monkeypatch, module=None) -> list:
    """A list that grows by one at every attention forward ``module`` (default: the
    Triton backend's ``triton_autograd``) computes: ``_forward`` is patched to count."""
    if module is None:
        from dtree.ops.stack_attention import triton_autograd as module

    launches: list = []
    original = module._forward

    def counted(*args, **kwargs):
        launches.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "_forward", counted)
    return launches


def _check_keeping_is_bitwise(attend, problem, launches: list) -> None:
    """``attend(q, k, v, slots)`` under non-reentrant checkpointing, without and with its
    outputs kept for the re-run, on fresh ``problem()`` inputs ``(stack, slots, q, k, v)``:
    the forward runs twice without, once with, and every gradient (q, k, v, the stack's
    dK/dV) and the output are bit for bit the same."""
    from torch.utils.checkpoint import checkpoint

    grads = {}
    for keep in (False, True):
        stack, slots, q, k, v = problem()
        memo, runs = OutputMemo(), [0]

        def layer(q, k, v):
            if not keep:
                return attend(q * 1.0, k, v, slots)
            with memo.recording() if runs[0] == 0 else memo.replaying_scope():
                runs[0] += 1
                return attend(q * 1.0, k, v, slots)

        launches.clear()
        out = checkpoint(layer, q, k, v, use_reentrant=False)
        loss_dtype = torch.promote_types(out.dtype, torch.float32)
        weights = torch.linspace(-1, 1, out.numel(), dtype=loss_dtype, device=out.device).view_as(out)
        (out.to(loss_dtype) * weights).sum().backward()
        grads[keep] = [x.grad.clone() for x in (q, k, v)] + [stack.grad_k.clone(), stack.grad_v.clone(), out.detach()]
        assert len(launches) == (1 if keep else 2), (keep, len(launches))
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def _problem(lens, prefixes, used, hq, hkv, d, **kw):
    """Fresh ``(stack, slots, q, k, v)`` of a layout (``test_stack_attention_triton``'s helpers)."""
    from test_stack_attention_triton import layout_of, make_problem

    from dtree.ops.stack_attention import StackSlots

    layout, t = layout_of(lens, prefixes, used)
    stack, q, k, v = make_problem(layout, t, used, hq, hkv, d, **kw)
    return stack, StackSlots(stack, 0, layout), q, k, v


# --------------------------------------------------------------------------- interpreter
def _case_checkpointed_attention_is_bitwise_and_runs_forward_once():
    from dtree.ops.stack_attention import stack_attention

    mp_ = pytest.MonkeyPatch()
    launches = _count_forwards(mp_)
    _check_keeping_is_bitwise(
        lambda q, k, v, slots: stack_attention(q, k, v, slots, backend="triton"),
        lambda: _problem([37, 20, 29], [[(0, 40)], [(0, 40)], [(0, 25), (30, 61)]], 61, 4, 2, 16, seed=3), launches,
    )
    mp_.undo()


def _case_runtime_step_keeping_outputs_is_exact(arch: str, offload: bool = False):
    from hf_models import make_model

    from dtree.plan import memory_policy

    mp_ = pytest.MonkeyPatch()
    launches = _count_forwards(mp_)
    cpu_plan = memory_policy._cpu_plan
    mp_.setattr(memory_policy, "_cpu_plan",
                lambda *a, **kw: dataclasses.replace(cpu_plan(*a, **kw), keep_attention_outputs=True))
    model = make_model(arch)
    ref_model, ref_loss = reference(model)
    kw = {"attention": "triton", "checkpoint_layers": True, "group_tokens": 8, "mode": "retain",
          "offload_checkpoints": offload}
    out, tree_model = run_dtree(model, **kw)
    assert_exact(tree_model, ref_model, out, ref_loss)
    assert out.metrics["memory_plan"]["keep_attention_outputs"] is True
    assert out.metrics["memory_plan"]["offload_checkpoints"] is offload
    kept = len(launches)
    launches.clear()
    mp_.setattr(memory_policy, "_cpu_plan", cpu_plan)
    run_dtree(model, **kw)
    assert 0 < kept and len(launches) == 2 * kept, (kept, len(launches))  # every forward ran again in backward
    mp_.undo()


worker = worker_fixture("test_output_memo")


def test_checkpointed_attention_keeping_outputs_is_bitwise_and_runs_forward_once(worker):
    worker.run("checkpointed_attention_is_bitwise_and_runs_forward_once")


@pytest.mark.parametrize("arch,offload", [
    ("llama", False), pytest.param("qwen2", False, marks=pytest.mark.slow), ("qwen2", True),  # ~22 s each on CI
])
def test_runtime_step_keeping_attention_outputs_is_exact_per_path(worker, arch, offload):
    """``offload``: the outputs wait in the layers' host groups with their inputs (clones on CPU)."""
    worker.run("runtime_step_keeping_outputs_is_exact", arch=arch, offload=offload)


# --------------------------------------------------------------------------- CPU
def test_region_attention_keeping_outputs_is_bitwise_and_runs_forward_once(monkeypatch):
    """The flash-attn backend's region path (here with its pure-torch region kernel, in
    float64 on CPU) keeps and takes back its merged output and LSE the same way."""
    from dtree.ops.stack_attention import regions

    _check_keeping_is_bitwise(
        regions.stack_attention_regions,
        lambda: _problem([37, 20, 29], [[(0, 40)], [(0, 40)], [(0, 25), (30, 61)]], 61, 4, 2, 16,
                         dtype=torch.float64, seed=3),
        _count_forwards(monkeypatch, regions),
    )


def test_a_replay_past_the_recorded_calls_is_refused():
    memo = OutputMemo()
    with memo.recording():
        memo.record(torch.zeros(3, 2, 4), torch.zeros(2, 3))
    with memo.replaying_scope():
        out, lse = memo.take((3, 2, 4), (2, 3), torch.float32)
        assert out.shape == (3, 2, 4) and lse.shape == (2, 3)
        with pytest.raises(RuntimeError, match="made attention call 2, but its forward recorded 1"):
            memo.take((3, 2, 4), (2, 3), torch.float32)
    with memo.replaying_scope(), pytest.raises(RuntimeError, match="asked for an attention output"):
        memo.take((4, 2, 4), (2, 4), torch.float32)


def test_outputs_kept_on_the_host_come_back_once_and_the_same():
    """With a host group the memo puts each output in the layer's unit and takes it back
    through the group: the same bits, taken once (a second backward is refused)."""
    from dtree.models.host_checkpoints import HostCheckpoints

    group, memo = HostCheckpoints(), None
    out, lse = torch.randn(3, 2, 4, dtype=torch.bfloat16), torch.randn(2, 3)
    with group.unit():
        group.put(torch.randn(3, 8))  # the layer's input
        memo = OutputMemo(group)
        with memo.recording():
            memo.record(out, lse)
    assert [len(unit) for unit in group._units] == [3]  # one prefetch brings the layer's three back
    originals = out.clone(), lse.clone()
    out.zero_(), lse.zero_()
    with memo.replaying_scope():
        back = memo.take((3, 2, 4), (2, 3), torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(back, originals))
    with memo.replaying_scope(), pytest.raises(RuntimeError, match="asked for twice"):
        memo.take((3, 2, 4), (2, 3), torch.bfloat16)


def test_the_low_recipe_keeps_outputs_with_its_inputs_on_the_host():
    """Offloaded, the kept outputs cost two layers' worth on the device: `low`'s recipe keeps
    them where the backend can, for a cheaper plan and ~0.07 GiB (12k-token calls)."""
    shape = mp.StepShape(65_600, 9_836, 9_000, 0, 65_600 * 6_000.0)
    kw = {"on_cuda": True, "available": 72 * 2**30, "expandable_segments": True, "allocated": 2.94 * 2**30,
          "call_bytes": LEAN_H100, "fused_head": True, "setting": "low", "offload": True}
    plain = mp.plan_step(QWEN_1_5B, 2, shape, can_keep_attention=False, **kw)
    kept = mp.plan_step(QWEN_1_5B, 2, shape, can_keep_attention=True, **kw)
    assert kept.keep_attention_outputs and not plain.keep_attention_outputs
    assert kept.offload_checkpoints and kept.group_tokens == plain.group_tokens
    assert kept.predicted_cost < 0.95 * plain.predicted_cost
    per_token = kept_bytes_per_token(12, 128, 2)
    extra = kept.predicted_peak_bytes - plain.predicted_peak_bytes
    assert 0 < extra <= 2 * per_token * kept.group_tokens * 1.01, extra  # two layers' outputs, not 28
    on_device = mp.plan_step(QWEN_1_5B, 2, shape, can_keep_attention=True, **{**kw, "offload": False})
    assert not on_device.keep_attention_outputs  # the recipe keeps none on the device


def test_the_policy_keeps_outputs_when_it_pays_and_counts_their_bytes():
    spec = QWEN_1_5B
    shape = mp.StepShape(65_600, 9_836, 9_000, 0, 65_600 * 6_000.0)  # the 64k agentic tree, ~6k keys a token
    h100 = dict(on_cuda=True, available=72 * 2**30, expandable_segments=True, allocated=2.94 * 2**30,
                call_bytes=LEAN_H100, fused_head=True)
    capped = mp.plan_step(spec, 2, shape, setting=14.5, can_keep_attention=True, **h100)
    plain = mp.plan_step(spec, 2, shape, setting=14.5, can_keep_attention=False, **h100)
    assert capped.checkpoint_layers > 0 and capped.keep_attention_outputs, capped.describe()
    assert not plain.keep_attention_outputs
    assert capped.predicted_cost < plain.predicted_cost
    assert capped.start_bytes + capped.predicted_peak_bytes <= 14.5 * 2**30
    kept = kept_bytes_per_token(spec.num_heads, spec.head_dim, 2)
    assert kept == 12 * (128 * 2 + 4)
    assert capped.call_bytes.call(10) - capped.call_bytes.call(0) == pytest.approx(
        LEAN_H100.call(10) - LEAN_H100.call(0) + 10 * kept)
    assert capped.call_bytes.per_layer == pytest.approx(LEAN_H100.per_layer)
    free = mp.plan_step(spec, 2, shape, can_keep_attention=True, **h100)  # nothing checkpointed: nothing to keep
    checkpointed = free.checkpoint_layers > 0 or free.path_checkpoint_layers > 0
    assert checkpointed or not free.keep_attention_outputs


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("triton", torch.bfloat16), ("triton", torch.float32),
                                           ("flash-attn", torch.bfloat16)])
def test_gpu_checkpointed_attention_keeping_outputs_is_bitwise(monkeypatch, backend, dtype):
    """Compiled kernels: the kept output gives the gradients of the re-run, bit for bit.
    The deterministic backward, since the default one's float atomics add in a
    different order on every run, memo or not."""
    from dtree.ops.backends import Target
    from dtree.ops.stack_attention import AttentionOptions, regions, stack_attention
    from dtree.ops.stack_attention.flash4 import flash4_unavailable

    if backend == "flash-attn" and (why := flash4_unavailable(Target(torch.device("cuda"), dtype, head_dim=128))):
        pytest.skip(why)
    ordered = AttentionOptions(deterministic=True)
    _check_keeping_is_bitwise(
        lambda q, k, v, slots: stack_attention(q, k, v, slots, ordered, backend=backend),
        lambda: _problem([700, 333, 1024], [[(0, 2048)], [(0, 2048)], [(0, 1000), (1500, 3000)]], 3000, 12, 2, 128,
                         dtype=dtype, device="cuda", seed=5),
        _count_forwards(monkeypatch, None if backend == "triton" else regions),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_gpu_runtime_keeping_attention_outputs_by_the_flash_rule(monkeypatch, offload):
    """bf16 qwen2 with every layer checkpointed and outputs kept (``offload``: in pinned host
    memory with the layer inputs, through the side stream), against the float32 per-path
    reference by the flash-attention rule."""
    import copy

    from reference import linearized_step
    from setups import assert_model_flash_rule

    import dtree

    plan_step = mp.plan_step
    monkeypatch.setattr(mp, "plan_step", lambda *a, **kw: dataclasses.replace(plan_step(*a, **kw),
                                                                                keep_attention_outputs=True))
    launches = _count_forwards(monkeypatch)
    from hf_models import make_model

    base = make_model("qwen2", tied=True).cuda()
    exact, bf16_ref, model = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16), base.to(torch.bfloat16)
    exact_loss, _ = linearized_step(exact, SEQS)
    bf16_loss, _ = linearized_step(bf16_ref, SEQS)
    rt = dtree.TreeRuntime(model, chunk_size=2, checkpoint_layers=True, attention="triton", mode="retain",
                           offload_checkpoints=offload)
    out = rt.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert out.metrics["memory_plan"]["keep_attention_outputs"] is True
    assert out.metrics["memory_plan"]["offload_checkpoints"] is offload
    assert launches and out.metrics["memory_plan"]["checkpoint_layers"] > 0
    assert_model_flash_rule(model, exact, bf16_ref, out.loss, exact_loss, bf16_loss, "qwen2 keeping outputs")
