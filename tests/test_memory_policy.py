"""The memory policy's decisions as pure functions of (model shape, per-token bytes,
dtype, memory, forest size), for the H100 cases of issues 11 and 17 (qwen2.5-1.5b,
bf16, 80 GB), a 7B model and CPU; its byte figures against the H100 measurements they
were fit to; its step simulation against a hand count; the probe that measures a
model's per-token bytes; and the runtime using the plan (CPU: no device memory)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hf_models import make_model
from setups import SEQS, grads_when_first_reached

import dtree
from dtree.config import RuntimeConfig
from dtree.models import ModelSpec, adapt
from dtree.ops.logprobs import as_output_head
from dtree.plan import memory_model as mm
from dtree.plan import memory_policy as mp
from dtree.plan import plan_candidates as pc
from dtree.plan.memory_probe import CallBytes, estimated_call_bytes, measure_call_bytes
from dtree.plan.model_view import model_view
from dtree.plan.plan_candidates import SLACK
from dtree.plan.schedule import build_schedule
from dtree.plan.stack_sizes import grad_slots, stack_slots
from dtree.plan.step_plan import plan_memory

GIB = 2.0**30
QWEN_1_5B = ModelSpec(num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, hidden_size=1536,
                      vocab_size=151936, intermediate_size=8960)
QWEN_7B = ModelSpec(num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, hidden_size=3584,
                    vocab_size=152064, intermediate_size=18944)
# the trees (agentic, seed 0): unique tokens, longest path, tokens of trie nodes with children
AGENTIC_64K = mp.StepShape(65606, 9836, 6300)
AGENTIC_256K = mp.StepShape(262144, 9836, 25200)
AGENTIC_21K = mp.StepShape(21266, 7849, 4900)
CASE_1 = mp.StepShape(6144, 2560, 2048)
H100 = dict(available=76 * GIB, allocated=2.9 * GIB, expandable_segments=True, fused_head=True,
            step_grads=2.9 * GIB)
# benchmarks/results/activation_bytes_qwen2.5-1.5b.md (CPU, exact): per token, 28 layers
LEAN = CallBytes(1.58e6, 0.12e6, 28, 3072)


def plan(shape=AGENTIC_64K, spec=QWEN_1_5B, **kw):
    return mp.plan_step(spec, 2, shape, on_cuda=True, **{**H100, **kw})


def total(p) -> float:
    return p.start_bytes + p.predicted_peak_bytes


def test_byte_figures_match_the_h100_measurements():
    # 21.70 GiB of decoder-layer activations for an 8,262-token call at the peak
    assert mp.layer_activation_bytes(QWEN_1_5B, 2) == pytest.approx(21.70 * GIB / 8262, rel=0.03)
    assert mp.layer_input_bytes(QWEN_1_5B, 2) == 30 * 1536 * 2
    # 1.16 GiB of KV stack (bf16 values, float32 gradients) for a 14,419-slot plan
    assert mp.stack_slot_bytes(QWEN_1_5B, 2) * 14419 == pytest.approx(1.16 * GIB, rel=0.02)
    # the fused LM head at 4,096-row chunks over 16k rows: the 1.16 GiB logits buffer, the
    # 0.43 GiB bf16 weight gradient it returns, 0.09 GiB of float32 hidden-state gradient
    # summed over vocabulary slices and 0.09 GiB for the rows' hidden states and their
    # gradient (measured on the GPU: tests/test_logprobs_triton.py::test_gpu_backward_peak);
    # the chunked torch head 5.49 GiB + 0.43
    assert mp.head_bytes(QWEN_1_5B, 2, 4096, 16384, fused=True) == pytest.approx((1.16 + 0.43 + 0.19) * GIB, rel=0.02)
    assert mp.head_bytes(QWEN_1_5B, 2, 4096, 16384, fused=False) == pytest.approx((5.49 + 0.43) * GIB, rel=0.15)
    assert mp.head_bytes(QWEN_1_5B, 2, 4096, 0, fused=True) == 0


def test_call_bytes_mix_checkpointed_and_kept_layers():
    cb = estimated_call_bytes(QWEN_1_5B, 2)
    assert cb.call(0) == cb.full and cb.call(28) == pytest.approx(cb.checkpointed)
    assert cb.call(14) == pytest.approx((cb.full + cb.checkpointed) / 2)
    assert cb.call(99) == cb.call(28) and cb.call(-1) == cb.full
    assert cb.backward(0) < cb.backward(1)
    measured = CallBytes(1.0e6, 1e5, 28, 3072, backward_full=7.0, backward_checkpointed=9.0)
    assert (measured.backward(0), measured.backward(3)) == (7.0, 9.0)


def test_default_on_an_80gb_h100_is_the_fastest_plan_that_fits():
    p = plan()
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert p.budget_bytes == pytest.approx(0.9 * 76 * GIB)
    assert p.checkpoint_layers < QWEN_1_5B.num_layers  # room to keep activations
    # case 1 runs whole, nothing checkpointed
    one = plan(CASE_1)
    assert one.group_tokens >= CASE_1.unique_tokens and one.checkpoint_layers == 0


def test_a_cap_is_honored_with_the_fastest_plan_under_it():
    fastest = min(plan().predicted_cost, plan(setting=70).predicted_cost)
    for cap in (40, 17.6, 12):
        p = plan(setting=cap)
        assert total(p) <= cap * GIB * (1 - mp.CAP_MARGIN) + 1
        assert p.predicted_cost >= fastest / (1 + SLACK)  # less memory is never predicted much faster
    # between all and nothing: part of the layers checkpointed where the calls do not fit whole
    caps = tuple(range(12, 46, 2))
    eager = {c: plan(setting=c) for c in caps}
    lean = {c: plan(setting=c, call_bytes=LEAN) for c in caps}  # lean layers keep fewer bytes per token
    assert any(0 < p.checkpoint_layers < QWEN_1_5B.num_layers for p in eager.values())
    # at the same cap, lean layers are never predicted slower (beyond the SLACK within which the
    # leanest plan is taken), and somewhere re-run fewer layers
    assert all(lean[c].predicted_cost <= eager[c].predicted_cost * (1 + SLACK) for c in caps)
    assert any(lean[c].checkpoint_layers < eager[c].checkpoint_layers for c in caps)


def test_the_path_is_retained_checkpointed_and_recomputed_only_when_that_does_not_fit():
    p = plan(setting=12)  # the fastest plan that fits (no leaner one within SLACK saves LEANER of its memory)
    assert "fastest" in p.reason and "within" not in p.reason
    assert p.path_checkpoint_layers == QWEN_1_5B.num_layers  # its layer inputs: cheap
    assert p.retain_budget("auto") >= AGENTIC_64K.shared_tokens
    assert p.parts["path_graphs"] <= AGENTIC_64K.shared_tokens * estimated_call_bytes(QWEN_1_5B, 2).call(28) + 1
    # the peak is bounded by the path and one call, not the tree: 4x the tokens, same peak
    fixed = dict(group_tokens=4096, checkpoint_layers=0, mode="retain", logprob_chunk=4096)
    assert plan(AGENTIC_256K, **fixed).predicted_peak_bytes == pytest.approx(
        plan(mp.StepShape(65606, 9836, 25200), **fixed).predicted_peak_bytes, rel=1e-6)
    # recompute mode and a hopeless budget recompute the path
    assert plan(mode="recompute").path_checkpoint_layers == mp.RECOMPUTE
    assert plan(mode="recompute").retain_budget("recompute") == 0
    hopeless = plan(available=3 * GIB)
    assert "no plan" in hopeless.reason and hopeless.path_checkpoint_layers == mp.RECOMPUTE
    # retain mode never recomputes; its path is retained with some checkpoint count
    assert plan(mode="retain", setting=12).path_checkpoint_layers >= 0


def test_small_calls_cost_their_unhidden_cpu_time():
    """Every call costs a fixed amount beyond its tokens (fitted on the H100's 64k agentic
    step: 4,096-token calls were ~60% slower than 14.9k-token ones), and small calls also
    pay the CPU time their GPU work does not hide: one big call < 8k-token calls (within
    25%) < 1k-token calls (several times the big call)."""
    big, mid, small = (plan(group_tokens=g, checkpoint_layers=0, mode="recompute") for g in (32768, 8192, 1024))
    assert big.predicted_cost < mid.predicted_cost < 1.25 * big.predicted_cost
    assert small.predicted_cost > 3 * big.predicted_cost


# the 64k agentic tree of session R's H200 runs (seed 0, with its attention's keys) and the bytes
# per token the runtime measured there
AGENTIC_64K_KEYS = mp.StepShape(65606, 8499, 25524, 0, 424881452.0)
H200_LEAN = CallBytes(1527.852e3, 92.692e3, 28, 3072, backward_full=3.068e3, backward_checkpointed=57.396e3)


def test_checkpointed_calls_hide_less_cpu_time():
    """A checkpointed layer runs forward twice, the re-run under autograd: its call's CPU
    time needs more GPU work to hide behind (session R, H200: every layer checkpointed,
    8k-token calls ran 2.823 s a step where 12k ones ran 2.177 s and 16k ones 2.071 s)."""
    fixed = mm.CALL_FIXED_TOKENS
    assert mm.call_overhead_at(1.0, 20000, 1.0) == mm.call_overhead_at(1.0, 20000, 0.0) == fixed
    assert mm.call_overhead_at(1.0, 6000, 0.0) == fixed  # past the CPU point without checkpointing
    assert mm.call_overhead_at(1.0, 6000, 1.0) == pytest.approx(fixed + mm.CALL_CPU_TOKENS * (1 + mm.RERUN_CPU_SHARE) - 6000)
    assert mm.call_overhead_at(1.0, 6000, 0.5) < mm.call_overhead_at(1.0, 6000, 1.0)
    costs = {g: plan(AGENTIC_64K_KEYS, group_tokens=g, checkpoint_layers=True, logprob_chunk=512, mode="retain",
                     call_bytes=H200_LEAN).predicted_cost for g in (8192, 12288, 16384)}
    assert costs[8192] / costs[12288] == pytest.approx(2.823 / 2.177, rel=0.1)
    assert costs[12288] / costs[16384] == pytest.approx(2.177 / 2.071, rel=0.1)


def test_a_cap_between_the_recipes_takes_calls_that_hide_their_cpu_time():
    """Under 10 GiB on the 64k tree the policy no longer splits the forest into 4k-token
    calls (host-bound: 4k-token calls cost 1.2 s a step over 32k ones on an H200)."""
    for cap in (9.5, 10, 12):
        p = plan(AGENTIC_64K_KEYS, setting=cap, call_bytes=H200_LEAN, can_keep_attention=True)
        assert p.group_tokens >= 8192, p.describe()
        assert total(p) <= cap * GIB * (1 - mp.CAP_MARGIN) + 1


def test_fragmentation_margin_without_expandable_segments():
    assert plan(expandable_segments=False).budget_bytes == pytest.approx(0.8 * 76 * GIB)


def test_low_setting_takes_the_lean_recipes_peak_as_its_cap():
    for shape in (AGENTIC_21K, AGENTIC_64K):
        p = plan(shape, setting="low")
        recipe = plan(shape, group_tokens=mp.LOW_GROUP_TOKENS, checkpoint_layers=True,
                      logprob_chunk=mp.LOW_LOGPROB_CHUNK)
        assert p.predicted_peak_bytes <= recipe.predicted_peak_bytes + 1  # no slack above the recipe
        assert p.predicted_cost <= recipe.predicted_cost * (1 + SLACK)
        # weights (2.9) + the rest: the issue's <= 12 GB on the 21k tree
        assert total(p) < 11.5 * GIB
    seven = plan(spec=QWEN_7B, setting="low", step_grads=15.2e9, available=64 * GIB)
    assert seven.predicted_peak_bytes <= seven.budget_bytes


def test_low_setting_keeps_the_recipes_head_chunks():
    """The head's backward is where a `low` step peaks: its chunk stays the recipe's (the
    other knobs decide what runs under the cap), or the user's."""
    for shape in (AGENTIC_21K, AGENTIC_64K):
        assert plan(shape, setting="low").logprob_chunk == mp.LOW_LOGPROB_CHUNK
        assert plan(shape, setting="low", logprob_chunk=2048).logprob_chunk == 2048
        assert plan(shape).logprob_chunk == 4096  # the default still takes the fastest chunk


