"""The one-call path of the flash-attn backend (dtree/ops/stack_attention/masked_call.py)
with its pure-torch kernel, against the naive float64 reference on the output and every
gradient: q, k, v and the stack's prefix gradient buffers. This is the autograd function
the flash-attn-4 kernel runs in on the GPU: the own K/V written into the stack, the slots
below the call added into its gradient buffers, the call's own slots returned as dk, dv
(in-call descendants' terms included), kept outputs taken back in a re-run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtree.ops.stack_attention import AttentionOptions, StackSlots
from dtree.ops.stack_attention.output_memo import OutputMemo
from dtree.ops.stack_attention.masked_call import TORCH_MASKED_CALL, stack_attention_masked_call
from dtree.ops.stack_attention.call_mask import call_mask
from dtree.ops.stack_ops.kv_stack import KVStack

from test_stack_attention import check_against_naive, nested_layout, random_layout


def one_call_backend(q, k, v, slots: StackSlots, options: AttentionOptions, own_in_stack: bool = False):
    """The backends' signature over the one-call path with the torch kernel. ``own_in_stack``:
    as the walk's groups that push (check_against_naive pushes the own K/V first, as they do)."""
    mask = call_mask(slots.layout)
    assert mask is not None, "the layout must be expressible"
    return stack_attention_masked_call(q, k, v, slots.stack, slots.layer, slots.layout, mask,
                                       options.softmax_scale(q.shape[-1]), kernel=TORCH_MASKED_CALL,
                                       own_in_stack=own_in_stack)


def pushed_backend(q, k, v, slots, options):
    return one_call_backend(q, k, v, slots, options, own_in_stack=True)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", [one_call_backend, pushed_backend], ids=["writes own", "own pushed"])
def test_random_layouts_match_the_naive_reference(seed, dtype, backend):
    """Random packed calls (odd lengths, GQA 3, shared and multi-range prefixes), with the
    stack's gradients already holding other calls' terms: every output and gradient; the
    own K/V written by the call, or pushed by the caller before it."""
    rng = np.random.default_rng(seed)
    used = int(rng.integers(1, 40))
    layout, t = random_layout(rng, int(rng.integers(1, 6)), 17, used)
    if call_mask(layout) is None:
        pytest.skip("a prefix whose readers are not one run of rows (random_layout draws any subsets)")
    check_against_naive(backend, layout, t, used, 6, 2, 8, dtype=dtype, seed=seed, grad_init=True)


