"""KVStack's push / accumulate / zero_grad against explicit per-slot loops, with value
head dims that differ from the key head dim (MLA), strided inputs, repeated slots, and
under torch.compile."""

from __future__ import annotations

import pytest
import torch

from dtree.ops.stack_ops.kv_stack import KVStack

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def filled(stack: KVStack, gen: torch.Generator) -> KVStack:
    for buf in (stack.k, stack.v, stack.grad_k, stack.grad_v):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    return stack


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", [(60, 60), (24, 16)], ids=["same", "mla"])
def test_push_accumulate_zero_match_slot_loops(device, dims):
    dk_dim, dv_dim = dims
    gen = torch.Generator().manual_seed(0)
    stack = filled(KVStack(3, 37, 2, dk_dim, v_head_dim=dv_dim, dtype=torch.bfloat16, device=device), gen)
    assert stack.k.shape == (3, 37, 2, dk_dim) and stack.v.shape == (3, 37, 2, dv_dim)
    assert stack.grad_v.shape == stack.v.shape and stack.grad_v.dtype == torch.float32
    want = {n: getattr(stack, n).clone() for n in ("k", "v", "grad_k", "grad_v")}

    # push: transposed float32 views (what the HF adapter hands over), converted to bf16
    k = torch.randn(2, 5, dk_dim, generator=gen).to(device).transpose(0, 1)
    v = torch.randn(2, 5, dv_dim, generator=gen).to(device).transpose(0, 1)
    stack.push(1, 30, k, v)
    for t in range(5):
        want["k"][1, 30 + t] = k[t].to(torch.bfloat16)
        want["v"][1, 30 + t] = v[t].to(torch.bfloat16)

    # accumulate into a slice, and into repeated slots
    dk = torch.randn(4, 2, dk_dim, generator=gen).to(device)
    dv = torch.randn(4, 2, dv_dim, generator=gen).to(device)
    stack.accumulate(2, slice(3, 7), dk, dv)
    index = torch.tensor([9, 0, 9, 36], device=device)
    stack.accumulate(0, index, dk, dv)
    stack.accumulate(1, slice(10, 18, 2), dk, dv)
    for t in range(4):
        want["grad_k"][2, 3 + t] += dk[t]
        want["grad_v"][2, 3 + t] += dv[t]
        want["grad_k"][0, int(index[t])] += dk[t]
        want["grad_v"][0, int(index[t])] += dv[t]
        want["grad_k"][1, 10 + 2 * t] += dk[t]
        want["grad_v"][1, 10 + 2 * t] += dv[t]

    stack.zero_grad(5, 11)
    want["grad_k"][:, 5:11] = 0
    want["grad_v"][:, 5:11] = 0
    for name, expected in want.items():
        torch.testing.assert_close(getattr(stack, name), expected, atol=0, rtol=0, msg=name)


def test_accumulate_refuses_a_mis_sized_slice():
    stack = KVStack(1, 8, 1, 4, dtype=torch.float32, device="cpu")
    one_row = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match=r"1 rows of dK/dV for the 3 slots \[2, 5\)"):
        stack.accumulate(0, slice(2, 5), one_row, one_row)


def test_fits_checks_the_value_head_dim():
    stack = KVStack(2, 16, 2, 24, v_head_dim=16, dtype=torch.float32, device="cpu", with_grad=False)
    assert stack.fits(2, 10, 2, 24, torch.float32, "cpu", False, v_head_dim=16)
    assert not stack.fits(2, 10, 2, 24, torch.float32, "cpu", False)  # v_head_dim None means 24
    assert not stack.fits(2, 10, 2, 24, torch.float32, "cpu", True, v_head_dim=16)  # no grad buffers
    assert not stack.fits(2, 17, 2, 24, torch.float32, "cpu", False, v_head_dim=16)


def _session(stack: KVStack, k, v, lo):
    stack.zero_grad(lo, lo + k.shape[0])
    stack.push(1, lo, k, v)
    stack.accumulate(1, slice(lo, lo + k.shape[0]), k * 2, v * 3)
    stack.accumulate(0, torch.arange(k.shape[0], device=k.device) + lo, k, v)
    return stack.grad_k[:, lo : lo + k.shape[0]].sum() + stack.v[1].sum()


def test_torch_compile_matches_eager():
    """The ops trace into one graph (the runtime compiles decoder layers around them)."""
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 6, generator=gen)
    stacks = [KVStack(2, 16, 2, 8, v_head_dim=6, dtype=torch.float32, device="cpu") for _ in range(2)]
    for s in stacks:
        for buf in (s.k, s.v, s.grad_k, s.grad_v):
            buf.zero_()
    compiled = torch.compile(_session, backend="aot_eager", fullgraph=True, dynamic=True)
    for lo in (2, 9):  # two slot offsets through one (dynamic) graph
        torch.testing.assert_close(compiled(stacks[0], k, v, lo), _session(stacks[1], k, v, lo))
    for name in ("k", "v", "grad_k", "grad_v"):
        assert torch.equal(getattr(stacks[0], name), getattr(stacks[1], name)), name