def test_explicit_options_are_kept():
    p = plan(group_tokens=4096, checkpoint_layers=True, logprob_chunk=2048)
    assert (p.group_tokens, p.checkpoint_layers, p.logprob_chunk) == (4096, 28, 2048)
    assert plan(checkpoint_layers=5).checkpoint_layers == 5
    assert plan(setting="low", checkpoint_layers=False).checkpoint_layers == 0
    assert plan(hf_checkpointing=True).checkpoint_layers == 0  # HF checkpoints the layers itself
    assert plan(can_checkpoint=False, setting="low").checkpoint_layers == 0
    # one segment per call (group_tokens=0) is planned as calls of SMALL_CALL_TOKENS
    one = plan(group_tokens=0)
    assert one.group_tokens == 0 and one.predicted_cost == plan(group_tokens=mm.SMALL_CALL_TOKENS).predicted_cost


def test_a_bigger_model_takes_smaller_calls_or_checkpoints():
    p = plan(spec=QWEN_7B, step_grads=15.2e9, available=64 * GIB)
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert p.group_tokens < 32768 or p.checkpoint_layers > 0


def test_cpu_keeps_the_fixed_defaults():
    p = mp.plan_step(QWEN_1_5B, 4, AGENTIC_64K, on_cuda=False)
    assert (p.group_tokens, p.checkpoint_layers, p.logprob_chunk) == (8192, 0, 4096)
    assert math.isinf(p.retain_bytes) and math.isinf(p.retain_budget("auto"))
    low = mp.plan_step(QWEN_1_5B, 4, AGENTIC_64K, on_cuda=False, setting="low")
    assert (low.group_tokens, low.checkpoint_layers, low.logprob_chunk) == (8192, 28, 512)


