"""The KV-stack ops (dtree.ops.stack_ops): the torch fallback against explicit per-slot
loops and transformers' own rotary on CPU; on a GPU, the CUDA extension (csrc/) against
the fallback, bit for bit, and inside a CUDA graph replayed at other slot offsets.

Sizes are odd on purpose (7 rows, 3 heads, head dims 60 / 40, rotary over 40 of 60)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rotary
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as qwen2_rotary

from dtree.ops.stack_ops import SlotRows
from dtree.ops.stack_ops import interface as stack_ops
from dtree.ops.stack_ops import reference as stack_ops_torch
from dtree.ops.stack_ops.kv_stack import KVStack

CAP, HEADS, DK, DV = 29, 3, 60, 40


def _rope(rows: int, dim: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style cos/sin [rows, dim] (the halves repeated), positions 5 .. 5 + rows."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(5, 5 + rows, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _slots(dtype, gen, dim=DK):
    return torch.randn(CAP, HEADS, dim, generator=gen).to(dtype)


def test_push_without_rotary_is_a_copy_into_the_slots():
    gen = torch.Generator().manual_seed(0)
    ks, vs = _slots(torch.bfloat16, gen), _slots(torch.bfloat16, gen, DV)
    want_k, want_v = ks.clone(), vs.clone()
    k = torch.randn(HEADS, 7, DK, generator=gen).transpose(0, 1)  # float32, strided: converted
    v = torch.randn(7, HEADS, DV, generator=gen)
    stack_ops.push_kv(ks, vs, 11, k, v)
    for t in range(7):
        want_k[11 + t] = k[t].to(torch.bfloat16)
        want_v[11 + t] = v[t].to(torch.bfloat16)
    assert torch.equal(ks, want_k) and torch.equal(vs, want_v)


@pytest.mark.parametrize("rot", [DK, 40], ids=["full", "partial"])
def test_push_rotary_matches_transformers(rot):
    """Full rotary is Qwen2's ``apply_rotary_pos_emb``; partial (the first ``rot`` dims)
    is GPT-NeoX's, which passes the rest through. float64 end to end."""
    gen = torch.Generator().manual_seed(1)
    ks, vs = _slots(torch.float64, gen), _slots(torch.float64, gen, DV)
    k = torch.randn(7, HEADS, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(7, HEADS, DV, generator=gen, dtype=torch.float64)
    cos, sin = _rope(7, rot)
    stack_ops.push_kv(ks, vs, 3, k, v, cos=cos, sin=sin)
    kt = k.transpose(0, 1)[None]  # [1, heads, rows, dim], HF's layout
    hf = qwen2_rotary if rot == DK else neox_rotary
    _, want = hf(kt, kt, cos[None], sin[None])
    torch.testing.assert_close(ks[3:10], want[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
    assert torch.equal(vs[3:10], v)


def test_push_rotary_rounds_once_from_float32():
    """16-bit keys rotate in float32 and are rounded once (closer to the float64 result
    than transformers' bf16 arithmetic, never farther)."""
    gen = torch.Generator().manual_seed(2)
    ks, vs = _slots(torch.bfloat16, gen), _slots(torch.bfloat16, gen, DV)
    k = torch.randn(7, HEADS, DK, generator=gen).to(torch.bfloat16)
    cos, sin = _rope(7, DK, torch.float32)
    stack_ops.push_kv(ks, vs, 0, k, torch.zeros(7, HEADS, DV, dtype=torch.bfloat16), cos=cos, sin=sin)
    exact = stack_ops_torch.rotary(k.double(), cos.double(), sin.double())
    assert torch.equal(ks[:7], exact.to(torch.float32).to(torch.bfloat16))


def test_seed_grad_adds_the_slots_in_float32_and_rounds_once():
    gen = torch.Generator().manual_seed(3)
    gks, gvs = _slots(torch.float32, gen), _slots(torch.float32, gen, DV)
    gk = torch.randn(7, HEADS, DK, generator=gen).to(torch.bfloat16)
    out_k, out_v = stack_ops.seed_grad(gks, gvs, 20, gk, None, 7, torch.bfloat16, torch.bfloat16)
    for t in range(7):
        assert torch.equal(out_k[t], (gks[20 + t] + gk[t].float()).to(torch.bfloat16))
        assert torch.equal(out_v[t], gvs[20 + t].to(torch.bfloat16))  # no incoming dv: the slots alone


def test_zero_slots_clears_every_layer_and_nothing_else():
    stack = KVStack(3, CAP, HEADS, DK, v_head_dim=DV, dtype=torch.float32, device="cpu")
    stack.grad_k.fill_(1.0)
    stack.grad_v.fill_(2.0)
    stack.zero_grad(4, 9)
    assert torch.all(stack.grad_k[:, 4:9] == 0) and torch.all(stack.grad_v[:, 4:9] == 0)
    assert torch.all(stack.grad_k[:, :4] == 1) and torch.all(stack.grad_k[:, 9:] == 1)
    assert torch.all(stack.grad_v[:, :4] == 2) and torch.all(stack.grad_v[:, 9:] == 2)


def test_slot_rows_tables():
    rows = SlotRows.from_numpy(np.array([7, 3, 7, 3, 7, 1]), "cpu")
    assert rows.index.tolist() == [7, 3, 7, 3, 7, 1]
    assert rows.sorted_slots.tolist() == [1, 3, 3, 7, 7, 7]
    assert rows.order.tolist() == [5, 1, 3, 0, 2, 4]  # stable: each slot's rows in row order
    assert [r.tolist() for r in rows.rank_rows] == [[0, 1, 5], [2, 3], [4]]
    empty = SlotRows.from_numpy(np.zeros(0, dtype=np.int64), "cpu")
    assert empty.index.numel() == 0 and empty.rank_rows == ()


@pytest.mark.parametrize("build", ["numpy", "tensor"])
def test_segment_add_sums_each_slot_in_row_order(build):
    """Bit for bit the loop ``slot += row`` in row order (float32), repeated slots included."""
    gen = torch.Generator().manual_seed(4)
    gks, gvs = _slots(torch.float32, gen), _slots(torch.float32, gen, DV)
    slots = np.array([9, 0, 9, 28, 9, 0, 13])
    dk = (torch.randn(7, HEADS, DK, generator=gen) * 1e3).to(torch.bfloat16)  # wide range: order matters
    dv = torch.randn(7, HEADS, DV, generator=gen)
    want_k, want_v = gks.clone(), gvs.clone()
    for j, s in enumerate(slots):
        want_k[s] += dk[j].float()
        want_v[s] += dv[j]
    rows = SlotRows.from_numpy(slots, "cpu") if build == "numpy" else SlotRows.from_tensor(torch.tensor(slots))
    stack_ops.segment_add(gks, gvs, rows, dk, dv)
    assert torch.equal(gks, want_k) and torch.equal(gvs, want_v)


def test_gather_slots():
    gen = torch.Generator().manual_seed(5)
    ks, vs = _slots(torch.bfloat16, gen), _slots(torch.bfloat16, gen, DV)
    index = torch.tensor([4, 4, 0, 28])
    gk, gv = stack_ops.gather_slots(ks, vs, index)
    assert torch.equal(gk, ks[index]) and torch.equal(gv, vs[index])


def test_bad_arguments_are_refused_on_the_host():
    ks, vs = torch.zeros(CAP, HEADS, DK), torch.zeros(CAP, HEADS, DV)
    k, v = torch.zeros(7, HEADS, DK), torch.zeros(7, HEADS, DV)
    with pytest.raises(ValueError, match=r"slots \[25, 32\) are outside the stack's capacity 29"):
        stack_ops.push_kv(ks, vs, 25, k, v)
    with pytest.raises(ValueError, match="k has 7 rows and v 6"):
        stack_ops.push_kv(ks, vs, 0, k, v[:6])
    with pytest.raises(ValueError, match="both cos and sin"):
        stack_ops.push_kv(ks, vs, 0, k, v, cos=torch.zeros(7, DK))
    with pytest.raises(ValueError, match="R even and <= 60"):
        stack_ops.push_kv(ks, vs, 0, k, v, cos=torch.zeros(7, 61), sin=torch.zeros(7, 61))
    with pytest.raises(ValueError, match="6 rows for 7 slots"):
        stack_ops.seed_grad(ks, vs, 0, k[:6], None, 7, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="7 and 7 rows of dK/dV for 3 slots"):
        stack_ops.segment_add(ks, vs, SlotRows.from_numpy(np.array([1, 2, 3]), "cpu"), k, v)


def test_cpu_runs_the_torch_ops_and_says_why_the_extension_is_not_used():
    assert not stack_ops.uses_extension(torch.zeros(1))
    reason = stack_ops.extension_error()
    if reason is not None:  # a CPU machine: nothing was built
        assert "dtree._stack_ops_cuda" in reason or "DTREE_STACK_OPS" in reason
    with stack_ops.extension_disabled():
        assert stack_ops.extension_error() is not None


# ------------------------------------------------------------------ GPU: extension vs fallback
def _need_extension():
    if stack_ops.extension_error() is not None:
        pytest.skip(f"the CUDA extension is not in use: {stack_ops.extension_error()}")


def _both(fn):
    """``fn()`` with the extension, then with the torch ops (each on fresh buffers)."""
    with_ext = fn()
    with stack_ops.extension_disabled():
        without = fn()
    return with_ext, without


def _assert_same_bits(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("rot", [None, DK, 40], ids=["plain", "rotary", "partial"])
def test_extension_push_matches_the_fallback_bitwise(dtype, rot):
    _need_extension()

    def run():
        gen = torch.Generator().manual_seed(6)
        ks, vs = _slots(dtype, gen).cuda(), _slots(dtype, gen, DV).cuda()
        k = torch.randn(HEADS, 7, DK, generator=gen).to(dtype).cuda().transpose(0, 1)  # HF's strided view
        v = torch.randn(7, HEADS, DV, generator=gen).to(dtype).cuda()
        cos, sin = (x.cuda() for x in _rope(7, rot, torch.float32)) if rot else (None, None)
        stack_ops.push_kv(ks, vs, 9, k, v, cos=cos, sin=sin)
        return ks, vs

    _assert_same_bits(*_both(run))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("incoming", ["both", "k only", "none"])
def test_extension_seed_zero_gather_match_the_fallback_bitwise(dtype, incoming):
    _need_extension()
    wide = torch.float64 if dtype == torch.float64 else torch.float32

    def run():
        gen = torch.Generator().manual_seed(7)
        stack = KVStack(2, CAP, HEADS, DK, v_head_dim=DV, dtype=dtype, device="cuda", grad_dtype=wide)
        for buf in (stack.k, stack.v, stack.grad_k, stack.grad_v):
            buf.copy_(torch.randn(buf.shape, generator=gen))
        gk = torch.randn(7, HEADS, DK, generator=gen).to(dtype).cuda() if incoming != "none" else None
        gv = torch.randn(7, HEADS, DV, generator=gen).to(dtype).cuda() if incoming == "both" else None
        seeded = stack.seed_grad(1, 12, 19, gk, gv, (dtype, dtype))
        gathered = stack.gather(0, torch.tensor([3, 3, 28, 0], device="cuda"))
        stack.zero_grad(2, 6)
        return (*seeded, *gathered, stack.grad_k, stack.grad_v)

    _assert_same_bits(*_both(run))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("build", ["numpy", "tensor"])
def test_extension_segment_add_matches_the_fallback_bitwise_and_repeats(dtype, build):
    _need_extension()
    slots = np.random.default_rng(8).integers(0, CAP, size=300)  # every slot ~10 times

    def run():
        gen = torch.Generator().manual_seed(8)
        gks, gvs = _slots(torch.float32, gen).cuda(), _slots(torch.float32, gen, DV).cuda()
        dk = (torch.randn(300, HEADS, DK, generator=gen) * 1e3).to(dtype).cuda()
        dv = torch.randn(300, HEADS, DV, generator=gen).to(dtype).cuda()
        rows = SlotRows.from_numpy(slots, "cuda") if build == "numpy" else SlotRows.from_tensor(
            torch.tensor(slots, device="cuda")
        )
        stack_ops.segment_add(gks, gvs, rows, dk, dv)
        return gks, gvs

    first, fallback = _both(run)
    _assert_same_bits(first, fallback)
    _assert_same_bits(first, run())  # and again: no atomics, the same bits


@pytest.mark.gpu
def test_extension_ops_replay_in_a_cuda_graph_at_other_offsets():
    """push + seed + zero captured once, replayed with the slot offset written on the device."""
    _need_extension()
    gen = torch.Generator().manual_seed(9)
    stack = KVStack(2, CAP, HEADS, DK, v_head_dim=DV, dtype=torch.bfloat16, device="cuda")
    stack.grad_k.copy_(torch.randn(stack.grad_k.shape, generator=gen))
    stack.grad_v.copy_(torch.randn(stack.grad_v.shape, generator=gen))
    k = torch.randn(7, HEADS, DK, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(7, HEADS, DV, generator=gen).to(torch.bfloat16).cuda()
    gk = torch.randn(7, HEADS, DK, generator=gen).to(torch.bfloat16).cuda()
    device_lo = torch.zeros(1, dtype=torch.int64, device="cuda")

    def ops(target, lo, dlo):
        target.push(1, lo, k, v, device_lo=dlo)
        out = target.seed_grad(1, lo, lo + 7, gk, None, (torch.bfloat16, torch.bfloat16), device_lo=dlo)
        target.zero_grad(lo, lo + 7, device_lo=dlo)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops(stack, 0, device_lo)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    reference = KVStack(2, CAP, HEADS, DK, v_head_dim=DV, dtype=torch.bfloat16, device="cuda")
    reference.grad_k.copy_(stack.grad_k)
    reference.grad_v.copy_(stack.grad_v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops(stack, 0, device_lo)
    for lo in (4, 17, 22):
        device_lo.fill_(lo)
        graph.replay()
        want = ops(reference, lo, None)
        torch.cuda.synchronize()
        assert torch.equal(stack.k[1, lo : lo + 7], k) and torch.equal(stack.v[1, lo : lo + 7], v)
        _assert_same_bits(captured, want)
        assert torch.all(stack.grad_k[:, lo : lo + 7] == 0)
