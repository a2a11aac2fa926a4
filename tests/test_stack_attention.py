"""Stack attention backends against an independent float64 dense computation,
on random packed layouts (odd sizes, GQA, shared and multi-range prefixes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtree.kv_stack import KVStack
from dtree.ops.stack_attention import SegmentLayout, stack_attention


def random_layout(rng, num_segments, max_len, capacity_used):
    """Segments with random lengths; prefixes are random subsets of ranges below the
    group (sorted, disjoint), shared between some segments."""
    lens = rng.integers(1, max_len + 1, num_segments)
    q_off = np.concatenate([[0], np.cumsum(lens)])
    group_start = capacity_used
    shared = None
    prefixes = []
    for i in range(num_segments):
        if shared is not None and rng.random() < 0.4:
            prefixes.append(shared)  # sibling with the same ancestors
            continue
        cuts = np.sort(rng.choice(np.arange(1, group_start), size=min(group_start - 1, 2 * rng.integers(0, 3)), replace=False))
        ranges = tuple((int(cuts[j]), int(cuts[j + 1])) for j in range(0, len(cuts) - 1, 2))
        if rng.random() < 0.3:
            ranges = ((0, int(rng.integers(1, group_start))),)
        prefixes.append(ranges)
        shared = ranges
    return SegmentLayout(q_off, group_start + q_off[:-1], prefixes), int(q_off[-1])


def dense_expected(q, k, v, stack_k, stack_v, layout, scale):
    """float64, per segment, explicit index and mask."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for i in range(layout.num_segments):
        a, b = int(layout.q_offsets[i]), int(layout.q_offsets[i + 1])
        idx = [j for lo, hi in layout.prefix_ranges[i] for j in range(lo, hi)]
        kk = torch.cat([stack_k[idx], k[a:b]]).double().repeat_interleave(group, 1)
        vv = torch.cat([stack_v[idx], v[a:b]]).double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * scale
        p = len(idx)
        allowed = torch.arange(p + b - a)[None, :] <= (p + torch.arange(b - a))[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~allowed, -torch.inf), -1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("seed", range(6))
def test_backend_matches_dense(backend, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    hq, hkv, d = [(4, 4, 16), (6, 2, 12), (3, 1, 20)][seed % 3]
    used = int(rng.integers(5, 40))
    layout, t = random_layout(rng, int(rng.integers(1, 5)), 9, used)
    stack = KVStack(1, used + t + 7, hkv, d, dtype=torch.float32, device="cpu")
    stack.k.fill_(float("nan"))  # past `top` (and unread slots) must never leak in
    stack.v.fill_(float("nan"))
    stack.k[0, :used] = torch.randn(used, hkv, d)
    stack.v[0, :used] = torch.randn(used, hkv, d)
    stack.zero_grad(0, stack.capacity)
    q = torch.randn(t, hq, d, requires_grad=True)
    k = torch.randn(t, hkv, d, requires_grad=True)
    v = torch.randn(t, hkv, d, requires_grad=True)
    stack.write(0, used, k.detach(), v.detach())
    scale = d**-0.5
    out = stack_attention(q, k, v, stack, 0, layout, scale, backend)
    go = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)

    sk = stack.k[0, :used].clone().double().requires_grad_()
    sv = stack.v[0, :used].clone().double().requires_grad_()
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = dense_expected(qd, kd, vd, sk, sv, layout, scale)
    wdq, wdk, wdv, wsk, wsv = torch.autograd.grad(want, (qd, kd, vd, sk, sv), go.double())
    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.double(), want, **tol)
    for got, exp in [(dq, wdq), (dk, wdk), (dv, wdv), (stack.grad_k[0, :used], wsk), (stack.grad_v[0, :used], wsv)]:
        torch.testing.assert_close(got.double(), exp, **tol)
    assert torch.all(stack.grad_k[0, used:] == 0)  # nothing written past the prefix slots