@pytest.mark.parametrize("bad", ["fast", 0, -2, True, None])
def test_bad_settings_name_the_choices(bad):
    with pytest.raises(ValueError, match="memory must be one of"):
        plan(setting=bad)
    with pytest.raises(ValueError, match="memory must be one of"):
        dtree.TreeRuntime(make_model("llama"), memory=bad)


def test_retain_budget_by_mode():
    p = plan(setting=12)  # retains its path (checkpointed)
    assert math.isinf(p.retain_budget("retain"))
    assert p.retain_budget("recompute") == 0
    assert p.retain_budget("auto") == pytest.approx(p.retain_tokens())
    assert plan(mode="recompute").retain_budget("auto") == 0


def test_simulated_peak_is_the_hand_count():
    """A prompt (group with children) and two answer calls: the peak is the prompt's kept
    graph plus one answer call and the larger of its head and layer backward."""
    prompt = list(range(32))
    forest = dtree.Forest.from_sequences([prompt + [40 + a] * 16 for a in range(4)])
    sched = build_schedule(forest, chunk_size=64, group_tokens=32)
    assert [(g.num_tokens, g.is_leaf) for g in sched.groups] == [(32, False), (32, True), (32, True)]
    cb = CallBytes(1000.0, 100.0, 4, 10.0, backward_full=50.0, backward_checkpointed=300.0)
    spec = ModelSpec(num_layers=4, num_heads=2, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=11)
    fig = mm._Figures(spec, 2, cb, True, 4096)
    rows = np.diff(sched.predictions.pred_offsets).tolist()
    head = mm.head_bytes(spec, 2, 4096, rows[1], True)
    peak, where = mm.simulate_peak(sched, rows, math.inf, checkpoint=0, path_checkpoint=4, fig=fig)
    assert peak == pytest.approx(32 * cb.call(4) + 32 * 1000 + max(head, 32 * 50.0))
    assert where["group"] in (1, 2) and where["retained_tokens"] == 32
    # recomputed: nothing kept between, the prompt's re-run at its backward
    peak, _ = mm.simulate_peak(sched, rows, 0, checkpoint=4, path_checkpoint=0, fig=fig)
    assert peak == pytest.approx(32 * cb.call(4) + max(mm.head_bytes(spec, 2, 4096, max(rows), True), 32 * 300.0))


def test_probe_measures_what_a_call_keeps():
    """The probe on a tiny bf16 model: eager layers keep more than dtree's lean ones, a
    checkpointed call its layers' inputs plus the rest; no parameter gradient and no
    RNG draw are left behind."""
    from dtree.models.lean_layers import apply_lean_layers

    model = make_model("qwen2", dtype=torch.bfloat16)
    adapter = adapt(model)
    spec = adapter.dtree_spec()
    placement = (torch.device("cpu"), torch.bfloat16)
    state = torch.get_rng_state()
    eager = measure_call_bytes(adapter, spec, placement, "sdpa", model)
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    apply_lean_layers(model)
    lean = measure_call_bytes(adapter, spec, placement, "sdpa", model)
    # per layer and token (H 72, I 100, bf16): eager keeps float32 norm copies and four [T, I]
    assert eager.per_layer > 2300 and lean.per_layer < 0.6 * eager.per_layer
    assert lean.checkpointed < eager.checkpointed < eager.full
    assert eager.backward_full is not None and 0 < eager.backward(0) < eager.backward(2)
    no_ckpt = measure_call_bytes(adapter, spec, placement, "sdpa", None)
    assert no_ckpt.checkpointed == no_ckpt.full
    # a backward holds its incoming gradient, the hidden states' [T, H]
    assert lean.backward(0) >= spec.hidden_size * 2 and lean.backward(2) >= spec.hidden_size * 2


def test_probe_warms_its_short_call_first(monkeypatch):
    """Each figure's short call runs once before the two that are read: the first probe of a process
    met one-time allocations that counted against the short call (a slope ~4 KB per token low on
    an H200, session AL)."""
    from dtree.plan import memory_probe

    calls = []
    monkeypatch.setattr(memory_probe, "_kept", lambda model, spec, placement, attention, tokens, root, recurrence=None:
                        calls.append((tokens, root)) or (tokens * 10, tokens * 3))
    spec = ModelSpec(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=11)
    root = torch.nn.Module()
    cb = measure_call_bytes(None, spec, (torch.device("cpu"), torch.float32), "sdpa", root)
    assert calls == [(128, None), (128, None), (384, None), (128, root), (128, root), (384, root)]
    assert cb.full == 10 and cb.backward_full == 3


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_probe_under_hf_gradient_checkpointing(use_reentrant):
    """HF gradient checkpointing re-runs each layer inside the probe's backward: the re-run
    attends through dtree's stack as the forward did (the step's attention scope is held
    over both), not through the model's own attention (a CheckpointError on GPU before)."""
    model = make_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    adapter = adapt(model)
    spec = adapter.dtree_spec()
    cb = measure_call_bytes(adapter, spec, (torch.device("cpu"), torch.float32), "sdpa", model)
    assert cb.full > 0
    # reentrant checkpointing cannot run a backward to one input: no measured backward
    assert (cb.backward_full is None) == use_reentrant
    assert all(p.grad is None for p in model.parameters())


