"""Activation memory: retain mode holds graphs of the current path only; recompute
mode holds one chunk. Measured independently of the runtime's own counters, by
tracking the bytes autograd saves (saved-tensor hooks), excluding parameters and the
stacks' preallocated buffers (K/V and recurrent states)."""

from __future__ import annotations

import weakref

import pytest
import torch
from hf_models import make_model
from setups import SEQS
from test_families import build

import dtree
from dtree.models.host_checkpoints import host_page_bytes
from dtree.ops.rerun import in_rerun

# a plain model, and a hybrid whose recurrent states go through the state stack (its
# stack reads and final-state seeds must not keep a segment's graph alive)
MODELS = {"llama": lambda: make_model("llama"), "qwen3_5_text": lambda: build("qwen3_5_text")}


class SavedBytes:
    """Peak bytes of distinct storages autograd keeps for backward. Not what a checkpointed
    layer's re-run saves inside backward (:func:`dtree.ops.rerun.in_rerun`): one layer's
    activations, freed when its backward ends, never kept across the step."""

    def __init__(self, exclude: list[torch.Tensor]):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or st.nbytes() == 0 or in_rerun():
            return t
        holder = _Holder(t)
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Holder) else x


class _Holder:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def peak_saved(model, seqs, **rt_kw) -> int:
    rt = dtree.TreeRuntime(model, **rt_kw)
    forest = dtree.Forest.from_sequences(seqs)
    # a first step allocates the stack (reused by the second), so it can be excluded
    rt.forward_backward(forest, dtree.losses.nll("sum"))
    model.zero_grad(set_to_none=True)
    tracker = SavedBytes(list(model.parameters()) + rt.stack.tensors())
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        rt.forward_backward(forest, dtree.losses.nll("sum"))
    model.zero_grad(set_to_none=True)
    return tracker.peak