@pytest.mark.parametrize("own_in_stack", [False, True])
def test_the_call_writes_its_own_slots_unless_the_caller_did(own_in_stack):
    """own_in_stack=True: the slots are the caller's, the call leaves them as they are (one
    write per layer, the push); False: the call writes its K/V there itself."""
    from dtree.ops.stack_attention import SegmentLayout

    layout = SegmentLayout(np.array([0, 3, 5]), np.array([4, 7]), [((0, 4),), ((0, 4),)])
    stack = KVStack(1, 12, 1, 4, dtype=torch.float64, device="cpu", grad_dtype=torch.float64)
    stack.k[0, :4], stack.v[0, :4] = torch.randn(4, 1, 4, dtype=torch.float64), torch.randn(4, 1, 4, dtype=torch.float64)
    q, k, v = (torch.randn(5, 2, 4, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
    stack.k[0, 4:9] = stack.v[0, 4:9] = 7.0
    stack_attention_masked_call(q, k, v, stack, 0, layout, call_mask(layout), 0.5, own_in_stack=own_in_stack)
    if own_in_stack:
        assert torch.all(stack.k[0, 4:9] == 7.0) and torch.all(stack.v[0, 4:9] == 7.0)
    else:
        assert torch.equal(stack.k[0, 4:9], k) and torch.equal(stack.v[0, 4:9], v)


def test_in_call_ancestors_match_the_naive_reference():
    """A chain inside the call (A -> B -> C, B's sibling D): their slots' gradients reach
    the call's own dk, dv, not the stack's slots."""
    layout, t = nested_layout(9)
    check_against_naive(one_call_backend, layout, t, 9, 4, 2, 8, dtype=torch.float64)


def test_no_prefix_and_a_single_row():
    """A call with nothing below it (base 0: nothing added to the stack), and one row."""
    from dtree.ops.stack_attention import SegmentLayout

    layout = SegmentLayout(np.array([0, 5, 6]), np.array([0, 5]), [(), ((0, 5),)])
    check_against_naive(one_call_backend, layout, 6, 0, 2, 1, 4, dtype=torch.float64)
    single = SegmentLayout(np.array([0, 1]), np.array([3]), [((0, 3),)])
    check_against_naive(one_call_backend, single, 1, 3, 2, 2, 4, dtype=torch.float64)


def test_rerun_takes_the_kept_output_back():
    """In a checkpointed layer's re-run the kernel's forward does not run: the recorded
    output comes back bit for bit, and the backward is the same."""
    layout, t = nested_layout(5)
    mask = call_mask(layout)
    gen = torch.Generator().manual_seed(0)
    stack = KVStack(1, 5 + t, 2, 8, dtype=torch.float64, device="cpu")
    stack.k[0, :5], stack.v[0, :5] = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64), torch.randn(
        5, 2, 8, generator=gen, dtype=torch.float64)
    stack.zero_grad(0, stack.capacity)
    q, k, v = (torch.randn(t, h, 8, generator=gen, dtype=torch.float64).requires_grad_() for h in (4, 2, 2))
    memo, calls = OutputMemo(), []

    class Counting:
        def forward(self, *a):
            calls.append(1)
            return TORCH_MASKED_CALL.forward(*a)

        def backward(self, *a):
            return TORCH_MASKED_CALL.backward(*a)

    with memo.recording():
        first = stack_attention_masked_call(q, k, v, stack, 0, layout, mask, 8**-0.5, kernel=Counting())
    with memo.replaying_scope():
        again = stack_attention_masked_call(q, k, v, stack, 0, layout, mask, 8**-0.5, kernel=Counting())
    assert len(calls) == 1 and torch.equal(first, again)
    go = torch.randn(first.shape, generator=gen, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(first, (q, k, v), go),
                                                  torch.autograd.grad(again, (q, k, v), go)))


def test_capacity_short_of_the_call_raises():
    layout, t = nested_layout(5)
    stack = KVStack(1, 5 + t - 1, 2, 8, dtype=torch.float32, device="cpu")
    q, k, v = torch.zeros(t, 2, 8), torch.zeros(t, 2, 8), torch.zeros(t, 2, 8)
    with pytest.raises(ValueError, match="past the stack capacity"):
        stack_attention_masked_call(q, k, v, stack, 0, layout, call_mask(layout), 1.0)


@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_runtime_steps_through_the_one_call_path_exactly(monkeypatch, mode):
    """Whole training steps with the one-call path (torch kernel) standing in for the
    ``reference`` backend, which the plan then treats as reading own K/V from the stack
    (every call pushes, the stack holds every call's slots): against HF per path in
    float32, over the DESIGN edge cases with subtrees inside calls, small and whole-forest
    calls, retained and recomputed paths."""
    import dtree.plan.stack_sizes as stack_sizes

    from test_runtime_exact import EDGE_CASES, assert_exact, run_both
    from hf_models import make_model

    ran = _one_call_for_reference(monkeypatch)
    monkeypatch.setattr(stack_sizes, "OWN_KV_IN_STACK", frozenset({"flash-attn", "reference"}))
    sizes, _ = _stack_sizes(monkeypatch)
    seqs = [s for case in EDGE_CASES.values() for s in case]
    for budget in (6, 11, 1000):
        out, ref, errs = run_both(make_model("qwen3", tied=True), seqs,
                                  rt_kw=dict(mode=mode, attention="reference", chunk_size=3, group_tokens=budget))
        assert_exact(out, ref, errs)
    assert ran, "the one-call path never ran"
    assert all(grads == tokens for tokens, grads in sizes)  # the leaves' slots take gradients