def test_probe_stays_within_the_models_positions():
    """A model with fewer positions than the probe's chains (GPT-J's position table: an
    index out of bounds, a device-side assert on GPU) is probed within them."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4)
    model = GPTJForCausalLM(config)
    adapter = adapt(model)
    spec = adapter.dtree_spec()
    assert spec.max_positions == 64
    cb = measure_call_bytes(adapter, spec, (torch.device("cpu"), torch.float32), "sdpa", model)
    assert cb.full > 0


@pytest.mark.parametrize("name", ["qwen3_5_text", "nemotron_h"])
def test_probe_measures_a_hybrid(name):
    """The probe's chain runs a hybrid's recurrent layers from zeros (its stacks have no
    state slot: nothing is read or stored) with the recurrence backend given; checkpointed
    layers keep less."""
    from test_families import build

    model = build(name)
    adapter = adapt(model)
    spec = adapter.dtree_spec()
    placement = (torch.device("cpu"), torch.float32)
    cb = measure_call_bytes(adapter, spec, placement, "sdpa", model, "reference")
    assert 0 < cb.checkpointed < cb.full and cb.backward(0) > 0
    assert all(p.grad is None for p in model.parameters())


def test_runtime_plans_every_step_on_cpu():
    model = make_model("qwen2")
    rt = dtree.TreeRuntime(model, chunk_size=3)
    assert rt.memory_plan is None and rt.logprob_chunk == 4096
    out = rt.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    plan_ = out.metrics["memory_plan"]
    assert plan_["group_tokens"] == 8192 and plan_["checkpoint_layers"] == 0 and plan_["setting"] == "auto"
    assert "memory" not in out.metrics and rt.stack is not None  # nothing to release on CPU
    low = dtree.TreeRuntime(model, chunk_size=3, memory="low", logprob_chunk=7)
    out = low.forward_backward(dtree.Forest.from_sequences(SEQS), dtree.losses.nll())
    assert out.metrics["memory_plan"]["checkpoint_layers"] == 2 and low.logprob_chunk == 7
    assert low.memory_plan.logprob_chunk == 7


def test_step_grad_bytes_counts_tied_weights_once_and_existing_grads():
    """A step allocates a fresh gradient for every trainable parameter: the ones already
    there (gradient accumulation) stay aside until it commits (GradStash), so they do not
    make the step's gradients free; frozen parameters get none."""
    model = make_model("qwen2", tied=True)
    params = list(model.parameters())
    want = sum(p.numel() * p.element_size() for p in params)  # .parameters() lists a tied weight once
    assert mp.step_grad_bytes(params + params) == want
    params[0].grad = torch.zeros_like(params[0])
    assert mp.step_grad_bytes(params) == want
    # grad_guard=False: the step accumulates into the gradients already there
    assert mp.step_grad_bytes(params, kept_aside=False) == want - params[0].numel() * params[0].element_size()
    params[1].requires_grad_(False)
    assert mp.step_grad_bytes(params) == want - params[1].numel() * params[1].element_size()


def test_accumulating_steps_hold_both_gradients():
    """The premise of step_grad_bytes: during a step over a model that already has
    gradients, the old ones are kept aside (alive) while the step writes fresh ones, and the
    commit adds the step's into the old tensors."""
    model = make_model("qwen2")
    rt = dtree.TreeRuntime(model, chunk_size=3)
    forest = dtree.Forest.from_sequences(SEQS)
    rt.forward_backward(forest, dtree.losses.nll())
    old = {n: p.grad for n, p in model.named_parameters()}
    first = {n: g.clone() for n, g in old.items()}
    with grads_when_first_reached(model) as seen:
        rt.forward_backward(forest, dtree.losses.nll())
    assert len(seen) == len(old) and all(g is None for g in seen.values())  # the old ones aside: fresh .grad
    for n, p in model.named_parameters():
        assert p.grad is old[n]  # committed into the old tensor
        torch.testing.assert_close(p.grad, 2 * first[n])


def test_the_policy_counts_the_step_gradients_when_accumulating(monkeypatch):
    """With gradients already there, the step's own are still every trainable parameter's (it
    counted none before: memory caps under-predicted by the gradients' size on every
    micro-batch after the first); unguarded, none. They count at the peak of a call after the
    step's first backward only."""
    model = make_model("qwen2")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    monkeypatch.setattr(mp, "available_bytes", lambda device: (5 * GIB, 1 * GIB))
    adapted = adapt(model)
    head = as_output_head(adapted.dtree_output_layer())
    cuda = (torch.device("cuda", 0), torch.bfloat16)
    forest = dtree.Forest.from_sequences(SEQS)
    want = sum(p.numel() * p.element_size() for p in model.parameters())

    def plan_with(**kw):
        config = RuntimeConfig(chunk_size=3, **kw)
        return plan_memory(model_view(model), adapted.dtree_spec(), head, config, cuda, None, forest,
                           CallBytes(5000.0, 800.0, 2, 144.0))

    several = plan_with(group_tokens=4)  # calls of 4 tokens: the later ones peak with the gradients
    assert several.step_grad_bytes == several.parts["gradients"] == want > 0
    one = plan_with()  # one call: at its bottom layer's backward, every gradient less what the call freed
    assert one.step_grad_bytes == want and 0 < one.parts["gradients"] < want
    unguarded = plan_with(group_tokens=4, grad_guard=False)
    assert unguarded.step_grad_bytes == unguarded.parts["gradients"] == 0
    assert unguarded.predicted_peak_bytes < several.predicted_peak_bytes


