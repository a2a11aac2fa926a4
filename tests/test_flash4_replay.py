"""dtree/ops/stack_attention/flash4_replay.py: flash-attn-4's compiled kernels launched directly after
one recorded interface call per call class.

CPU: a stand-in for ``flash_attn.cute.interface`` with flash-attn-4 4.0.0b36's SM90
protocol (each entry point allocates its scratch, looks its compiled functions up in
``compile_cache`` objects and launches them with the same argument lists; the
"compiled" functions here are torch code over those lists) checks the recording, the
comparison of rebuilt and recorded lists, the replay and the fallbacks. GPU: the real
flash-attn-4 in tests/test_stack_attention_regions.py (``-m gpu``), which also checks
that the replay engaged.
"""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dtree.ops.stack_attention.flash4_replay import Flash4Calls, bucket_len
from dtree.ops.stack_attention.regions import TORCH_REGIONS, RegionSeqs

AuxData = namedtuple("AuxData", "tensors scalars", defaults=(None, None))


def _seqs(cu_q, cu_k, used_q, used_k) -> RegionSeqs:
    q_start, k_start = cu_q[:-1].numpy(), cu_k[:-1].numpy()
    q_len = used_q.numpy() if used_q is not None else np.diff(cu_q.numpy())
    k_len = used_k.numpy() if used_k is not None else np.diff(cu_k.numpy())
    return RegionSeqs(q_start, q_len, k_start, k_len, used_q is not None, ("fake",))