def _one_call_for_reference(monkeypatch) -> list[int]:
    """The ``reference`` backend runs the one-call path (torch kernel) for every call whose
    layout it expresses, with plain options; returns a list that grows by one per such call."""
    from dtree.ops.stack_attention.interface import BACKENDS

    reference, ran = BACKENDS.functions["reference"], []

    def one_call_or_reference(q, k, v, slots, options):
        if call_mask(slots.layout) is None or not options.plain:
            return reference(q, k, v, slots, options)
        ran.append(1)
        return one_call_backend(q, k, v, slots, options)

    monkeypatch.setitem(BACKENDS.functions, "reference", one_call_or_reference)
    return ran


def _stack_sizes(monkeypatch) -> tuple[list[tuple[int, int]], list[int]]:
    """(KV slots, gradient slots) of every StepStacks the runtime makes from now on, as made,
    and the number of times an op grew a KV stack's gradient slots (the stacks themselves may
    be released after a step: their sizes then read 0)."""
    from dtree.ops.stack_ops.kv_stack import KVStack
    from dtree.stacks.step_stacks import StepStacks

    made, grown, init, through = [], [0], StepStacks.__init__, KVStack.grad_slots_through

    def recording(self, spec, tokens, state_slots, **kw):
        init(self, spec, tokens, state_slots, **kw)
        if kw.get("with_grad"):
            made.append((tokens, self.grad_tokens))

    def counting(self, end):
        grown[0] += self.has_grad and min(end, self.capacity) > self.grad_slots
        through(self, end)

    monkeypatch.setattr(StepStacks, "__init__", recording)
    monkeypatch.setattr(KVStack, "grad_slots_through", counting)
    return made, grown


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call path", "every call elsewhere"])
def test_runtime_with_gradient_slots_for_the_path_only(monkeypatch, one_call):
    """The plan gives the stack gradient slots for the groups with children only when the
    backend's calls return their own K/V gradients whole (OWN_GRADS_IN_CALL, the flash-attn
    backend's one-call path): against HF per path in float32 over the DESIGN edge cases,
    with the one-call path standing in for the ``reference`` backend, and with every call
    taking the per-segment path instead (which adds in-call ancestors' dK/dV into the
    leaf's slots: the stack grows its gradient slots there, and stays exact)."""
    import dtree.ops.stack_attention.interface as interface
    import dtree.plan.stack_sizes as stack_sizes

    from test_runtime_exact import EDGE_CASES, assert_exact, run_both
    from hf_models import make_model

    if one_call:
        _one_call_for_reference(monkeypatch)
    monkeypatch.setattr(stack_sizes, "OWN_KV_IN_STACK", frozenset({"flash-attn", "reference"}))
    monkeypatch.setattr(interface, "OWN_GRADS_IN_CALL", frozenset({"flash-attn", "reference"}))
    sizes, grown = _stack_sizes(monkeypatch)
    seqs = [s for case in EDGE_CASES.values() for s in case]
    for mode in ("retain", "recompute"):
        for budget in (6, 11, 1000):
            out, ref, errs = run_both(make_model("qwen3", tied=True), seqs,
                                      rt_kw=dict(mode=mode, attention="reference", chunk_size=3, group_tokens=budget))
            assert_exact(out, ref, errs)
    assert sizes and all(grads <= tokens for tokens, grads in sizes)
    assert any(grads < tokens for tokens, grads in sizes), f"no stack had fewer gradient slots: {sizes}"
    # on the one-call path they stay as planned; elsewhere the leaves' adds grew them
    assert (grown[0] == 0) if one_call else (grown[0] > 0), grown