def test_under_a_cap_the_old_gradients_wait_on_the_host_when_that_is_faster(monkeypatch):
    """While accumulating under a memory cap with the default guard, the plan keeps the old
    gradients in host memory (``grad_guard="host"``) when the plan without their device copy is
    predicted faster; the device copy where it costs nothing (a cap that fits both, no cap, the
    first micro-batch) or where the config names the place."""
    model = make_model("qwen2")
    adapted = adapt(model)
    head = as_output_head(adapted.dtree_output_layer())
    forest = dtree.Forest.from_sequences([[1 + (7 * i + j) % 90 for j in range(40)] for i in range(6)])
    monkeypatch.setattr(mp, "available_bytes", lambda device: (20 * GIB, 1 * GIB))
    sizes = {True: 6 * GIB, False: 0.0}  # the step's gradients with the old ones kept aside, and in place
    monkeypatch.setattr(mp, "step_grad_bytes", lambda params, kept_aside=True: sizes[kept_aside])

    def plan_with(**kw):
        config = RuntimeConfig(**{"chunk_size": 8, "group_tokens": 8, **kw})  # several calls: the gradients at their peaks
        return plan_memory(model_view(model), adapted.dtree_spec(), head, config, (torch.device("cuda", 0),
                           torch.bfloat16), None, forest, CallBytes(60e6, 20e6, 2, 144.0))

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tight = plan_with(memory=7.5)
    device = plan_with(memory=7.5, grad_guard="device")
    assert device.grad_guard == "device" and device.step_grad_bytes == 6 * GIB
    assert tight.grad_guard == "host" and tight.step_grad_bytes == 0
    assert tight.predicted_cost < device.predicted_cost
    assert plan_with(memory=7.5, grad_guard="host").grad_guard == "host"
    assert plan_with(memory=7.5, grad_guard=False).grad_guard is False
    assert plan_with(memory=19).grad_guard is True  # both fit: no PCIe copy
    assert plan_with().grad_guard is True  # memory="auto"
    assert tight.describe()["grad_guard"] == "host" and plan_with().describe()["grad_guard"] == "device"
    low = plan_with(memory="low")  # its cap is its own recipe's peak: the device copy would only raise it
    assert low.grad_guard == "host" and low.step_grad_bytes == 0
    assert plan_with(memory="low", grad_guard="device").predicted_peak_bytes > low.predicted_peak_bytes
    # one call with its layer inputs on the host frees nothing on the device before its bottom layer's
    # backward, which holds every gradient: the host copy is leaner there too
    one_call = plan_with(memory="low", group_tokens=4096)
    assert one_call.group_tokens >= forest.num_unique_tokens and one_call.grad_guard == "host"
    assert plan_with(memory="low", group_tokens=4096, grad_guard="device").predicted_peak_bytes > \
        one_call.predicted_peak_bytes
    sizes[False] = sizes[True]  # the first micro-batch: nothing to keep aside
    assert plan_with(memory=7.5).grad_guard is True and plan_with(memory="low").grad_guard is True


