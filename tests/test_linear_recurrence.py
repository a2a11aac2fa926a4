"""linear_recurrence and causal_conv1d_segments over packed segments and the state stack,
against the naive recurrence / convolution run on each root-to-leaf path on its own.

The tree (segments, tokens): A(5) -> B(3) -> D(2), A -> C(4). Call 1 runs A and stores
its final state; call 2 packs B, C and D, where B and C read A's state from the stack and
D continues B inside the call (an in-call parent). The loss weights every unique token's
output once; its gradient with respect to every input row (and the parameters) must be
what autograd gives through the paths A+B+D and A+C computed naively, the shared rows
of A used by both. Backward runs as the walk runs it: call 2 first (it adds d/d(A's
state) into the stack), then call 1 (whose output carries the seed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtree.ops.linear_recurrence import linear_recurrence, recurrence_naive, recurrence_reference
from dtree.ops.segment_states import LayerStates, StateLayout
from dtree.ops.short_conv import causal_conv1d_reference, causal_conv1d_segments
from dtree.stacks.state_stack import StateStack

LENGTHS = {"A": 5, "B": 3, "C": 4, "D": 2}
CALL1 = StateLayout(np.array([0, 5]), np.array([-1]), np.array([-1]), np.array([0]))
# call 2 rows: B (3), C (4), D (2); D's parent is B (segment 0 of the call)
CALL2 = StateLayout(np.array([0, 3, 7, 9]), np.array([-1, -1, 0]), np.array([0, 0, -1]), np.array([-1, -1, -1]))


def _rows(gen, n, *shape, positive=False):
    x = torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    return (-x.abs() * 0.3 if positive else x).requires_grad_(True)


def _inputs(kind: str, gen):
    """Per segment (q, k, v, g, beta): GDN-like (grouped heads, delta rule), KDA-like
    (per-key decay), SSD-like (no delta rule)."""
    hk, h, dk, dv = (1, 2, 3, 4) if kind == "gdn" else (2, 2, 3, 2)
    out = {}
    for name, n in LENGTHS.items():
        q, k, v = _rows(gen, n, hk, dk), _rows(gen, n, hk, dk), _rows(gen, n, h, dv)
        g = _rows(gen, n, h, dk, positive=True) if kind == "kda" else _rows(gen, n, h, positive=True)
        beta = None if kind == "ssd" else torch.rand(n, h, generator=gen, dtype=torch.float64).requires_grad_(True)
        out[name] = (q, k, v, g, beta)
    return out, dict(scale=0.7, qk_l2norm=kind != "ssd")


def _cat(parts):
    return [None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(5)]


@pytest.mark.parametrize("kind", ["gdn", "kda", "ssd"])
def test_recurrence_over_segments_matches_paths(kind):
    gen = torch.Generator().manual_seed(0)
    x, kw = _inputs(kind, gen)
    weights = {n: torch.randn(LENGTHS[n], x[n][2].shape[1], x[n][2].shape[2], generator=gen, dtype=torch.float64)
               for n in LENGTHS}

    # the reference: each path on its own, the shared segment's outputs counted once
    path_abd = _cat([x["A"], x["B"], x["D"]])
    o_abd, _ = recurrence_naive(*path_abd, None, kw["scale"], kw["qk_l2norm"])
    o_ac, _ = recurrence_naive(*_cat([x["A"], x["C"]]), None, kw["scale"], kw["qk_l2norm"])
    w_abd = torch.cat([weights["A"], weights["B"], weights["D"]])
    ref = (o_abd.double() * w_abd).sum() + (o_ac[5:].double() * weights["C"]).sum()
    leaves = [t for n in LENGTHS for t in x[n] if t is not None]
    ref_grads = torch.autograd.grad(ref, leaves)

    head_shape = (x["A"][2].shape[1], x["A"][0].shape[2], x["A"][2].shape[2])
    stack = StateStack([(0, "recurrent", head_shape)], 1, device="cpu", dtype=torch.float64)
    stack.zero_grad(0, 1)
    o1 = linear_recurrence(*x["A"], LayerStates(CALL1, stack, 0), **kw)
    o2 = linear_recurrence(*_cat([x["B"], x["C"], x["D"]]), LayerStates(CALL2, stack, 0), **kw)
    loss2 = (o2 * torch.cat([weights["B"], weights["C"], weights["D"]])).sum()
    loss1 = (o1 * weights["A"]).sum()
    torch.testing.assert_close(loss1 + loss2, ref, rtol=1e-10, atol=1e-10)
    # as the walk runs it: the child call's backward first (plain .backward(): the stack
    # reads' backward runs for every leaf), then the parent's, seeded from the stack
    loss2.backward()
    loss1.backward()
    for leaf, r in zip(leaves, ref_grads):
        torch.testing.assert_close(leaf.grad, r, rtol=1e-9, atol=1e-10)


def test_reference_backend_equals_naive_per_sequence():
    gen = torch.Generator().manual_seed(1)
    x, kw = _inputs("gdn", gen)
    q, k, v, g, beta = _cat([x["B"], x["C"]])
    init = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64)
    out, final = recurrence_reference(q, k, v, g, beta, np.array([0, 3, 7]), init, kw["scale"], True)
    o0, f0 = recurrence_naive(q[:3], k[:3], v[:3], g[:3], beta[:3], init[0], kw["scale"], True)
    torch.testing.assert_close(out[:3], o0.to(out.dtype))
    torch.testing.assert_close(final[0], f0)


def test_conv_over_segments_matches_paths():
    gen = torch.Generator().manual_seed(2)
    channels, kernel = 3, 4
    x = {n: torch.randn(m, channels, generator=gen, dtype=torch.float64) for n, m in LENGTHS.items()}
    x = {n: t.requires_grad_(True) for n, t in x.items()}
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64).requires_grad_(True)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64).requires_grad_(True)
    w = {n: torch.randn(m, channels, generator=gen, dtype=torch.float64) for n, m in LENGTHS.items()}

    (o_abd,), _ = causal_conv1d_reference([torch.cat([x["A"], x["B"], x["D"]])], weight, bias, [None])
    (o_ac,), _ = causal_conv1d_reference([torch.cat([x["A"], x["C"]])], weight, bias, [None])
    ref = (o_abd * torch.cat([w["A"], w["B"], w["D"]])).sum() + (o_ac[5:] * w["C"]).sum()
    leaves = [*x.values(), weight, bias]
    ref_grads = torch.autograd.grad(ref, leaves)

    stack = StateStack([(0, "conv", (kernel - 1, channels))], 1, device="cpu", dtype=torch.float64)
    stack.zero_grad(0, 1)
    o1 = causal_conv1d_segments(x["A"], weight, bias, LayerStates(CALL1, stack, 0))
    o2 = causal_conv1d_segments(torch.cat([x["B"], x["C"], x["D"]]), weight, bias, LayerStates(CALL2, stack, 0))
    loss2 = (o2 * torch.cat([w["B"], w["C"], w["D"]])).sum()
    loss1 = (o1 * w["A"]).sum()
    torch.testing.assert_close(loss1 + loss2, ref)
    loss2.backward()
    loss1.backward()
    for leaf, r in zip(leaves, ref_grads):
        torch.testing.assert_close(leaf.grad, r)


def test_conv_short_segments_reach_through_in_call_parents():
    """Segments shorter than the window read past their parent into the grandparent."""
    gen = torch.Generator().manual_seed(3)
    layout = StateLayout(np.array([0, 1, 2, 3]), np.array([-1, 0, 1]), np.array([-1, -1, -1]), np.array([-1, -1, -1]))
    x = torch.randn(3, 2, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    got = causal_conv1d_segments(x, weight, None, LayerStates(layout, None, 0))
    (ref,), _ = causal_conv1d_reference([x], weight, None, [None])
    torch.testing.assert_close(got, ref)