class FakeInterface:
    """flash-attn-4's SM90 varlen protocol in torch. ``m_block_skew`` makes the
    backward allocate its scratch differently from what the replay rebuilds."""

    def __init__(self, arch: int = 90, m_block_skew: int = 0):
        self.arch, self.skew, self.calls = arch, m_block_skew, {"fwd": 0, "bwd": 0}
        self.AuxData, self.maybe_contiguous = AuxData, lambda x: x if x.is_contiguous() else x.contiguous()
        # functions with a compile_cache attribute, as the interface's module functions
        self._flash_attn_fwd, self._flash_attn_bwd = self._function(self._fwd), self._function(self._bwd)
        self._bwd_preprocess, self._bwd_postprocess_convert = self._function(None), self._function(None)

    @staticmethod
    def _function(impl):
        def function(*args, **kwargs):
            return impl(*args, **kwargs)

        function.compile_cache = {}
        return function

    def _get_device_arch(self):
        return self.arch

    @staticmethod
    def _tile_size_bwd_sm90(d, dv, causal, local):
        return SimpleNamespace(m_block_size=64 if causal else 80, n_block_size=128, dKV_swapAB=False)

    def _fwd(self, q, k, v, softmax_scale, causal, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                        seqused_k, max_seqlen_q, max_seqlen_k):
        self.calls["fwd"] += 1
        q, k, v = (self.maybe_contiguous(x) for x in (q, k, v))
        cache = self._flash_attn_fwd.compile_cache
        key = (causal, seqused_q is None)
        if key not in cache:
            def kernel(q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, *rest):
                TORCH_REGIONS.forward(q, k, v, _seqs(cu_q, cu_k, used_q, used_k), None, scale, causal, out, lse)

            cache[key] = kernel
        cache[key](q.detach(), k.detach(), v.detach(), out.detach(), lse, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                   seqused_q, seqused_k, None, None, None, None, None, AuxData(None, None), None, None)

    def _bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, deterministic, dq, dk, dv, cu_seqlens_q,
                        cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
        self.calls["bwd"] += 1
        q, k, v, out, dout, lse = (self.maybe_contiguous(x) for x in (q, k, v, out, dout, lse))
        m, n = (64 if causal else 80) + self.skew, 128
        hq, d, hkv = q.shape[1], q.shape[2], k.shape[1]
        d_r = -(-d // 32) * 32
        b = cu_seqlens_q.shape[0] - 1
        rows = (q.shape[0] + (b + 1) * m - 1) // m * m
        dq_accum, dpsum, lse2 = torch.empty(hq, rows * d_r), torch.empty(hq, rows), torch.empty(hq, rows)
        gqa = hq > hkv
        if gqa:
            keys = (k.shape[0] + (b + 1) * n - 1) // n * n
            dk_acc, dv_acc = torch.zeros(hkv, keys * d_r), torch.zeros(hkv, keys * d_r)
        sems = [None, None, None]
        if deterministic:
            sems[0] = torch.zeros(b, hq, -(-max_seqlen_q // m), 1, dtype=torch.int32)
            if gqa:
                sems[1], sems[2] = (torch.zeros(b, hkv, -(-max_seqlen_k // n), 2, dtype=torch.int32) for _ in "kv")
        cache = self._bwd_preprocess.compile_cache
        if "pre" not in cache:  # the protocol: in, [] and []= only
            cache["pre"] = _fake_preprocess
        cache["pre"](out, dout, dpsum, lse, lse2, dq_accum, cu_seqlens_q, seqused_q, None, None, None, 1.0, None, None)
        main_cache = self._flash_attn_bwd.compile_cache
        if causal not in main_cache:
            main_cache[causal] = lambda *args: _fake_backward(causal, gqa, *args)
        main_cache[causal](q.detach(), k.detach(), v.detach(), dout, lse2, dpsum, dq_accum, dk_acc if gqa else dk,
                           dv_acc if gqa else dv, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None,
                           None, *sems, AuxData(None, None), None, None)

        def convert(acc, o, scale, cu, used, sink, blocks):  # (the stand-in's dq is scaled already)
            o.copy_(acc[:, : o.shape[0] * o.shape[2]].reshape(o.shape[1], o.shape[0], -1).transpose(0, 1))

        cache = self._bwd_postprocess_convert.compile_cache
        if "post" not in cache:
            cache["post"] = convert
        post = cache["post"]
        post(dq_accum, dq, softmax_scale, cu_seqlens_q, seqused_q, None, None)
        if gqa:
            post(dk_acc, dk, softmax_scale, cu_seqlens_k, seqused_k, None, None)
            post(dv_acc, dv, 1.0, cu_seqlens_k, seqused_k, None, None)


def _fake_preprocess(out, dout, dpsum, lse, lse_log2, dq_accum, *rest):
    t = out.shape[0]
    dpsum[:, :t] = (out * dout).sum(-1).transpose(0, 1)
    lse_log2[:, :t] = lse  # (natural here: only this stand-in reads it)
    dq_accum.zero_()


def _fake_backward(causal, gqa, q, k, v, do, lse, delta, dq_acc, dk_o, dv_o, scale, cu_q, cu_k, used_q, used_k, *rest):
    """dq (into the accumulator, [Hq, T * Dr] read as [Hq, T, D]) and dk, dv (into their
    accumulators with GQA, else the outputs) of plain attention per sequence."""
    hq, d, hkv = q.shape[1], q.shape[2], k.shape[1]
    dq_rows = dq_acc[:, : q.shape[0] * d].view(hq, q.shape[0], d)
    dk_all, dv_all = (torch.zeros(k.shape[0], hq, d) for _ in range(2))
    seqs = _seqs(cu_q, cu_k, used_q, used_k)
    for rows, keys in TORCH_REGIONS._sequences(seqs):
        kk, vv = (x[keys].repeat_interleave(hq // hkv, 1) for x in (k, v))
        p = torch.exp(TORCH_REGIONS._scores(q[rows], k[keys], scale, causal, torch.float32) - lse[:, rows, None])
        ds = p * (torch.einsum("qhd,khd->hqk", do[rows], vv) - delta[:, rows, None])
        dq_rows[:, rows] += torch.einsum("hqk,khd->hqd", ds, kk) * scale
        dk_all[keys] += torch.einsum("hqk,qhd->khd", ds, q[rows]) * scale
        dv_all[keys] += torch.einsum("hqk,qhd->khd", p, do[rows])
    for out, grad in ((dk_o, dk_all), (dv_o, dv_all)):
        grad = grad.view(k.shape[0], hkv, hq // hkv, d).sum(2)
        if gqa:
            out[:, : k.shape[0] * d].copy_(grad.transpose(0, 1).reshape(hkv, -1))
        else:
            out.copy_(grad)


def _tables(q_start, q_len, k_start, k_len, ragged):
    t = {"cu_q": torch.tensor(np.r_[q_start, q_start[-1] + q_len[-1]], dtype=torch.int32),
         "cu_k": torch.tensor(np.r_[k_start, k_start[-1] + k_len[-1]], dtype=torch.int32)}
    if ragged:
        t["used_q"], t["used_k"] = torch.tensor(q_len, dtype=torch.int32), torch.tensor(k_len, dtype=torch.int32)
    return t


CASES = {  # (rows, keys, q_start, q_len, k_start, k_len, ragged, causal)
    "own": (13, 13, [0, 5, 6], [5, 1, 7], [0, 5, 6], [5, 1, 7], False, True),
    "level": (13, 20, [0, 9], [6, 4], [0, 8], [8, 11], True, False),
    "own2": (9, 9, [0, 4], [4, 5], [0, 4], [4, 5], False, True),
}


def _run(calls, name, hq=4, hkv=2, deterministic=False, seed=0, strided_q=False):
    """Forward and backward of case ``name`` through ``calls``; the results and the
    same through the torch region kernel. ``strided_q``: a [T, H, D] view of [H, T, D],
    which the stand-in's canonicalization copies."""
    rows, keys, qs, ql, ks, kl, ragged, causal = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((rows, hq), (keys, hkv), (keys, hkv)))
    if strided_q:
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    tables = _tables(*(np.asarray(x) for x in (qs, ql, ks, kl)), ragged)
    got = [torch.zeros(rows, hq, 16), torch.zeros(hq, rows)]
    calls.forward(q, k, v, tables, bucket_len(max(ql)), bucket_len(max(kl)), 0.25, causal, *got)
    dout = torch.randn(rows, hq, 16, generator=gen)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    calls.backward(q, k, v, got[0], dout, got[1], tables, bucket_len(max(ql)), bucket_len(max(kl)), 0.25, causal,
                   deterministic, *grads)
    seqs = RegionSeqs(*(np.asarray(x) for x in (qs, ql, ks, kl)), ragged, ("want",))
    want = [torch.zeros(rows, hq, 16), torch.zeros(hq, rows)]
    TORCH_REGIONS.forward(q, k, v, seqs, None, 0.25, causal, *want)
    want_grads = [torch.zeros_like(x) for x in (q, k, v)]
    TORCH_REGIONS.backward(q, k, v, want[0], dout, want[1], seqs, None, 0.25, causal, False, *want_grads)
    return got + grads, want + want_grads


@pytest.mark.parametrize("hq,hkv,deterministic,strided_q", [(4, 2, False, False), (2, 2, False, False),
                                                              (4, 2, True, False), (4, 2, False, True)])
def test_replay_launches_the_recorded_kernels(hq, hkv, deterministic, strided_q):
    fake = FakeInterface()
    calls = Flash4Calls(fake)
    for i, name in enumerate(["own", "level", "own2", "level", "own"]):
        got, want = _run(calls, name, hq, hkv, deterministic, seed=i, strided_q=strided_q)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    # one interface call per class (own: causal, level: ragged), the rest replayed
    assert fake.calls == {"fwd": 2, "bwd": 2}
    assert len(calls.kernels) == 4 and all(k is not None for k in calls.kernels.values())


def test_lists_that_differ_keep_the_interface():
    fake = FakeInterface(m_block_skew=16)  # scratch of another shape than the rebuilt one
    calls = Flash4Calls(fake)
    for i, name in enumerate(["own", "own2", "own"]):
        got, want = _run(calls, name, seed=i)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    assert fake.calls == {"fwd": 1, "bwd": 3}  # the forward's lists matched, the backward's did not
    assert [v is None for k, v in calls.kernels.items()] == [False, True]


def test_other_architectures_keep_the_interface():
    fake = FakeInterface(arch=100)
    calls = Flash4Calls(fake)
    for i, name in enumerate(["own", "own2"]):
        _run(calls, name, seed=i)
    assert fake.calls == {"fwd": 2, "bwd": 2} and not calls.kernels


def test_bucket_len():
    assert [bucket_len(n) for n in (1, 30, 128, 256, 257, 1000, 4096, 5000)] == [256] * 4 + [512, 1024, 4096, 8192]


def test_region_tables_are_16_byte_aligned():
    """flash-attn-4's backward copies a cu_seqlens / seqused table that does not start on
    a 16-byte boundary."""
    from dtree.ops.stack_attention.segment_layout import SegmentLayout

    for b in range(1, 7):
        seqs = RegionSeqs(np.arange(b) * 3, np.full(b, 3), np.arange(b) * 5, np.full(b, 4), True, ("t", b))
        layout = SegmentLayout(np.array([0, 3 * b]), np.array([0]), [()])
        tables = seqs.device_tables(layout, torch.device("cpu"))
        assert set(tables) == {"cu_q", "cu_k", "used_q", "used_k"}
        for name, t in tables.items():
            assert t.storage_offset() * 4 % 16 == 0, (b, name)
        assert tables["cu_q"].tolist() == list(range(0, 3 * b + 1, 3)) and tables["used_k"].tolist() == [4] * b
