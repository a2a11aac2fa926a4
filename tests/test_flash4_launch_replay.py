"""The one-call path's launch replay (dtree.ops.stack_attention.flash4_launch_replay) on CPU,
against a stand-in interface built like flash-attn-4's: compile caches whose compiled
functions are launched with the caller's tensors, scratch it allocates per call (zeroed,
accumulated into), a tables buffer, a NamedTuple argument. A replayed call must give
what the interface gives on the same inputs; keys the replay cannot serve keep calling
the interface. The real kernels' replay is checked on the GPU (tests/test_masked_call.py, ``-m gpu``)."""

from __future__ import annotations

import gc
import weakref
from typing import NamedTuple

import pytest
import torch

from dtree.ops.stack_attention.flash4_launch_replay import VERSION, Flash4LaunchReplay, tensor_key


class Aux(NamedTuple):
    tensors: list
    scalars: tuple | None


def _kernel(q, k, out, scale, acc, aux):
    """A 'compiled' launch: accumulates into its scratch (zeroed by the interface) and
    reads the tables through a NamedTuple."""
    acc += q.sum(0, keepdim=True) * scale + aux.tensors[0][: q.shape[1]]
    out.copy_(q * acc + k[: q.shape[0]])


class _FakeInterface:
    """flash-attn-4's shape: ``_flash_attn_fwd`` with a ``compile_cache``, ``maybe_contiguous``."""

    def __init__(self, copy_inputs: bool = False, offset_view: bool = False):
        self.copy_inputs, self.offset_view, self.compiles, self.calls = copy_inputs, offset_view, 0, 0

        def fwd(q, k, out, scale, tables):
            self.calls += 1
            q = q.clone() if self.copy_inputs else q
            k = k[1:] if self.offset_view else k
            key = (tuple(q.shape), float(scale))
            if key not in fwd.compile_cache:
                self.compiles += 1
                fwd.compile_cache[key] = _kernel
            acc = torch.zeros(1, q.shape[1])  # scratch, allocated zeroed per call
            self.scratch = weakref.ref(acc)
            fwd.compile_cache[key](q.detach(), k, out, scale, acc, Aux([tables], None))

        fwd.compile_cache = {}
        self._flash_attn_fwd = fwd

    def maybe_contiguous(self, x):
        return x.clone() if self.copy_inputs else x


def _call(replay: Flash4LaunchReplay, q, k, tables, scale=0.5):
    out = torch.empty_like(q)
    key = ("fwd", tensor_key(q, k), scale, tables.data_ptr())
    replay.run("fwd", key, (q, k, out), (tables,), lambda: replay.fi._flash_attn_fwd(q, k, out, scale, tables))
    return out


def _expected(q, k, tables, scale=0.5):
    out = torch.empty_like(q)
    _kernel(q, k, out, scale, torch.zeros(1, q.shape[1]), Aux([tables], None))
    return out


def test_later_calls_of_a_key_replay_the_recorded_launches():
    fi = _FakeInterface()
    replay = Flash4LaunchReplay(fi, VERSION)
    tables = torch.arange(8.0)
    g = torch.Generator().manual_seed(0)
    for step in range(4):  # new inputs each call; the scratch must start from zeros every time
        q, k = torch.randn(5, 4, generator=g), torch.randn(6, 4, generator=g)
        torch.testing.assert_close(_call(replay, q, k, tables), _expected(q, k, tables), rtol=0, atol=0)
    assert (fi.calls, replay.replays) == (1, 3)


def test_a_new_key_records_again():
    fi = _FakeInterface()
    replay = Flash4LaunchReplay(fi, VERSION)
    tables, other_tables = torch.arange(8.0), torch.arange(8.0) * 2
    q, k = torch.randn(5, 4), torch.randn(6, 4)
    for tab in (tables, tables, other_tables, other_tables):
        torch.testing.assert_close(_call(replay, q, k, tab), _expected(q, k, tab), rtol=0, atol=0)
    q2 = torch.randn(3, 4)
    torch.testing.assert_close(_call(replay, q2, k, tables), _expected(q2, k, tables), rtol=0, atol=0)
    torch.testing.assert_close(_call(replay, q2, k, tables), _expected(q2, k, tables), rtol=0, atol=0)
    assert (fi.calls, replay.replays) == (3, 3)


@pytest.mark.parametrize("kind", ["copy", "offset view", "other version"])
def test_keys_it_cannot_replay_keep_calling_the_interface(kind):
    fi = _FakeInterface(copy_inputs=kind == "copy", offset_view=kind == "offset view")
    replay = Flash4LaunchReplay(fi, "4.0.0b1" if kind == "other version" else VERSION)
    tables = torch.arange(8.0)
    for _ in range(3):
        q, k = torch.randn(5, 4), torch.randn(6, 4)
        want = _expected(q, k[1:] if kind == "offset view" else k, tables)
        torch.testing.assert_close(_call(replay, q, k, tables), want, rtol=0, atol=0)
    assert (fi.calls, replay.replays) == (3, 0)


def test_the_key_holds_alignment():
    buf = torch.randn(40)
    aligned, misaligned = buf[:16].view(4, 4), buf[1:17].view(4, 4)
    assert tensor_key(aligned) != tensor_key(misaligned)