def test_leaf_slots_take_grads_but_on_the_one_call_path(monkeypatch):
    from dtree.ops.stack_attention import flash4
    from dtree.ops.stack_attention.interface import leaf_slots_take_grads

    assert not leaf_slots_take_grads("flash-attn")
    assert leaf_slots_take_grads("flash-attn", deterministic=True)  # the region path
    assert leaf_slots_take_grads("triton") and leaf_slots_take_grads("sdpa")
    monkeypatch.setattr(flash4, "ONE_CALL_PATH", False)  # DTREE_FLASH_REGIONS=1
    assert leaf_slots_take_grads("flash-attn")


@pytest.mark.gpu
def test_gpu_flash4_replayed_calls_match_the_interface():
    """The flash-attn-4 kernel's later calls of one layout launch the recorded kernels
    (dtree/ops/stack_attention/flash4_launch_replay.py) and give what the interface gives on
    the same inputs: the forward bitwise, the backward within flash-attn-4's own run-to-run
    spread (its dQ and GQA dK/dV add with atomics)."""
    from test_stack_attention_regions import _flash4
    from test_stack_attention_triton import layout_of

    _flash4()  # skips without flash-attn-4 on a Hopper GPU
    from dtree.ops.stack_attention import flash4_masked_call as fm

    launcher = fm._launcher()
    launcher.held.clear()
    layout, t = layout_of([256] * 8, [[(0, 512), (512 + 128 * (i // 2), 640 + 128 * (i // 2))] for i in range(8)],
                          1024)
    mask = call_mask(layout)
    tables = fm.device_tables(mask, layout, torch.device("cuda"))
    gen, scale, n = torch.Generator().manual_seed(0), 128**-0.5, mask.num_keys

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

    replays = launcher.replays
    for _ in range(3):  # the first call records, the next two replay
        q, k, v, dout = rand(t, 12, 128), rand(n, 2, 128), rand(n, 2, 128), rand(t, 12, 128)
        out, lse = fm.FLASH4_MASKED_CALL.forward(q, k, v, mask, layout, scale)
        grads = fm.FLASH4_MASKED_CALL.backward(q, k, v, out, dout, lse, mask, layout, scale)
        want_out, want_lse = launcher.fi._flash_attn_fwd(
            q[None], k[None], v[None], softmax_scale=scale, causal=False, mask_mod=tables["fwd_mask"],
            aux_tensors=tables["aux"], block_sparse_tensors=tables["fwd"], return_lse=True)[:2]
        want = launcher.fi._flash_attn_bwd(q[None], k[None], v[None], out[None], dout[None], lse[None],
                                           softmax_scale=scale, causal=False, mask_mod=tables["bwd_mask"],
                                           aux_tensors=tables["bwd_aux"], block_sparse_tensors=tables["bwd"])[:3]
        assert torch.equal(out, want_out[0]) and torch.equal(lse, want_lse[0])
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
            torch.testing.assert_close(got, ref[0], rtol=2e-2, atol=2e-2, msg=lambda m, name=name: f"{name}: {m}")
    assert launcher.replays - replays == 4


def _real_call_layout():
    """The 64k agentic tree's largest 16k-token call: partial tiles of every kind."""
    from dtree.engine.walk import _group_layout
    from dtree.plan.schedule import build_schedule
    from dtree.workloads import make_workload

    forest = make_workload("agentic", seed=0, vocab_size=1000, num_trees=1, target_unique_tokens=65536)
    sched = build_schedule(forest, 256, 16384)
    return _group_layout(sched, max(range(len(sched.groups)), key=lambda g: sched.groups[g].num_tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["real", "odd"])
def test_gpu_flash4_masks_match_flash_attn_4s_own_evaluation(which):
    """The masks the calls run (two tables forward, one packed word backward, each key's bounds read once per
    thread and tile: flash4_slot_bounds) give what flash-attn-4's own per-score evaluation of the two tables
    gives: the forward bitwise, dq, dk, dv within the spread of that backward against itself (its dQ and GQA
    dK/dV atomics). On a real 16k-token call, and on a call whose rows and keys end inside a tile (the keys
    past the call read the tables' padding)."""
    from test_stack_attention_regions import _flash4
    from test_stack_attention_triton import layout_of

    _flash4()  # skips without flash-attn-4 on a Hopper GPU
    from dtree.ops.stack_attention import flash4_masked_call as fm
    from dtree.ops.stack_attention import flash4_slot_bounds

    if which == "real":
        layout = _real_call_layout()
    else:
        layout = layout_of([77, 300, 5, 190, 41], [[(0, 333)], [(0, 333)], [(0, 200)], [(0, 100)], []], 333)[0]
    mask = call_mask(layout)
    tables = fm.device_tables(mask, layout, torch.device("cuda"))
    assert flash4_slot_bounds.install() and tables["bwd_mask"] is flash4_slot_bounds.slot_bounds_mask("packed")
    assert mask.num_keys % 128 and (mask.num_rows > 8192) == (which == "real")
    gen, scale, n, t = torch.Generator().manual_seed(0), 128**-0.5, mask.num_keys, mask.num_rows
    q, k, v, dout = (torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)[None]
                     for shape in ((t, 12, 128), (n, 2, 128), (n, 2, 128), (t, 12, 128)))
    fi = fm._launcher().fi

    def forward(mask_mod):
        return fi._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False, mask_mod=mask_mod,
                                  aux_tensors=tables["aux"], block_sparse_tensors=tables["fwd"], return_lse=True)[:2]

    out, lse = forward(fm._mask_function())
    got_out, got_lse = forward(tables["fwd_mask"])
    assert torch.equal(got_out, out) and torch.equal(got_lse, lse)

    def backward(mask_mod, aux):
        return fi._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=False, mask_mod=mask_mod,
                                  aux_tensors=aux, block_sparse_tensors=tables["bwd"])[:3]

    two, again = backward(fm._mask_function(), tables["aux"]), backward(fm._mask_function(), tables["aux"])
    for variant, aux in ((fm._packed_mask_function(), tables["bwd_aux"]), (tables["bwd_mask"], tables["bwd_aux"]),
                         (flash4_slot_bounds.slot_bounds_mask("two_tables"), tables["aux"])):
        for name, a, b, c in zip(("dq", "dk", "dv"), backward(variant, aux), two, again):
            spread = float((c.float() - b.float()).abs().max())
            err = float((a.float() - b.float()).abs().max())
            assert err <= 2 * spread + 1e-3 * float(b.float().abs().max()), f"{name}: {err} against {spread}"


@pytest.mark.gpu
def test_gpu_flash_attn_steps_leave_no_cyclic_garbage():
    """Training steps through the flash-attn backend (its launch replay recording calls)
    free what they allocated when they return, without Python's garbage collector: a
    reference cycle that held a recorded call's inputs (views of the KV stack) kept ~2 GiB
    of a 64k step allocated into the next one, where the memory policy planned around it."""
    import gc

    import transformers
    from test_stack_attention_regions import _flash4

    import dtree
    from dtree.losses import ppo_clip
    from dtree.ops.stack_attention import flash4_masked_call as fm
    from dtree.workloads import make_workload

    _flash4()  # skips without flash-attn-4 on a Hopper GPU
    cfg = transformers.Qwen2Config(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).train()
    rt = dtree.TreeRuntime(model, attention="flash-attn")
    replays = fm._launcher().replays
    gc.collect()
    gc.disable()
    try:
        for seed in range(3):
            forest = make_workload("agentic", seed=seed, vocab_size=1000, num_trees=1, system_prompt_len=300,
                                   trajectories=3, turn_len=(20, 200), target_unique_tokens=3000)
            rt.forward_backward(forest, ppo_clip())
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        gc.collect()
        assert torch.cuda.memory_allocated() == held, "cyclic garbage held CUDA memory after the steps"
    finally:
        gc.enable()
    assert fm._launcher().replays > replays  # the later layers replayed