@pytest.mark.parametrize("arch", MODELS)
def test_retain_mode_is_bounded_by_the_path(arch):
    torch.manual_seed(0)
    model = MODELS[arch]()
    path = 96
    chain = [torch.randint(0, 97, (path,)).tolist()]
    # same path length, 16 branches: 9x the tokens of the chain
    root = chain[0][: path // 2]
    wide = [root + torch.randint(0, 97, (path // 2,)).tolist() for _ in range(16)]
    kw = dict(mode="retain", group_tokens=0, chunk_size=4096)
    p_chain = peak_saved(model, chain, **kw)
    p_wide = peak_saved(model, wide, **kw)
    assert p_wide < 1.25 * p_chain, (p_wide, p_chain)


@pytest.mark.parametrize("arch", MODELS)
def test_recompute_mode_keeps_one_chunk(arch):
    torch.manual_seed(0)
    model = MODELS[arch]()
    chunk = 16
    one_chunk = peak_saved(model, [torch.randint(0, 97, (chunk,)).tolist()], mode="retain", group_tokens=0)
    long_tree = [torch.randint(0, 97, (8 * chunk,)).tolist()]
    long_tree += [long_tree[0][: 4 * chunk] + torch.randint(0, 97, (3 * chunk,)).tolist() for _ in range(3)]
    p_recompute = peak_saved(model, long_tree, mode="recompute", group_tokens=0, chunk_size=chunk)
    p_retain = peak_saved(model, long_tree, mode="retain", group_tokens=0, chunk_size=chunk)
    assert p_recompute < 1.25 * one_chunk, (p_recompute, one_chunk)
    assert p_retain > 6 * one_chunk  # retain holds the whole 8-chunk path


def test_stack_sized_by_the_slots_written():
    """Issue 20: leaf calls without in-call ancestors never write their K/V to the stack,
    so a GRPO step (a prompt, then answers in leaf calls) allocates the prompt's slots
    only, in the training walk and in the log-prob walk; gradients and log-probs stay
    exactly those of a stack sized for every call (``stack_capacity``)."""
    import copy

    from reference import path_logprobs
    from setups import assert_exact, reference

    torch.manual_seed(0)
    model = make_model("qwen2")
    prompt = torch.randint(0, 97, (32,)).tolist()
    # answers that differ from their first token: no answer is another's in-call ancestor
    seqs = [prompt + [a] + torch.randint(0, 97, (15,)).tolist() for a in range(8)]
    forest = dtree.Forest.from_sequences(seqs)
    spec = dtree.TreeRuntime(model).spec
    slot_bytes = spec.num_layers * spec.num_kv_heads * 2 * spec.head_dim * (4 + 4)  # fp32 K/V and gradients
    for kw in (dict(group_tokens=64, chunk_size=32), dict(group_tokens=32, chunk_size=32)):
        lean_model, wide_model = copy.deepcopy(model), copy.deepcopy(model)
        lean = dtree.TreeRuntime(lean_model, mode="retain", **kw)
        out = lean.forward_backward(forest, dtree.losses.nll())
        # before: 32 + the largest answer call (64 or 32 tokens)
        assert out.stack_tokens == lean.stack.capacity == 32
        assert lean.stack.nbytes() == 32 * slot_bytes
        wide = dtree.TreeRuntime(wide_model, mode="retain", stack_capacity=32 + kw["group_tokens"], **kw)
        wide.forward_backward(forest, dtree.losses.nll())
        ref_model, _ = reference(model, seqs)
        assert_exact(lean_model, ref_model)
        assert_exact(wide_model, ref_model)
        inference = dtree.TreeRuntime(copy.deepcopy(model), **kw)
        lps = inference.logprobs(forest)
        assert inference.stack.capacity == 32 and not inference.stack.has_grad
        with torch.no_grad():
            for got, seq in zip(lps, seqs):
                torch.testing.assert_close(got, path_logprobs(model, seq), rtol=1e-5, atol=1e-5)


def test_after_step_releases_and_reports(monkeypatch):
    """On CUDA (faked here) the stack is dropped after every call; with
    ``free_after_step`` the allocator's cache is emptied too, and the step reports what
    is held and what was released; without, the cache is kept (and reported); on CPU
    nothing happens (also when the step failed)."""
    from types import SimpleNamespace

    from dtree.engine import step_memory

    gib = 2**30
    state = {"reserved": 10 * gib, "allocated": 4 * gib}

    def stats(device=None):  # the allocator's nested statistics, as torch.cuda reads them
        return {"allocated_bytes": {"all": {"current": state["allocated"], "peak": 9 * gib}},
                "reserved_bytes": {"all": {"current": state["reserved"], "peak": 10 * gib}}}

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: state.update(reserved=state["allocated"]))
    rt = dtree.TreeRuntime(make_model("qwen2"))
    released = []
    sentinel = SimpleNamespace(release=lambda: released.append(1))

    def call(placement, free: bool, fail: bool = False):
        """A call of ``rt`` on ``placement`` holding a stack; its report in a StepOutput-like value."""
        rt._planner.placement, rt._planner.stack = placement, sentinel
        rt.config = rt.config.replace(free_after_step=free)
        with rt._released() as after:
            if fail:
                raise RuntimeError("boom")
        return step_memory.with_report(SimpleNamespace(metrics={}), after, None)

    cuda = (torch.device("cuda", 0), torch.bfloat16)
    out = call(cuda, True)
    assert rt.stack is None
    assert out.metrics["memory"] == {
        "predicted_total_gib": None, "allocated_after_gib": 4.0, "reserved_after_gib": 4.0, "released_gib": 6.0,
        "peak_since_reset_gib": 9.0, "freed_after_step": True, "host_pinned_gib": host_page_bytes() / gib,
    }
    state["reserved"] = 10 * gib
    kept = call(cuda, False)
    assert rt.stack is None and kept.metrics["memory"]["reserved_after_gib"] == 10.0
    assert kept.metrics["memory"]["released_gib"] == 0.0 and not kept.metrics["memory"]["freed_after_step"]
    with pytest.raises(RuntimeError, match="boom"):
        call(cuda, True, fail=True)
    assert rt.stack is None  # released after a failed step too
    assert len(released) == 3
    cpu = call((torch.device("cpu"), torch.float32), True)
    assert cpu.metrics == {} and rt.stack is sentinel and len(released) == 3


@pytest.mark.parametrize("fail", [False, True])
def test_stack_buffers_are_gone_when_the_cache_is_emptied(monkeypatch, fail):
    """Where the runtime drops its stacks (CUDA; faked here on CPU), no buffer of them is
    referenced any more when the allocator's cache is emptied and the step's memory read
    (:func:`dtree.engine.step_memory.after_step`), although the step's plan, which holds
    the stacks, is still alive then (in the runtime's frame, or a failed step's
    traceback): ``free_after_step`` must be able to return those blocks."""
    import gc

    from dtree.engine import runtime
    from dtree.stacks.step_stacks import StepStacks

    held_at_release = []

    def after_step(device, free):
        gc.collect()
        held_at_release.append(sum(len(s.tensors()) for s in gc.get_objects() if isinstance(s, StepStacks)))
        return {}

    monkeypatch.setattr(runtime, "drops_stack", lambda device: True)
    monkeypatch.setattr(runtime, "after_step", after_step)
    rt = dtree.TreeRuntime(make_model("qwen2"), chunk_size=2)
    forest = dtree.Forest.from_sequences(SEQS)

    def loss(logprobs, forest):
        if fail:
            raise RuntimeError("the loss failed")
        return sum(lp.sum() for lp in logprobs)

    if fail:
        with pytest.raises(RuntimeError, match="the loss failed"):
            rt.forward_backward(forest, loss)
    else:
        rt.forward_backward(forest, dtree.losses.nll())
    assert held_at_release == [0] and rt._planner.stack is None


def test_stack_sized_by_the_slots_written_saves_on_qwen_1_5b():
    """Issue 20's figure, counted without allocating (meta tensors): a GRPO step, one
    2,048-token prompt and 16 answers of 1,024, on qwen2.5-1.5b's shape (28 layers, 2 KV
    heads of 128, bf16 K/V and float32 gradient slots). Its answers' calls write no slot,
    so the stack holds the prompt's 2,048 slots: 0.70 GB (8,192-token calls) and 1.41 GB
    (16,384-token calls) less than a stack with slots for every call's tokens."""
    from dtree.models import ModelSpec
    from dtree.plan.schedule import build_schedule
    from dtree.stacks.step_stacks import StepStacks

    spec = ModelSpec(num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, hidden_size=1536,
                     vocab_size=151936, intermediate_size=8960)
    prompt = list(range(2048))
    forest = dtree.Forest.from_sequences([prompt + [3000 + a] * 1024 for a in range(16)])

    def nbytes(slots: int) -> int:
        return StepStacks(spec, slots, 0, dtype=torch.bfloat16, device="meta", with_grad=True).nbytes()

    assert nbytes(1) == 28 * 2 * 128 * 2 * (2 + 4)  # one slot: K and V in bf16, their gradients in float32
    for group_tokens, every_call in ((8192, 10240), (16384, 18432)):
        sched = build_schedule(forest, chunk_size=2048, group_tokens=group_tokens)
        # every call's tokens: the prompt, then the largest leaf call
        assert max(g.stack_start + g.num_tokens for g in sched.groups) == every_call
        assert sched.stack_tokens == 2048
        saved = nbytes(every_call) - nbytes(sched.stack_tokens)
        assert saved == (every_call - 2048) * 86016
        assert round(saved / 1e9, 2) == {8192: 0.70, 16384: 1.41}[group_tokens]


def test_allocator_bytes_reads_what_the_three_counters_read():
    """One read of the allocator's statistics gives torch.cuda's allocated, reserved and peak counters
    (zeros before CUDA is initialized, as those return); on a GPU, against them directly."""
    from dtree.device.allocator import AllocatorBytes, allocator_bytes

    if not torch.cuda.is_available():
        assert allocator_bytes(torch.device("cuda", 0)) == AllocatorBytes(0, 0, 0)
        return
    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(3 << 20, device=device)  # noqa: F841 (allocated while the counters are read)
    got = allocator_bytes(device)
    assert got == AllocatorBytes(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                                 torch.cuda.max_memory_allocated(device))

