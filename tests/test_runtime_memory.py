"""Activation memory: retain mode holds graphs of the current path only; recompute
mode holds one chunk. Measured independently of the runtime's own counters, by
tracking the bytes autograd saves (saved-tensor hooks), excluding parameters and the
stacks' preallocated buffers (K/V and recurrent states)."""

from __future__ import annotations

import weakref

import pytest
import torch
from hf_models import make_model
from test_families import build

import dtree

# a plain model, and a hybrid whose recurrent states go through the state stack (its
# stack reads and final-state seeds must not keep a segment's graph alive)
MODELS = {"llama": lambda: make_model("llama"), "qwen3_5_text": lambda: build("qwen3_5_text")}


class SavedBytes:
    """Peak bytes of distinct storages autograd keeps for backward."""

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
        if key in self.exclude or st.nbytes() == 0:
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
