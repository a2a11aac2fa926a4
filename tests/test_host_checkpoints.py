"""Checkpointed layers' inputs kept in (pinned) host memory between the forward and the re-run
(``offload_checkpoints``, :mod:`dtree.models.host_checkpoints`).

Against HF run on each path in every mode and group budget: tests/test_checkpoint_layers.py. Bit for bit
against the same step keeping the inputs on the device; what autograd keeps (no layer input);
the group's bookkeeping (the same bits back, a copy independent of the original, entries
dropped without a backward); the policy's figures and the ``"auto"`` choice; bad values.
On CPU the inputs are cloned (the same steps, no streams); the pinned pages and the side
stream are tested on CUDA (tests/test_runtime_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from setups import SEQS, assert_exact, reference, run_dtree
from test_runtime_memory import peak_saved

import dtree
from dtree.config import RuntimeConfig
from dtree.models.host_checkpoints import HostCheckpoints
from dtree.plan.memory_probe import CallBytes
from dtree.plan.step_plan import offloads_checkpoints


@pytest.mark.parametrize("count", [1, True])
def test_offloaded_equals_kept_on_the_device_bit_for_bit(count):
    model = make_model("qwen2", tied=True)
    kept, kept_model = run_dtree(model, mode="auto", group_tokens=8, checkpoint_layers=count, offload_checkpoints=False)
    moved, moved_model = run_dtree(model, mode="auto", group_tokens=8, checkpoint_layers=count, offload_checkpoints=True)
    assert kept.metrics["memory_plan"]["offload_checkpoints"] is False
    assert kept.loss == moved.loss
    for (name, a), b in zip(kept_model.named_parameters(), moved_model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name


def test_offloaded_layers_keep_no_input_in_autograd():
    """Saved-tensor hooks see what autograd keeps between forward and backward: with the inputs
    offloaded, none of the layers' [T, hidden] inputs (test_checkpoint_layers' counterpart keeps
    one per layer)."""
    torch.manual_seed(0)
    model = make_model("llama")
    seqs = [torch.randint(0, 97, (160,)).tolist()]
    seqs += [seqs[0][:100] + torch.randint(0, 97, (60,)).tolist() for _ in range(3)]
    kept, moved = (peak_saved(model, seqs, mode="retain", group_tokens=4096, checkpoint_layers=True,
                              offload_checkpoints=offload, lean_layers=False) for offload in (False, True))
    row = dtree.Forest.from_sequences(seqs).num_unique_tokens * model.config.hidden_size * 4  # one float32 [T, hidden]
    assert kept - moved >= model.config.num_hidden_layers * row * 0.99, (kept, moved, row)


def test_the_group_gives_the_same_bits_back_from_a_copy():
    group = HostCheckpoints()
    tensors = [torch.randn(5, 7, dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float64)]
    entries = [group.put(t) for t in tensors]
    originals = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()  # the caller's tensor changes after the put: the copy does not
    for entry, original in zip(reversed(entries), reversed(originals)):
        back = group.get(entry)
        assert back.dtype == original.dtype and back.shape == original.shape
        assert torch.equal(back, original)


def test_puts_inside_a_unit_share_it_and_each_entry_comes_back_once():
    """A layer's puts (its input, the attention outputs it keeps) share a unit, which the backward of
    the layer above prefetches whole; a put outside a unit is a unit of its own; an entry taken twice
    (a second backward through offloaded layers) is refused instead of returning stale bytes."""
    group = HostCheckpoints()
    alone = group.put(torch.ones(2))
    with group.unit():
        layer = [group.put(torch.full((3,), float(i))) for i in range(3)]
    after = group.put(torch.zeros(4))
    assert (alone.unit, after.unit) == (0, 2) and {e.unit for e in layer} == {1}
    assert torch.equal(group.get(layer[2]), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="asked for twice"):
        group.get(layer[2])


def test_a_call_whose_backward_never_runs_leaves_nothing_behind():
    """A forward under offloading whose graph is dropped (an error before the backward) frees its
    entries with it; the next step runs as usual."""
    model = make_model("qwen2", tied=True)
    tree_model = copy.deepcopy(model)
    rt = dtree.TreeRuntime(tree_model, checkpoint_layers=True, offload_checkpoints=True, chunk_size=3)
    forest = dtree.Forest.from_sequences(SEQS)

    def bad_loss(*args, **kwargs):
        raise RuntimeError("the loss failed")

    with pytest.raises(Exception, match="the loss failed"):
        rt.forward_backward(forest, bad_loss)
    ref_model, ref_loss = reference(model)
    tree_model.zero_grad(set_to_none=True)
    out = rt.forward_backward(forest, dtree.losses.nll())
    assert_exact(tree_model, ref_model, out, ref_loss)


def test_offloading_figures():
    """A checkpointed layer keeps nothing on the device; a call keeps two layer inputs."""
    cb = CallBytes(full=1000.0, checkpointed=100.0, layers=4, layer_input=20.0)
    off = cb.offloading()
    assert off.call(4) == pytest.approx(100.0 - 4 * 20.0 + 2 * 20.0)
    assert off.call(0) == pytest.approx(cb.call(0))
    assert off.call(2) < cb.call(2)
    assert off.layer_input == 0.0


def test_the_policy_plans_with_what_offloading_frees():
    """Under ``memory="low"`` the lean recipe's predicted peak is lower with the inputs on the
    host, by about the layer inputs of one call (minus the two it keeps)."""
    from dtree.models import ModelSpec
    from dtree.plan.memory_policy import plan_step
    from dtree.plan.stack_sizes import step_shape

    model = make_model("qwen2", tied=True)
    spec = dtree.models.adapt(model).dtree_spec()
    seqs = [list(range(1, 4000))] + [list(range(1, 2000)) + list(range(5000, 7000))]
    shape = step_shape(dtree.Forest.from_sequences(seqs), 2048, False)
    cb = CallBytes(full=60_000.0, checkpointed=6_000.0, layers=spec.num_layers, layer_input=2_000.0)
    kw = {"on_cuda": True, "available": 8 * 2.0**30, "setting": "low", "call_bytes": cb}
    kept, moved = plan_step(spec, 2, shape, **kw), plan_step(spec, 2, shape, offload=True, **kw)
    assert moved.offload_checkpoints and not kept.offload_checkpoints
    assert moved.predicted_peak_bytes < kept.predicted_peak_bytes
    assert isinstance(spec, ModelSpec)


@pytest.mark.parametrize("mode,path", [("auto", "recompute"), ("recompute", "recompute"), ("retain", 28)])
def test_the_low_recipe_with_the_inputs_on_the_host(mode, path):
    """Larger calls than without (the call's inputs cost little device memory then), and the
    path recomputed unless the mode retains it (session V: retained, 10% slower)."""
    from dtree.plan.memory_model import RECOMPUTE
    from dtree.plan.memory_policy import LOW_GROUP_TOKENS, LOW_GROUP_TOKENS_OFFLOADED, _low_recipe

    on_host, on_device = _low_recipe(mode, 28, None, None, None, True), _low_recipe(mode, 28, None, None, None, False)
    assert (on_host.group_tokens, on_device.group_tokens) == (LOW_GROUP_TOKENS_OFFLOADED, LOW_GROUP_TOKENS)
    assert on_host.path == (RECOMPUTE if path == "recompute" else path)
    assert on_device.path == (RECOMPUTE if mode == "recompute" else 28)


class _View:
    def __init__(self, can=True, hf=False):
        self.can_checkpoint, self.hf_checkpointing = can, hf


@pytest.mark.parametrize("setting,device,view,expected", [
    ({"memory": "low"}, "cuda", _View(), True),
    ({"memory": 14.5}, "cuda", _View(), True),
    ({}, "cuda", _View(), False),  # memory="auto": the budget is what is free
    ({"memory": "low"}, "cpu", _View(), False),
    ({"offload_checkpoints": True}, "cpu", _View(), True),
    ({"memory": "low", "offload_checkpoints": False}, "cuda", _View(), False),
    ({"memory": "low"}, "cuda", _View(hf=True), False),
    ({"offload_checkpoints": True}, "cuda", _View(can=False), False),
])
def test_when_the_runtime_offloads(setting, device, view, expected):
    assert offloads_checkpoints(RuntimeConfig(**setting), torch.device(device), view) is expected


@pytest.mark.parametrize("value", ["yes", 1, None, "host"])
def test_bad_offload_values_are_refused(value):
    with pytest.raises(ValueError, match="offload_checkpoints must be True, False or 'auto'"):
        RuntimeConfig(offload_checkpoints=value)


def test_page_sizes_are_powers_of_two_that_hold_the_tensor():
    from dtree.models.host_checkpoints import PAGE_BYTES, SMALLEST_PAGE, page_size

    assert page_size(1) == SMALLEST_PAGE
    assert page_size(SMALLEST_PAGE + 1) == 2 * SMALLEST_PAGE
    mb = 12_220 * 1536 * 2  # a 12k-token layer input of qwen2.5-1.5b in bf16
    assert page_size(mb) == PAGE_BYTES >= mb
    assert page_size(10 * PAGE_BYTES) == PAGE_BYTES  # larger tensors take several pages
    for n in (3, 5 * 2**20 + 7, 40 * 2**20):
        size = page_size(n)
        assert size & (size - 1) == 0 and (size >= n or size == PAGE_BYTES) and (size < 2 * n or size == SMALLEST_PAGE)


@pytest.mark.gpu
def test_gpu_a_unit_comes_back_in_one_buffer_with_its_bits():
    """On CUDA a unit's tensors come back from the pinned pages into one device buffer (one
    allocator block per layer), each at an aligned offset, with the bits that were put."""
    from dtree.models.host_checkpoints import FETCH_ALIGN

    group = HostCheckpoints()
    tensors = [torch.randn(5, 7, device="cuda", dtype=torch.bfloat16), torch.randn(3, device="cuda"),
               torch.randn(11, 13, device="cuda", dtype=torch.bfloat16)]
    with group.unit():
        entries = [group.put(t) for t in tensors]
    back = [group.get(e) for e in reversed(entries)][::-1]
    torch.cuda.synchronize()
    assert len({b.untyped_storage().data_ptr() for b in back}) == 1
    assert all(b.data_ptr() % FETCH_ALIGN == 0 for b in back)
    for b, t in zip(back, tensors):
        assert b.dtype == t.dtype and torch.equal(b, t)