def test_the_refined_peak_counts_the_gradients_after_the_first_backward():
    """The schedule's peak: the first call without the step's gradients, every later one with."""
    forest = dtree.Forest.from_sequences([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    sched = build_schedule(forest, 6, 6)  # two leaf calls of 6 tokens, in DFS order
    assert len(sched.groups) == 2
    cb = CallBytes(5000.0, 800.0, 2, 144.0)
    fig = mm._Figures(QWEN_7B, 2, cb, True, 4096)
    rows = [5, 5]
    alone, _ = mm.simulate_peak(sched, rows, 0, 0, 0, fig)
    with_grads, where = mm.simulate_peak(sched, rows, 0, 0, 0, fig, grads=1e9)
    assert with_grads == alone + 1e9 and where["group"] == 1 and where["gradients"] == 1e9
    one = build_schedule(forest, 6, 12)  # one call: its bottom layer's backward holds the gradients less its frees
    freed = 12 * cb.freed_at_last_layer(0)
    head_excess = mm.head_bytes(QWEN_7B, 2, 4096, 10, True) - 12 * cb.backward(0)  # its [V, H] float32 sum
    assert head_excess > 1e9
    assert mm.simulate_peak(one, [10], 0, 0, 0, fig, grads=1e9)[1]["gradients"] == 0
    many = 1e10
    assert mm.simulate_peak(one, [10], 0, 0, 0, fig, grads=many)[1]["gradients"] == \
        pytest.approx(many - freed - head_excess)


def test_a_one_call_step_counts_the_gradients_its_frees_do_not_offset():
    """A call's backward peaks as it starts or at its bottom layer, where every gradient of the step
    exists and the layers above have freed what they kept: without checkpointing a large call frees
    more than the gradients (GRPO case 1: none count), with its layer inputs on the host it frees
    nothing on the device (the 64k tree in one call, session AL: all count)."""
    cb = CallBytes(1000.0, 100.0, 4, 10.0, backward_full=50.0, backward_checkpointed=300.0)
    assert cb.freed_at_last_layer(0) == pytest.approx(3 / 4 * 4 * cb.per_layer)
    assert cb.freed_at_last_layer(4) == pytest.approx(3 / 4 * 4 * 10.0)
    assert cb.offloading().freed_at_last_layer(4) == 0
    tokens, grads = 10_000, 1e6
    assert mm.grads_at_peak(grads, 1, tokens * cb.freed_at_last_layer(0), 0.0) == 0
    assert mm.grads_at_peak(grads, 1, tokens * cb.offloading().freed_at_last_layer(4), 0.0) == grads
    assert mm.grads_at_peak(grads, 1, 3e5, 2e5) == pytest.approx(5e5)  # the head's chunk tops the layers by 2e5
    assert mm.grads_at_peak(grads, 2, 3e9, 0.0) == grads  # after the first backward: all of them
    # the policy's figure and the schedule's simulation agree, one call of the forest
    forest = dtree.Forest.from_sequences([list(range(1, 200))])
    sched = build_schedule(forest, 64, 256)
    assert len(sched.groups) == 1
    spec = ModelSpec(num_layers=4, num_heads=2, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=11)
    for ckpt, figures in ((4, cb.offloading()), (0, cb), (4, cb)):
        fig = mm._Figures(spec, 2, figures, True, 4096)
        fixed = {"step_grads": grads, "stack_held": 0.0, "state_bytes": 0.0, "slot_bytes": 0.0, "grad_slot_bytes": 0.0,
                 "rates": (1.0, 0.1, 1.0), "attention_rerun": 0.0}
        shape = mp.StepShape(199, 199, 0)
        _, _, parts = pc.candidate(shape, pc.Knobs(256, ckpt, mm.RECOMPUTE, 4096), fig, spec, fixed)
        rows = np.diff(sched.predictions.pred_offsets).tolist()
        _, where = mm.simulate_peak(sched, rows, 0, ckpt, 0, fig, grads=grads)
        assert parts["gradients"] == pytest.approx(where["gradients"], rel=1e-3)  # the bound prices a row per token


def test_runtime_passes_the_cuda_inputs_to_the_policy(monkeypatch):
    """The runtime's side of a CUDA step without a GPU: what the allocator can hand out,
    the step's gradients, the stack held, the fused head, HF checkpointing,
    the measured per-token figures; and the refined prediction from the schedule."""
    model = make_model("qwen2")
    cuda = (torch.device("cuda", 0), torch.bfloat16)
    forest = dtree.Forest.from_sequences(SEQS)
    seen = {}

    def fake_available(device):
        seen["device"] = device
        return 5 * GIB, 1 * GIB

    cb = CallBytes(5000.0, 800.0, 2, 144.0)

    def plan_on_cuda(config, call_bytes=cb):
        adapted = adapt(model)
        head = as_output_head(adapted.dtree_output_layer())
        return plan_memory(model_view(model), adapted.dtree_spec(), head, config, cuda, None, forest, call_bytes)

    monkeypatch.setattr(mp, "available_bytes", fake_available)
    plan_ = plan_on_cuda(RuntimeConfig(chunk_size=3))
    assert seen["device"] == torch.device("cuda", 0)
    assert plan_.budget_bytes == pytest.approx((1 - mp.MARGIN_FRAGMENTED) * 5 * GIB)
    # one call of a tiny forest: its bottom layer's backward holds the gradients less the little it freed
    want = mp.step_grad_bytes(model.parameters())
    assert plan_.step_grad_bytes == want > 0 and 0 < plan_.parts["gradients"] < want
    assert plan_.predicted_peak_bytes <= plan_.budget_bytes and "fastest predicted plan" in plan_.reason
    assert plan_.call_bytes is cb and plan_.start_bytes == 1 * GIB
    cap = plan_on_cuda(RuntimeConfig(chunk_size=3, memory=1.5))
    assert cap.budget_bytes == pytest.approx(1.5 * GIB * (1 - mp.CAP_MARGIN) - 1 * GIB)
    sched = build_schedule(forest, 3, plan_.group_tokens)
    refined = mm.refine(plan_, sched, plan_.retain_budget("auto"), (0, 0), 0)
    assert refined.predicted_peak_bytes <= plan_.predicted_peak_bytes  # the plan's bounds hold
    assert "peak at group" in refined.reason and set(refined.parts) == {"gradients", "kv_stack", "activations"}
    model.gradient_checkpointing_enable()
    model.train()
    assert plan_on_cuda(RuntimeConfig(chunk_size=3)).checkpoint_layers == 0  # HF checkpoints: dtree adds none


def test_the_state_stack_is_counted_in_the_stack_figure(monkeypatch):
    """A hybrid's state stack (slots x every recurrent layer's states, float32, with
    gradients) is part of the stack figure: before scheduling, at most one slot per
    segment with children; after it, the state plan's slots beyond the stacks held."""
    from test_families import build

    from dtree.plan.state_plan import plan_states
    from dtree.plan.stack_sizes import step_shape
    from dtree.stacks.step_stacks import StepStacks

    model = build("qwen3_5_text")
    adapted = adapt(model)
    spec = adapted.dtree_spec()
    assert spec.recurrent_states and mm.state_slot_bytes(spec, 4) == spec.state_elements() * 4 * 2
    assert mm.state_slot_bytes(spec, 8) == spec.state_elements() * 8 * 2  # float64 states for a float64 model
    assert mm.state_slot_bytes(QWEN_1_5B, 2) == 0  # no recurrent layers

    # the bound holds for every schedule (calls of every size, nodes split into chunks)
    forest = dtree.Forest.from_sequences([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [1, 2, 8, 8, 8], [4, 4, 4, 4, 4, 1]])
    for chunk in (1, 2, 3, 2048):
        bound = step_shape(forest, chunk, recurrent=True).state_slots
        assert step_shape(forest, chunk).state_slots == 0
        capacities = [plan_states(build_schedule(forest, chunk, g)).capacity for g in (0, 3, 5, 8192)]
        assert max(capacities) <= bound and max(capacities) > 0, (chunk, capacities, bound)
    # the 4- and 6-token nodes in 2 chunks each, and 2 branch points
    assert step_shape(forest, 3, recurrent=True).state_slots == 2 + 2

    monkeypatch.setattr(mp, "available_bytes", lambda device: (5 * GIB, 1 * GIB))
    cuda = (torch.device("cuda", 0), torch.float32)
    cb = CallBytes(5000.0, 800.0, spec.num_layers, 144.0)
    config = RuntimeConfig(chunk_size=3, group_tokens=3)
    head = as_output_head(adapted.dtree_output_layer())
    plan_ = plan_memory(model_view(model), spec, head, config, cuda, None, forest, cb)
    shape = step_shape(forest, 3, recurrent=True)
    sched = build_schedule(forest, 3, 3)
    # before scheduling, the K/V slots of the schedule's packing (no backend given: K/V and
    # gradients in the slots it writes); the state stack on its bound
    kv = sched.stack_tokens * mm.stack_slot_bytes(spec, 4)
    assert plan_.parts["kv_stack"] == pytest.approx(kv + shape.state_slots * mm.state_slot_bytes(spec, 4))
    fixed = mp._shared_figures(spec, 4, shape, 0.0, 0.0)  # a shape without stack_needs: the bound
    assert pc.kv_stack_bytes(shape, 3, 3, fixed) == min(shape.unique_tokens, shape.longest_path + 3) * fixed["slot_bytes"]

    slots = plan_states(sched).capacity
    retain = plan_.retain_budget(config.mode)
    refined = mm.refine(plan_, sched, retain, (0, 0), slots)
    want = sched.stack_tokens * mm.stack_slot_bytes(spec, 4) + slots * mm.state_slot_bytes(spec, 4)
    assert refined.parts["kv_stack"] == pytest.approx(want)
    held = StepStacks(spec, sched.stack_tokens, slots - 1, dtype=torch.float32, device="cpu", with_grad=True)
    assert held.capacity == sched.stack_tokens
    assert mm.refine(plan_, sched, retain, (held.capacity, held.state_slots), slots).parts["kv_stack"] == pytest.approx(
        mm.state_slot_bytes(spec, 4)  # only the one state slot the stacks held lack
    )
    # the one-call path: K/V slots for every call, gradient slots for the groups with children
    kv_slots, path = stack_slots(sched, own_in_stack=True), grad_slots(sched, leaf_grads=False)
    assert path <= sched.stack_tokens == grad_slots(sched, leaf_grads=True) and path < kv_slots
    grad = mm.stack_grad_slot_bytes(spec, 4)
    full = mm.refine(plan_, sched, retain, (0, 0), slots, stack_slots=kv_slots)
    lean = mm.refine(plan_, sched, retain, (0, 0), slots, stack_slots=kv_slots, grad_slots=path)
    assert lean.parts["kv_stack"] == pytest.approx(full.parts["kv_stack"] - (kv_slots - path) * grad)
    assert lean.predicted_peak_bytes == pytest.approx(full.predicted_peak_bytes - (kv_slots - path) * grad)
    short = StepStacks(spec, kv_slots, slots, dtype=torch.float32, device="cpu", with_grad=True, grad_tokens=path)
    assert short.grad_tokens == path and short.nbytes() == pytest.approx(lean.parts["kv_stack"])
    held_lean = (short.capacity, short.state_slots)
    assert mm.refine(plan_, sched, retain, held_lean, slots, stack_slots=kv_slots, grad_slots=path,
                     held_grads=path).parts["kv_stack"] == 0
    assert mm.refine(plan_, sched, retain, held_lean, slots, stack_slots=kv_slots,
                     held_grads=path).parts["kv_stack"] == pytest.approx((kv_slots - path) * grad)
    assert not short.fits(spec, kv_slots, slots, torch.float32, "cpu", True)  # None: every slot
    assert short.fits(spec, kv_slots, slots, torch.float32, "cpu", True, grad_tokens=path)


def _knobs(p) -> tuple[int, int, int, int]:
    return (p.group_tokens, p.checkpoint_layers, p.path_checkpoint_layers, p.logprob_chunk)


def test_a_kept_plan_runs_while_it_fits():
    """Deterministic mode keeps a forest shape's plan (its sums set the gradient's bits) while
    it is predicted to fit, whatever else more free memory would allow; when it no longer
    fits, the policy chooses again."""
    roomy, tight = plan(), plan(setting=14)
    assert _knobs(roomy) != _knobs(tight)  # free memory changes the plan
    kept = plan(keep=_knobs(tight))  # plenty of memory: the kept (leaner) plan runs
    assert _knobs(kept) == _knobs(tight) and "deterministic mode" in kept.reason
    assert kept.predicted_peak_bytes <= kept.budget_bytes
    squeezed = plan(setting=12, keep=_knobs(roomy))  # the kept plan no longer fits: chosen again
    assert _knobs(squeezed) == _knobs(plan(setting=12)) and "deterministic mode" not in squeezed.reason


def test_the_planner_keeps_a_shape_plan_in_deterministic_mode(monkeypatch):
    """Two steps over one forest plan alike in deterministic mode when the memory free at the
    call changed in between (the H100 rerun of issue 21: run 2 planned 2,048-row head chunks,
    runs 1 and 3 4,096, and only runs 1 and 3 agreed bit for bit); by default each step takes
    what its free memory allows."""
    model = make_model("qwen2")
    cuda = (torch.device("cuda", 0), torch.bfloat16)
    forest = dtree.Forest.from_sequences(SEQS)
    free = {"bytes": 0.5 * GIB}
    monkeypatch.setattr(mp, "available_bytes", lambda device: (free["bytes"], 1 * GIB))
    adapted = adapt(model)
    head, spec = as_output_head(adapted.dtree_output_layer()), adapted.dtree_spec()
    cb = CallBytes(5e7, 5e6, 2, 144.0)  # at 0.5 GiB the path is recomputed, at 8 GiB kept

    def step(kept):
        return plan_memory(model_view(model), spec, head, RuntimeConfig(chunk_size=3), cuda, None, forest, cb, kept)

    kept: dict = {}
    first = step(kept)
    free["bytes"] = 8 * GIB
    assert _knobs(step(None)) != _knobs(first)  # the default follows the memory
    again = step(kept)
    assert _knobs(again) == _knobs(first) and len(kept) == 1


@pytest.mark.parametrize("shape", [mp.StepShape(6144, 2560, 2048), mp.StepShape(3000, 3000, 0), AGENTIC_64K])
@pytest.mark.parametrize("kw", [{}, {"setting": 17.6}, {"setting": "low"}, {"mode": "recompute"}])
def test_call_budgets_that_plan_the_same_calls_are_scored_once(monkeypatch, shape, kw):
    """A forest smaller than several call budgets (GRPO case 1: 6,144 tokens) scores one of
    them, not each: the plan is the one every budget gives, and fewer are scored."""
    budgets = mp.call_budgets(None, shape.unique_tokens)
    assert len(budgets) == len({min(g, shape.unique_tokens) for g in mp.GROUP_TOKENS})
    fewer = plan(shape, **kw)
    monkeypatch.setattr(mp, "call_budgets", lambda fixed, u: (fixed,) if fixed is not None else mp.GROUP_TOKENS)
    every = plan(shape, **kw)
    assert dataclasses.replace(fewer, reason="") == dataclasses.replace(every, reason="")  # the reason counts the plans


def _plan_with(model, monkeypatch, free_gib: float, **config):
    """plan_memory for a bf16 CUDA placement with ``free_gib`` available (the policy's kwargs captured)."""
    adapted = adapt(model)
    head = as_output_head(adapted.dtree_output_layer())
    forest = dtree.Forest.from_sequences([[1 + (7 * i + j) % 90 for j in range(400)] for i in range(6)])
    monkeypatch.setattr(mp, "available_bytes", lambda device: (free_gib * GIB, 1 * GIB))
    seen: list[dict] = []
    plan_step = mp.plan_step
    monkeypatch.setattr(mp, "plan_step", lambda *a, **kw: (seen.append(kw), plan_step(*a, **kw))[1])
    plan = plan_memory(model_view(model), adapted.dtree_spec(), head, RuntimeConfig(chunk_size=8, **config),
                       (torch.device("cuda", 0), torch.bfloat16), None, forest, CallBytes(5e6, 8e5, 2, 1.44e5),
                       attention="triton")
    return plan, seen


@pytest.mark.parametrize("allowed", [True, False])
def test_keep_attention_outputs_false_keeps_none(monkeypatch, allowed):
    """``keep_attention_outputs=False`` takes keeping out of the policy's choice (a comparison run)."""
    _, seen = _plan_with(make_model("qwen2"), monkeypatch, 20, memory=8, keep_attention_outputs=allowed)
    assert seen and all(kw["can_keep_attention"] is allowed for kw in seen)


def test_the_offload_is_taken_where_it_is_faster_with_its_copies_priced():
    """The plan with the layer inputs on the device where it fits and is predicted no more than
    OFFLOAD_COST slower; the offloaded plan where the device's does not fit, or is slower by more
    (session W: at memory=8 on the 64k tree the device's only fitting plan ran 3.6x slower; session AD:
    at memory=10 the device's 16k-call plan, predicted 6.9% slower, ran 6.5% slower)."""
    shape = mp.StepShape(65_600, 9_836, 9_000, 0, 65_600 * 6_000.0)
    base = mp.plan_step(ModelSpec(28, 12, 2, 128, 1536, 151936, 8960), 2, shape, on_cuda=True,
                        available=20 * GIB, setting=14.5, offload=True)
    offloaded = dataclasses.replace(base, predicted_cost=100.0, predicted_peak_bytes=4 * GIB, budget_bytes=8 * GIB)

    def device_plan(cost, peak_gib):
        return dataclasses.replace(offloaded, offload_checkpoints=False, predicted_cost=cost,
                                   predicted_peak_bytes=peak_gib * GIB)

    assert mp.cheaper_than_offload(offloaded, device_plan(100.0, 7.5)).offload_checkpoints is False  # a tie: the device
    assert mp.cheaper_than_offload(offloaded, device_plan(100.0 * (1 + mp.OFFLOAD_COST) - 1, 7.5)).offload_checkpoints \
        is False
    assert mp.cheaper_than_offload(offloaded, device_plan(100.0 * (1 + mp.OFFLOAD_COST) + 1, 7.5)) is offloaded
    assert mp.cheaper_than_offload(offloaded, device_plan(90.0, 8.5)) is offloaded  # does not fit


def test_a_tight_cap_scores_the_schedules_kv_stack():
    """memory=8 on the 64k agentic tree (qwen2.5-1.5b with the figures measured on an H200, the
    layer inputs on the host): on the bound (the longest path plus a call, gradients in every slot)
    the 12k-token calls of ``low`` did not fit and 4k-token calls ran 1.9x slower (session X); with
    the schedule's own slots (``stack_needs``: 6.7k gradient slots of 18.9k) such calls fit, and the
    figure is the one the schedule is refined to."""
    from dtree.plan.stack_sizes import stack_needs, step_shape
    from dtree.workloads import make_workload

    forest = make_workload("agentic", seed=0, num_trees=1, target_unique_tokens=65536)
    shape = step_shape(forest, 8192)
    exact_shape = dataclasses.replace(shape, stack_needs=stack_needs(
        forest, 8192, mp.call_budgets(None, shape.unique_tokens), own_in_stack=True, leaf_grads=False))
    cb = CallBytes(1527852.0, 92692.0, 28, 3072.0, backward_full=0.0, backward_checkpointed=53300.0)
    kw = {"on_cuda": True, "available": 120 * GIB, "expandable_segments": True, "setting": 8.0,
          "allocated": 2.94 * GIB, "step_grads": 2.875 * GIB, "call_bytes": cb, "can_keep_attention": True,
          "fused_head": True, "offload": True}
    bound, exact = mp.plan_step(QWEN_1_5B, 2, shape, **kw), mp.plan_step(QWEN_1_5B, 2, exact_shape, **kw)
    assert bound.group_tokens == 4096 and exact.group_tokens >= 12288, (bound.describe(), exact.describe())
    assert exact.path_checkpoint_layers == mm.RECOMPUTE  # offloaded: the path recomputed, as low's recipe
    assert exact.predicted_cost < bound.predicted_cost / 1.5
    sched = build_schedule(forest, 8192, exact.group_tokens)
    refined = mm.refine(exact, sched, exact.retain_budget("auto"), (0, 0), 0,
                        stack_slots=stack_slots(sched, True), grad_slots=grad_slots(sched, False))
    assert refined.parts["kv_stack"] == pytest.approx(exact.parts["kv_stack"])


@pytest.mark.parametrize("cap,offloaded", [(40, False), (1.35, True)])
def test_a_cap_in_gib_offloads_only_where_it_pays(monkeypatch, cap, offloaded):
    """Under a cap in GiB the default offload (``"auto"``) is weighed against the plan with the layer
    inputs on the device (:func:`cheaper_than_offload`); ``"low"`` offloads (its point is the memory),
    and ``offload_checkpoints=True`` everywhere."""
    model = make_model("qwen2")
    plan, seen = _plan_with(model, monkeypatch, 60, memory=cap)
    assert plan.offload_checkpoints is offloaded, plan.describe()
    assert [kw["offload"] for kw in seen] == [True, False]  # planned with the offload, then without
    assert _plan_with(model, monkeypatch, 60, memory="low")[0].offload_checkpoints
    assert _plan_with(model, monkeypatch, 60, memory=cap, offload_checkpoints=True)[0].offload_checkpoints


@pytest.mark.parametrize("value", [None, "auto", 1])
def test_bad_keep_attention_outputs_values_are_refused(value):
    with pytest.raises(ValueError, match="keep_attention_outputs must be True or False"):
        RuntimeConfig(keep_attention_outputs=value)


def test_with_the_offload_a_retained_path_keeps_no_checkpointed_layers():
    """Offloaded, a retained path's checkpointed layers would keep their inputs on the host until
    their backward (10% and 5% slower than recomputing the path in sessions V and X): the path is
    retained whole (no layer checkpointed) or recomputed, unless ``mode="retain"``."""
    assert mp._path_options("auto", None, 28, offload=True) == (0, mm.RECOMPUTE)
    assert mp._path_options("auto", None, 28) == (0, 14, 28, mm.RECOMPUTE)
    assert mp._path_options("retain", None, 28, offload=True) == (0, 14, 28)
    assert mp._path_options("recompute", None, 28, offload=True) == (mm.RECOMPUTE,)
    assert mp._path_options("auto", 5, 28, offload=True) == (mm.RECOMPUTE,)
