"""Stack attention backends against the naive float64 reference
(dtree/ops/stack_attention/reference.py) on output and every gradient: q, k, v, the
stack's prefix gradient buffers and the sinks. Random packed layouts (odd sizes, GQA,
shared and multi-range prefixes), a nested chain with in-call ancestors, every option
alone and together, value heads narrower than keys (MLA), float32 and float64."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from dtree.ops.stack_attention import AttentionOptions, SegmentLayout, StackSlots, seed_from_stack, stack_attention
from dtree.ops.stack_attention.reference import stack_attention_naive
from dtree.ops.stack_ops.kv_stack import KVStack


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


def nested_layout(used: int):
    """(layout, T): one call holding a chain A -> B -> C plus B's sibling D, all under
    the ``used`` stack slots: B, C and D read their in-call ancestors' K/V through the
    stack (``call_slots``), C's prefix has three ranges, D shares B's prefix."""
    lens = [11, 7, 13, 5]
    q_off = np.concatenate([[0], np.cumsum(lens)])
    own = used + q_off[:-1]
    a = ((0, used),)
    b = ((0, used + lens[0]),)  # the stack prefix and A, adjacent: one range
    c = ((0, used), (int(own[0]), int(own[0]) + lens[0]), (int(own[1]), int(own[1]) + lens[1]))
    layout = SegmentLayout(q_off, own, [a, b, c, b], call_slots=(used, used + int(q_off[-1])))
    return layout, int(q_off[-1])


# option sets: name -> (kwargs builder given (rng, Hq), value head dim or None)
def _slopes(gen, hq):
    return torch.rand(hq, generator=gen, dtype=torch.float64) * 0.5


OPTIONS = {
    "plain": lambda gen, hq: {},
    "softcap": lambda gen, hq: {"softcap": 1.7},
    "sinks": lambda gen, hq: {"sinks": torch.randn(hq, generator=gen, dtype=torch.float64) * 2},
    "alibi": lambda gen, hq: {"alibi_slopes": _slopes(gen, hq)},
    "window": lambda gen, hq: {"window": 6},
    "window1": lambda gen, hq: {"window": 1},
    "all": lambda gen, hq: {
        "softcap": 2.5,
        "sinks": torch.randn(hq, generator=gen, dtype=torch.float64),
        "alibi_slopes": _slopes(gen, hq),
        "window": 9,
    },
}


def unseen_slots(layout, used: int, window: int | None) -> list[int]:
    """Ancestor slots in ``[0, used)`` that no query of ``layout`` sees with ``window``
    (a segment with P prefix slots sees those at depth > P - window)."""
    if window is None:
        return []
    seen = set()
    for ranges in layout.prefix_ranges:
        slots = [j for lo, hi in ranges for j in range(lo, hi)]
        seen.update(slots[max(0, len(slots) - window + 1) :])
    return [j for j in range(used) if j not in seen]


def check_against_naive(
    attn, layout, t, used, hq, hkv, dk, dv=None, *, options=None, dtype=torch.float32, seed=0, grad_init=False,
    q_view=False, tol=None, device="cpu",
):
    """Run ``attn(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale, **options))``
    forward and backward and compare with :func:`stack_attention_naive` in float64 on the output, dq, dk, dv,
    dsinks and the stack's prefix gradients. The stack holds the ancestors in slots
    ``[0, used)``, the call's own K/V at ``[used, used + t)`` (as the runtime pushes
    them) and NaN everywhere else (never read), the ancestor slots out of every
    query's window included. ``grad_init``: the stack gradients hold
    other segments' contributions already (the backward must add to them). ``q_view``:
    q as the HF adapter passes it ([1, H, T, D] -> [T, H, D] strides)."""
    dv = dk if dv is None else dv
    gen = torch.Generator().manual_seed(seed)
    opts = {n: (x.to(device=device, dtype=dtype) if isinstance(x, torch.Tensor) else x) for n, x in (options or {}).items()}
    if "sinks" in opts:
        opts["sinks"].requires_grad_(True)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    stack = KVStack(1, used + t + 5, hkv, dk, v_head_dim=dv, dtype=dtype, device=device, grad_dtype=grad_dtype)
    stack.k.fill_(float("nan"))
    stack.v.fill_(float("nan"))
    stack.k[0, :used] = rand(used, hkv, dk)
    stack.v[0, :used] = rand(used, hkv, dv)
    q, k, v = rand(t, hq, dk).requires_grad_(), rand(t, hkv, dk).requires_grad_(), rand(t, hkv, dv).requires_grad_()
    stack.push(0, used, k.detach(), v.detach())
    clean_k, clean_v = stack.k[0, :used].clone(), stack.v[0, :used].clone()
    unseen = unseen_slots(layout, used, opts.get("window"))
    stack.k[0, unseen] = float("nan")
    stack.v[0, unseen] = float("nan")
    stack.grad_k.zero_()
    stack.grad_v.zero_()
    if grad_init:
        stack.grad_k.copy_(torch.randn(stack.grad_k.shape, generator=gen))
        stack.grad_v.copy_(torch.randn(stack.grad_v.shape, generator=gen))
    init_k, init_v = stack.grad_k[0].clone(), stack.grad_v[0].clone()
    q_in = q
    if q_view:
        q_in = q.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    scale = dk**-0.5
    k_in, v_in = k, v
    if layout.call_slots is not None:  # in-call ancestors' gradients come back through the stack, as in the runtime
        k_in, v_in = seed_from_stack(k, v, stack, 0, *layout.call_slots)
    out = attn(q_in, k_in, v_in, StackSlots(stack, 0, layout), AttentionOptions(scale=scale, **opts))
    assert out.shape == (t, hq, dv) and out.dtype == dtype
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    leaves = [q_in, k, v] + ([opts["sinks"]] if "sinks" in opts else [])
    got = torch.autograd.grad(out, leaves, go)

    # float64 ground truth; in-call ancestors read the call's own k/v through the stack
    sk = clean_k.double().requires_grad_()
    sv = clean_v.double().requires_grad_()
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_opts = {n: (x.detach().double().requires_grad_(n == "sinks") if isinstance(x, torch.Tensor) else x)
                for n, x in opts.items()}
    want = stack_attention_naive(qd, kd, vd, torch.cat([sk, kd]), torch.cat([sv, vd]), layout, scale, **ref_opts)
    ref_leaves = [qd, kd, vd] + ([ref_opts["sinks"]] if "sinks" in ref_opts else []) + [sk, sv]
    wants = torch.autograd.grad(want, ref_leaves, go.double())

    if tol is None:
        tol = {"atol": 1e-10, "rtol": 1e-9} if dtype == torch.float64 else {"atol": 2e-5, "rtol": 1e-4}
    names = ["out", "dq", "dk", "dv"] + (["dsinks"] if "sinks" in opts else [])
    for name, g, w in zip(names, (out, *got), (want, *wants)):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, name=name: f"{name}: {m}")
    for name, g, init, w in [
        ("stack grad_k", stack.grad_k[0, :used], init_k[:used], wants[-2]),
        ("stack grad_v", stack.grad_v[0, :used], init_v[:used], wants[-1]),
    ]:
        torch.testing.assert_close(g.double(), init.double() + w, **tol, msg=lambda m, name=name: f"{name}: {m}")
    if layout.call_slots is None:  # nothing written past the prefix slots
        assert torch.equal(stack.grad_k[0, used:], init_k[used:]) and torch.equal(stack.grad_v[0, used:], init_v[used:])
    return out


def backend(name):
    return functools.partial(stack_attention, backend=name)


def with_flags(attn, deterministic: bool | None = None, **tuning):
    """A backend (``(q, k, v, slots, options)``) with ``options.deterministic`` and the
    Triton kernel's tuning knobs (``stack_attention_triton_tuned``) fixed."""

    def call(q, k, v, slots, options):
        return attn(q, k, v, slots, dataclasses.replace(options, deterministic=deterministic), **tuning)

    return call