def test_no_scratch_outlives_its_call():
    """Templates hold the scratch's layout, not the recorded call's tensor (on CUDA that
    memory would stay allocated between steps)."""
    fi = _FakeInterface()
    replay = Flash4LaunchReplay(fi, VERSION)
    tables = torch.arange(8.0)
    _call(replay, torch.randn(5, 4), torch.randn(6, 4), tables)
    gc.collect()
    assert replay.held["fwd"][1] is not None and fi.scratch() is None


def test_recording_leaves_no_reference_cycle():
    """Recording a call keeps none of its tensors alive once the caller drops them, without
    Python's garbage collector (the inputs are views of the KV stack: a cycle holding one
    kept the whole stack into the next step)."""
    fi = _FakeInterface()
    replay = Flash4LaunchReplay(fi, VERSION)
    tables = torch.arange(8.0)
    q, k = torch.randn(5, 4), torch.randn(6, 4)
    refs = [weakref.ref(q), weakref.ref(k)]
    gc.disable()
    try:
        _call(replay, q, k, tables)
        del q, k
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def _two_scratch_kernel(q, out, acc, count, aux):
    """A launch with two scratch tensors of other dtypes, both accumulated into."""
    acc += q.sum(0, keepdim=True)
    count += (q > 0).sum(0, keepdim=True).to(count.dtype)
    out.copy_(q * acc + count.to(q.dtype) + aux.tensors[0][: q.shape[1]])


class _TwoScratchInterface:
    def __init__(self):
        self.calls = 0

        def fwd(q, out, tables):
            self.calls += 1
            key = tuple(q.shape)
            if key not in fwd.compile_cache:
                fwd.compile_cache[key] = _two_scratch_kernel
            acc = torch.zeros(1, q.shape[1], dtype=torch.float64)  # scratch of other dtypes
            count = torch.zeros(1, q.shape[1], dtype=torch.int16)
            fwd.compile_cache[key](q, out, acc, count, Aux([tables], None))

        fwd.compile_cache = {}
        self._flash_attn_fwd = fwd

    def maybe_contiguous(self, x):
        return x


def test_scratch_of_several_dtypes_is_zeroed_in_one_buffer_per_replay():
    fi = _TwoScratchInterface()
    replay = Flash4LaunchReplay(fi, VERSION)
    tables = torch.arange(8.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        q = torch.randn(5, 4, generator=g)
        out = torch.empty_like(q)
        replay.run("fwd", ("fwd", tensor_key(q), tables.data_ptr()), (q, out), (tables,),
                   lambda: fi._flash_attn_fwd(q, out, tables))
        want = torch.empty_like(q)
        _two_scratch_kernel(q, want, torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.int16),
                            Aux([tables], None))
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert (fi.calls, replay.replays) == (1, 3)
    layout = replay.held["fwd"][1]._layout
    assert [layout.dtypes[p[0]] for p in layout.parts] == [torch.float64, torch.int16]
    offsets = [offset * torch.empty((), dtype=layout.dtypes[d]).element_size() for d, offset, *_ in layout.parts]
    assert offsets[0] == 0 and all(b % 256 == 0 for b in offsets)


def _slot_trees():
    from hypothesis import strategies as st

    from dtree.ops.stack_attention.flash4_launch_replay import _Input, _Scratch

    leaves = st.one_of(
        st.integers(-3, 3), st.none(), st.floats(allow_nan=False, width=32),
        st.builds(lambda i: _Input(i, (2, 3), (3, 1)), st.integers(0, 1)),
        st.builds(lambda i: _Input(i, (3, 2), (1, 3)), st.integers(0, 1)),
        st.builds(lambda i: _Scratch(i, (2,), (1,), torch.float32, torch.device("cpu")), st.integers(0, 1)),
    )
    return st.recursive(
        leaves,
        lambda kids: st.one_of(st.lists(kids, max_size=4), st.lists(kids, max_size=4).map(tuple),
                               st.builds(lambda a, b: Aux([a], b), kids, st.one_of(st.none(), st.tuples(kids)))),
        max_leaves=12,
    )


def test_binders_bind_what_the_tree_walk_binds():
    """Each launch's binder, built once per template, gives the same arguments as mapping
    _bind over the whole argument tree (the reference): same values, containers and types."""
    from hypothesis import given, settings

    from dtree.ops.stack_attention.flash4_launch_replay import _bind, _binder, _tree_map

    inputs = [torch.arange(6.0).view(2, 3), torch.arange(6.0, 12.0).view(2, 3)]
    scratch = [torch.zeros(2), torch.ones(2)]

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride() and \
                a.data_ptr() == b.data_ptr() and torch.equal(a, b)
        if isinstance(a, (tuple, list)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b or (a is None and b is None)

    @settings(max_examples=200, deadline=None)
    @given(_slot_trees())
    def check(args):
        want = _tree_map(args, lambda x: _bind(x, inputs, scratch))
        binder = _binder(args)
        got = args if binder is None else binder(inputs, scratch)
        assert same(want, got)

    check()