def _short_and_full(grad_slots: int, gen: torch.Generator, dtype=torch.float32):
    """A stack with ``grad_slots`` gradient slots and one with all 20, the same K/V, and the
    full one's gradient slots past ``grad_slots`` zero (what the short one reads there)."""
    full = filled(KVStack(2, 20, 2, 6, v_head_dim=4, dtype=dtype, device="cpu"), gen)
    short = KVStack(2, 20, 2, 6, v_head_dim=4, dtype=dtype, device="cpu", grad_slots=grad_slots)
    assert short.grad_slots == grad_slots and short.grad_k.shape == (2, grad_slots, 2, 6)
    assert short.grad_v.shape == (2, grad_slots, 2, 4)
    full.grad_k[:, grad_slots:] = 0
    full.grad_v[:, grad_slots:] = 0
    for name in ("k", "v"):
        getattr(short, name).copy_(getattr(full, name))
    short.grad_k.copy_(full.grad_k[:, :grad_slots])
    short.grad_v.copy_(full.grad_v[:, :grad_slots])
    return short, full


def _same(short: KVStack, full: KVStack) -> None:
    n = short.grad_slots
    assert torch.equal(short.grad_k, full.grad_k[:, :n]) and torch.equal(short.grad_v, full.grad_v[:, :n])
    assert not full.grad_k[:, n:].any() and not full.grad_v[:, n:].any()


@pytest.mark.parametrize("lo,hi", [(2, 6), (6, 11), (8, 14), (12, 17)], ids=["below", "straddling", "at", "past"])
def test_short_gradient_slots_read_as_zero_past_their_end(lo, hi):
    """A stack with fewer gradient slots than K/V slots (the leaf calls' slots above the
    path's): zero_grad and seed_grad over any range give what a stack with every gradient
    slot gives when those past the end are zero, in the K/V dtypes asked for."""
    gen = torch.Generator().manual_seed(1)
    short, full = _short_and_full(8, gen)
    rows = hi - lo
    gk, gv = torch.randn(rows, 2, 6, generator=gen), torch.randn(rows, 2, 4, generator=gen)
    for a, b in ((gk, gv), (None, gv), (gk, None), (None, None)):
        got = short.seed_grad(1, lo, hi, a, b, (torch.bfloat16, torch.float32))
        want = full.seed_grad(1, lo, hi, a, b, (torch.bfloat16, torch.float32))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, atol=0, rtol=0)
    short.zero_grad(lo, hi)
    full.zero_grad(lo, hi)
    _same(short, full)


def test_adding_past_the_gradient_slots_grows_them_exactly():
    """An add into slots past the end (a call on a path the plan did not count on) first
    grows the gradient buffers: the old slots kept, the new ones zero, then added into; a
    slice grows them to its end, slots on the device to the capacity."""
    gen = torch.Generator().manual_seed(2)
    short, full = _short_and_full(5, gen)
    dk, dv = torch.randn(4, 2, 6, generator=gen), torch.randn(4, 2, 4, generator=gen)
    for stack in (short, full):
        stack.accumulate(0, slice(3, 7), dk, dv)
        stack.accumulate(1, slice(1, 5), dk, dv)  # inside: no growth
    assert short.grad_slots == 7
    _same(short, full)
    short.grad_slots_through(3)  # never shrinks
    assert short.grad_slots == 7
    index = torch.tensor([2, 11, 2, 0])
    for stack in (short, full):
        stack.accumulate(1, index, dk, dv)
    assert short.grad_slots == 20
    _same(short, full)
    assert short.fits(2, 20, 2, 6, torch.float32, "cpu", True, v_head_dim=4)


def test_fits_counts_gradient_slots():
    stack = KVStack(1, 16, 1, 4, dtype=torch.float32, device="cpu", grad_slots=6)
    assert stack.fits(1, 16, 1, 4, torch.float32, "cpu", True, grad_slots=6)
    assert not stack.fits(1, 16, 1, 4, torch.float32, "cpu", True, grad_slots=7)
    assert not stack.fits(1, 12, 1, 4, torch.float32, "cpu", True)  # None: every slot takes gradients
    assert stack.fits(1, 12, 1, 4, torch.float32, "cpu", False)  # a log-prob pass needs none
    with pytest.raises(ValueError, match="grad_slots must be in"):
        KVStack(1, 4, 1, 4, dtype=torch.float32, device="cpu", grad_slots=5)