@pytest.mark.parametrize("name", ["reference", "sdpa"])
@pytest.mark.parametrize("seed", range(6))
def test_random_layouts(name, seed):
    rng = np.random.default_rng(seed)
    hq, hkv, d = [(4, 4, 16), (6, 2, 12), (3, 1, 20)][seed % 3]
    used = int(rng.integers(5, 40))
    layout, t = random_layout(rng, int(rng.integers(1, 5)), 9, used)
    check_against_naive(backend(name), layout, t, used, hq, hkv, d, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("name", ["reference", "sdpa"])
def test_options(name, option, dtype):
    """Odd sizes (T=63, D=60 style), GQA 3, every option; random multi-range layouts."""
    rng = np.random.default_rng(7)
    layout, t = random_layout(rng, 4, 23, 31)
    opts = OPTIONS[option](torch.Generator().manual_seed(1), 6)
    check_against_naive(backend(name), layout, t, 31, 6, 2, 60, options=opts, dtype=dtype, seed=3)


@pytest.mark.parametrize("option", ["plain", "all"])
@pytest.mark.parametrize("name", ["reference", "sdpa"])
def test_value_heads_narrower_than_keys(name, option):
    """MLA shapes: q, k 24 wide, v 16 (a tiny DeepSeek-V3), output 16 wide."""
    rng = np.random.default_rng(2)
    layout, t = random_layout(rng, 3, 17, 20)
    opts = OPTIONS[option](torch.Generator().manual_seed(2), 4)
    check_against_naive(backend(name), layout, t, 20, 4, 2, 24, 16, options=opts, grad_init=True)


@pytest.mark.parametrize("option", ["plain", "window", "all"])
@pytest.mark.parametrize("name", ["reference", "sdpa"])
def test_in_call_ancestors(name, option):
    """Nested segments of one call read each other through the stack; their gradients
    come back into the call's own dk/dv through ``seed_from_stack``."""
    layout, t = nested_layout(19)
    opts = OPTIONS[option](torch.Generator().manual_seed(4), 6)
    check_against_naive(backend(name), layout, t, 19, 6, 3, 20, options=opts, seed=5)


@pytest.mark.parametrize("name", ["reference", "sdpa"])
def test_alibi_matches_transformers_bloom(name):
    """Our ALiBi term against Bloom's own bias (transformers' build_alibi_tensor:
    slope_h * key position, added to the scaled scores), on a segment under a prefix."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    hq, p, t, d = 8, 7, 13, 16
    gen = torch.Generator().manual_seed(0)
    alibi = build_alibi_tensor(torch.ones(1, p + t), hq, torch.float64)  # [Hq, 1, P + T]
    slopes = alibi[:, 0, 1].clone()
    q, k, v = (torch.randn(n, hq, d, generator=gen, dtype=torch.float64) for n in (t, p + t, p + t))
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5 + alibi
    causal = torch.arange(p + t)[None, :] > (p + torch.arange(t))[:, None]
    want = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(causal, -torch.inf), -1), v)

    stack = KVStack(1, p + t, hq, d, dtype=torch.float64, device="cpu", grad_dtype=torch.float64)
    stack.push(0, 0, k, v)
    layout = SegmentLayout(np.array([0, t]), np.array([p]), [((0, p),)])
    got = stack_attention(q, k[p:], v[p:], StackSlots(stack, 0, layout), AttentionOptions(scale=d**-0.5, alibi_slopes=slopes), name)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    plain = stack_attention(q, k[p:], v[p:], StackSlots(stack, 0, layout), AttentionOptions(scale=d**-0.5), name)
    assert (plain - want).abs().max() > 1e-2  # the bias matters here


def test_window_reads_only_the_window_of_the_stack():
    """With a window, the reference backend gathers only the last window - 1 prefix
    slots of a segment: slots below hold NaN here and must not reach anything."""
    layout = SegmentLayout(np.array([0, 9]), np.array([40]), [((0, 40),)])
    stack = KVStack(1, 49, 1, 8, dtype=torch.float32, device="cpu")
    stack.k.fill_(float("nan"))
    stack.v.fill_(float("nan"))
    stack.k[0, 36:40] = torch.randn(4, 1, 8)
    stack.v[0, 36:40] = torch.randn(4, 1, 8)
    stack.grad_k.zero_()
    stack.grad_v.zero_()
    q, k, v = (torch.randn(9, 2, 8, requires_grad=True) for _ in range(3))
    k, v = k[:, :1], v[:, :1]
    for name in ("reference", "sdpa"):
        out = stack_attention(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=0.3, window=5), name)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all(), name
    assert torch.all(stack.grad_k[0, :36] == 0) and torch.any(stack.grad_k[0, 36:40] != 0)


def _bad_inputs():
    layout = SegmentLayout(np.array([0, 3]), np.array([4]), [((0, 4),)])
    stack = KVStack(1, 8, 1, 16, dtype=torch.float32, device="cpu")
    stack.zero_grad(0, 8)
    q, k, v = torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    return q, k, v, stack, layout


BAD = [
    ("softcap", {"softcap": 0.0}, "softcap must be a finite number > 0"),
    ("softcap_nan", {"softcap": float("nan")}, "softcap must be a finite number > 0"),
    ("sinks_shape", {"sinks": torch.zeros(3)}, r"sinks must have shape \[2\]"),
    ("sinks_int", {"sinks": torch.zeros(2, dtype=torch.long)}, "sinks must be a floating-point tensor"),
    ("sinks_list", {"sinks": [0.0, 1.0]}, "sinks must be a tensor"),
    ("slopes_shape", {"alibi_slopes": torch.zeros(2, 1)}, r"alibi_slopes must have shape \[2\]"),
    ("slopes_grad", {"alibi_slopes": torch.zeros(2, requires_grad=True)}, "must not require grad"),
    ("window_zero", {"window": 0}, "window must be an int >= 1"),
    ("window_float", {"window": 4.0}, "window must be an int >= 1"),
    ("window_bool", {"window": True}, "window must be an int >= 1"),
]


@pytest.mark.parametrize("name", ["reference", "sdpa"])
@pytest.mark.parametrize("case,options,message", BAD, ids=[b[0] for b in BAD])
def test_bad_options_raise_clear_errors(name, case, options, message):
    q, k, v, stack, layout = _bad_inputs()
    before = stack.grad_k.clone()
    with pytest.raises(ValueError, match=message):
        stack_attention(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=0.25, **options), name)
    assert torch.equal(stack.grad_k, before)


def test_bad_shapes_raise_clear_errors():
    q, k, v, stack, layout = _bad_inputs()
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        stack_attention(q[:, :1].expand(3, 3, 16).contiguous(), k.expand(3, 2, 16), v.expand(3, 2, 16), StackSlots(stack, 0, layout), AttentionOptions(scale=1.0))
    with pytest.raises(ValueError, match="the stack holds 1 kv heads with key dim 16 and value dim 16"):
        stack_attention(q, k, v[..., :8], StackSlots(stack, 0, layout), AttentionOptions(scale=1.0))
    with pytest.raises(ValueError, match="q_offsets must run from 0 to T=2"):
        stack_attention(q[:2], k[:2], v[:2], StackSlots(stack, 0, layout), AttentionOptions(scale=1.0))
    with pytest.raises(ValueError, match="unknown attention backend"):
        stack_attention(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=1.0), "flash9")


def test_seed_from_stack_adds_the_slots_once():
    """The identity's backward adds the stack's float32 slots [lo, hi) of its layer to
    the incoming dk/dv (one rounding to the K/V dtype), after every consumer; nothing
    without grad."""
    stack = KVStack(2, 12, 2, 4, dtype=torch.bfloat16, device="cpu")
    stack.grad_k.normal_()
    stack.grad_v.normal_()
    k = torch.randn(5, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(5, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    ks, vs = seed_from_stack(k, v, stack, 1, 3, 8)
    assert torch.equal(ks, k) and torch.equal(vs, v)
    gk = torch.randn(5, 2, 4, dtype=torch.bfloat16)
    ((ks * gk).sum() + (ks * 2).sum() + vs.sum()).backward()  # two consumers of ks
    incoming = gk + 2  # autograd sums the consumers' gradients first, in bf16
    want_k = (stack.grad_k[1, 3:8] + incoming.float()).to(torch.bfloat16)
    assert torch.equal(k.grad, want_k)
    assert torch.equal(v.grad, (stack.grad_v[1, 3:8] + 1).to(torch.bfloat16))
    with torch.no_grad():
        assert seed_from_stack(k, v, stack, 1, 3, 8)[0] is k
    frozen = k.detach()
    assert seed_from_stack(frozen, v.detach(), stack, 1, 3, 8)[0] is frozen
    with pytest.raises(ValueError, match="rows for the 4 slots"):
        seed_from_stack(k, v, stack, 1, 3, 7)
