"""The compiled KV-stack ops (csrc/) against their pure-torch references
(dtree/kv_stack_ext.py); the fallback path; the fake kernels under torch.compile.

The extension is built once per session (and cached across sessions in the build
directory); without a C++ compiler or ninja the compiled-op tests skip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from dtree import kv_stack_ext as ext
from dtree.kv_stack import KVStack

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (layers, capacity, kv_heads, head_dim): odd sizes take the element-wise CUDA
# paths, multiples of 8 the 16-byte vector paths
SHAPES = [(2, 37, 3, 60), (3, 50, 2, 64), (1, 9, 1, 7), (2, 70, 4, 128)]
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
LAYOUTS = ["contiguous", "transposed", "strided", "misaligned"]


@pytest.fixture(scope="module")
def compiled():
    """Loads (building if needed) the extension; skips when the toolchain is missing."""
    if not ext.load():
        reason = ext.status()["reason"]
        if "DTREE_NO_EXT" in reason or "C++ compiler" in reason or "ninja" in reason:
            pytest.skip(f"KV-stack extension not built: {reason}")
        pytest.fail(f"KV-stack extension failed to build: {ext._state.log or reason}")


@pytest.fixture
def on(request, compiled):
    """The device of a test parametrized over DEVICES, with its kernels loaded."""
    device = request.node.callspec.params["device"]
    if device == "cuda" and not ext.status()["cuda"]:
        pytest.skip(f"extension built without CUDA kernels: {ext.status()['reason']}")
    return device


@pytest.fixture
def fresh(monkeypatch):
    """A process state in which the extension has not been tried yet."""
    monkeypatch.setattr(ext, "_state", ext._State())
    monkeypatch.delenv("DTREE_EXT", raising=False)
    monkeypatch.delenv("DTREE_NO_EXT", raising=False)


def _rows(gen, n, heads, dim, dtype, device, layout):
    """[n, heads, dim] random rows laid out as named: ``transposed`` is the
    ``[B, H, T, D] -> [T, H, D]`` view the HF adapter passes, ``strided`` has stride
    2 on head_dim, ``misaligned`` starts one element into its storage (no 16-byte
    vector access on CUDA)."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if layout == "contiguous":
        return rand(n, heads, dim)
    if layout == "transposed":
        return rand(heads, n, dim).transpose(0, 1)
    if layout == "strided":
        return rand(n, heads, 2 * dim)[..., ::2]
    return rand(n * heads * dim + 1)[1:].view(n, heads, dim)


def _buffers(gen, shape, dtype, device):
    """A random K/V buffer pair (random, so untouched slots are checked too)."""
    return tuple(torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(2))


def _slots(gen, kind, n, capacity, start, device):
    """None (contiguous from start), or int32/int64 slots relative to start:
    distinct (``perm``) or with repeats (``repeat``)."""
    if kind is None:
        return None
    dtype = torch.int32 if kind.endswith("32") else torch.int64
    if kind.startswith("perm"):
        s = torch.randperm(capacity - start, generator=gen)[:n]
    else:
        s = torch.randint(0, min(3, capacity - start), (n,), generator=gen)
    return s.to(device=device, dtype=dtype)


def _assert_same(out: tuple, ref: tuple, exact: bool) -> None:
    for a, b in zip(out, ref):
        if exact:
            assert torch.equal(a, b)
        else:  # float atomics add in no fixed order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- ops vs references


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_push_matches_reference(on, device, shape, dtype):
    gen = torch.Generator().manual_seed(10 * SHAPES.index(shape) + FLOATS.index(dtype))
    layers, capacity, heads, dim = shape
    for layout in LAYOUTS:
        for kind in (None, "perm32", "perm64"):
            n, start = min(capacity - 4, 11), 3
            stack = _buffers(gen, shape, dtype, device)
            ref = tuple(b.clone() for b in stack)
            k = _rows(gen, n, heads, dim, dtype, device, layout)
            v = _rows(gen, n, heads, dim, dtype, device, layout)
            slots = _slots(gen, kind, n, capacity, start, device)
            torch.ops.dtree.kv_push.default(*stack, layers - 1, k, v, start, slots)
            ext.push_reference(*ref, layers - 1, k, v, start, slots)
            _assert_same(stack, ref, exact=True)


@pytest.mark.parametrize("device", DEVICES)
def test_push_converts_dtype(on, device):
    gen = torch.Generator().manual_seed(0)
    stack = _buffers(gen, (2, 20, 2, 16), torch.bfloat16, device)
    ref = tuple(b.clone() for b in stack)
    k, v = (torch.randn(5, 2, 16, generator=gen).to(device) for _ in range(2))  # float32 rows
    torch.ops.dtree.kv_push.default(*stack, 0, k, v, 4, None)
    ext.push_reference(*ref, 0, k, v, 4, None)
    _assert_same(stack, ref, exact=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_accumulate_matches_reference(on, device, shape, dtype):
    gen = torch.Generator().manual_seed(100 + 10 * SHAPES.index(shape) + FLOATS.index(dtype))
    layers, capacity, heads, dim = shape
    for layout in LAYOUTS:
        for kind in (None, "repeat32", "repeat64", "perm64"):
            start = 2
            n = 29 if kind and kind.startswith("repeat") else min(capacity - start, 13)
            grads = _buffers(gen, shape, torch.float32, device)
            ref = tuple(b.clone() for b in grads)
            dk = _rows(gen, n, heads, dim, dtype, device, layout)
            dv = _rows(gen, n, heads, dim, dtype, device, layout)
            index = _slots(gen, kind, n, capacity, start, device)
            torch.ops.dtree.kv_accumulate.default(*grads, layers - 1, dk, dv, start, index)
            ext.accumulate_reference(*ref, layers - 1, dk, dv, start, index)
            # CPU adds rows in order, as index_add_ does; CUDA atomics do not
            _assert_same(grads, ref, exact=device == "cpu" or kind in (None, "perm64"))


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_many_repeats(on, device):
    """Thousands of rows into three slots: every contribution is summed."""
    gen = torch.Generator().manual_seed(1)
    grads = tuple(torch.zeros(2, 8, 2, 64, device=device) for _ in range(2))
    dk, dv = (torch.randn(4096, 2, 64, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(2))
    index = torch.randint(5, 8, (4096,), generator=gen).to(device)
    torch.ops.dtree.kv_accumulate.default(*grads, 1, dk, dv, 0, index)
    for g, d in zip(grads, (dk, dv)):
        want = torch.zeros(8, 2, 64, dtype=torch.float64, device=device).index_add_(0, index, d.double())
        torch.testing.assert_close(g[1], want.float(), rtol=1e-5, atol=1e-4)
        assert not g[0].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_zero_grad_matches_reference(on, device, shape, dtype):
    gen = torch.Generator().manual_seed(2)
    capacity = shape[1]
    for lo, hi in ((0, capacity), (1, capacity - 2), (5, 5), (3, 4)):
        grads = _buffers(gen, shape, dtype, device)
        ref = tuple(b.clone() for b in grads)
        torch.ops.dtree.kv_zero_grad.default(*grads, lo, hi)
        ext.zero_grad_reference(*ref, lo, hi)
        _assert_same(grads, ref, exact=True)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_calls_are_no_ops(on, device):
    grads = tuple(torch.ones(2, 4, 1, 8, device=device) for _ in range(2))
    empty = torch.empty(0, 1, 8, device=device)
    torch.ops.dtree.kv_push.default(*grads, 0, empty, empty, 4, None)
    torch.ops.dtree.kv_accumulate.default(*grads, 0, empty, empty, 0, torch.empty(0, dtype=torch.long, device=device))
    torch.ops.dtree.kv_zero_grad.default(*grads, 2, 2)
    assert all(bool((g == 1).all()) for g in grads)


# (call, expected message); each must raise in the compiled op and in its reference alike
BAD_CALLS = [
    ("push", lambda b, r: (*b, 0, r, r, 8, None), r"kv_push: slots \[8, 11\) out of range for capacity 10"),
    ("push", lambda b, r: (*b, 2, r, r, 0, None), r"kv_push: layer 2 out of range \[0, 2\)"),
    ("push", lambda b, r: (*b, 0, r[:, :1], r[:, :1], 0, None), r"kv_push: expected rows of shape \[n, 2, 4\]"),
    ("push", lambda b, r: (*b, 0, r, r[:2], 0, None), r"kv_push: K rows .* and V rows .* differ"),
    ("push", lambda b, r: (b[0], b[1][:, :5].contiguous(), 0, r, r, 0, None), r"kv_push: K and V buffers differ"),
    (
        "accumulate",
        lambda b, r: (*b, 0, r, r, 0, torch.zeros(2, dtype=torch.long)),
        r"kv_accumulate: index must be \[3\]",
    ),
    ("accumulate", lambda b, r: (*b, 0, r, r, 0, torch.zeros(3, dtype=torch.int16)), r"index must be int32 or int64"),
    ("zero_grad", lambda b, r: (*b, 4, 11), r"kv_zero_grad: slots \[4, 11\) out of range for capacity 10"),
    ("zero_grad", lambda b, r: (*b, 5, 4), r"kv_zero_grad: slots \[5, 4\) out of range"),
]


@pytest.mark.parametrize("name,make,message", BAD_CALLS)
def test_bad_arguments_raise_clear_errors(compiled, name, make, message):
    args = make(tuple(torch.zeros(2, 10, 2, 4) for _ in range(2)), torch.zeros(3, 2, 4))
    op = getattr(torch.ops.dtree, f"kv_{name}").default
    for fn in (op, getattr(ext, f"{name}_reference")):
        with pytest.raises(RuntimeError, match=message):
            fn(*args)


def test_compiled_ops_check_slot_values_and_grad_dtype(compiled):
    bufs = tuple(torch.zeros(2, 10, 2, 4) for _ in range(2))
    rows = torch.zeros(3, 2, 4)
    with pytest.raises(RuntimeError, match=r"kv_push: slot 10 \(row 1\) out of range for capacity 10"):
        torch.ops.dtree.kv_push.default(*bufs, 0, rows, rows, 2, torch.tensor([0, 8, 1]))
    with pytest.raises(RuntimeError, match=r"kv_accumulate: slot -1 \(row 2\) out of range"):
        torch.ops.dtree.kv_accumulate.default(*bufs, 0, rows, rows, 0, torch.tensor([0, 8, -1]))
    half = tuple(b.half() for b in bufs)
    with pytest.raises(RuntimeError, match="gradient buffers must be float32"):
        torch.ops.dtree.kv_accumulate.default(*half, 0, rows, rows, 0, None)


# ----------------------------------------------------------------------------- KVStack through the ops


def _stack_session(stack: KVStack, gen) -> None:
    """The runtime's use of a stack: zero, push, accumulate (slice, slots with
    repeats, strided slice), read back."""
    heads, dim = stack.num_kv_heads, stack.head_dim
    stack.zero_grad(0, stack.capacity)
    for layer in range(stack.num_layers):
        k = torch.randn(heads, 12, dim, generator=gen).transpose(0, 1)
        stack.write(layer, 3, k, torch.randn(12, heads, dim, generator=gen))
        stack.accumulate(layer, slice(3, 9), *(torch.randn(6, heads, dim, generator=gen) for _ in range(2)))
        idx = torch.tensor([0, 4, 4, 13, 0])
        stack.accumulate(layer, idx, *(torch.randn(5, heads, dim, generator=gen).bfloat16() for _ in range(2)))
        stack.accumulate(layer, slice(1, 9, 3), *(torch.randn(3, heads, dim, generator=gen) for _ in range(2)))
    stack.zero_grad(10, 12)


def _run_session():
    stack = KVStack(3, 16, 2, 8, dtype=torch.bfloat16, device="cpu")
    stack.k.zero_(), stack.v.zero_()  # allocated uninitialized
    _stack_session(stack, torch.Generator().manual_seed(3))
    return stack


def test_kv_stack_fallback_matches_extension(compiled, fresh, monkeypatch):
    fast = _run_session()
    monkeypatch.setattr(ext, "_state", ext._State())
    monkeypatch.setenv("DTREE_NO_EXT", "1")
    with pytest.warns(ext.FallbackWarning):
        slow = _run_session()
    for name in ("k", "v", "grad_k", "grad_v"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name


# ----------------------------------------------------------------------------- fallback and loading


def _calls(device="cpu"):
    gen = torch.Generator().manual_seed(4)
    bufs = _buffers(gen, (2, 12, 2, 8), torch.float32, device)
    rows = _rows(gen, 5, 2, 8, torch.float32, device, "transposed")
    idx = torch.tensor([1, 1, 7, 2, 1], device=device)
    return bufs, rows, idx


def _exercise(bufs, rows, idx):
    ext.push(*bufs, 1, rows, rows, 3)
    ext.push(*bufs, 0, rows, rows, 0, torch.arange(5, device=idx.device))
    ext.accumulate(*bufs, 1, rows, rows, 0, idx)
    ext.accumulate(*bufs, 0, rows, rows, 2)
    ext.zero_grad(*bufs, 4, 6)


def test_fallback_warns_once_and_matches(fresh, monkeypatch):
    monkeypatch.setenv("DTREE_NO_EXT", "1")
    bufs, rows, idx = _calls()
    ref = tuple(b.clone() for b in bufs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _exercise(bufs, rows, idx)
        _exercise(bufs, rows, idx)
    fallback = [w for w in caught if issubclass(w.category, ext.FallbackWarning)]
    assert len(fallback) == 1
    message = str(fallback[0].message)
    assert "DTREE_NO_EXT" in message and "pure-torch fallback" in message and "\n" not in message
    for _ in range(2):
        ext.push_reference(*ref, 1, rows, rows, 3)
        ext.push_reference(*ref, 0, rows, rows, 0, torch.arange(5))
        ext.accumulate_reference(*ref, 1, rows, rows, 0, idx)
        ext.accumulate_reference(*ref, 0, rows, rows, 2)
        ext.zero_grad_reference(*ref, 4, 6)
    _assert_same(bufs, ref, exact=True)
    assert not ext.status()["loaded"]


def test_failed_build_falls_back_with_its_reason(fresh, monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def broken_build(**kwargs):
        raise RuntimeError("Error building extension 'dtree_kv_stack_cpu': kv_stack.cpp:1: error: boom\nmore log")

    monkeypatch.setenv("DTREE_EXT_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken_build)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    bufs, rows, idx = _calls()
    with pytest.warns(ext.FallbackWarning, match=r"build failed in .*Error building extension") as caught:
        _exercise(bufs, rows, idx)
    assert len([w for w in caught if issubclass(w.category, ext.FallbackWarning)]) == 1
    with pytest.raises(RuntimeError, match=r"(?s)pip install ninja.*error: boom\nmore log"):
        ext.load(require=True)


def test_missing_sources_fall_back(fresh, monkeypatch):
    monkeypatch.setattr(ext, "_source_dir", lambda: None)
    with pytest.warns(ext.FallbackWarning, match="sources .* not found"):
        _exercise(*_calls())


def test_require_raises_with_the_fix(fresh, monkeypatch):
    monkeypatch.setenv("DTREE_NO_EXT", "1")
    monkeypatch.setenv("DTREE_EXT", "require")
    with pytest.raises(RuntimeError, match=r"required \(DTREE_EXT=require.*DTREE_NO_EXT is set.*pip install ninja"):
        _exercise(*_calls())
    with pytest.raises(RuntimeError, match="unset DTREE_EXT"):
        ext.load(require=True)
    monkeypatch.setenv("DTREE_EXT", "always")
    with pytest.raises(ValueError, match="DTREE_EXT must be 'auto' or 'require'"):
        ext.load()


def test_import_does_not_build():
    """``import dtree`` leaves the build to the first op (checked in a fresh interpreter)."""
    code = "import sys, dtree; assert not dtree.kv_stack_ext._state.tried; assert 'torch.utils.cpp_extension' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- torch.compile / fake kernels


OPCHECK_CASES = [
    ("kv_push", lambda b, r, i: (*b, 1, r, r, 2, None)),
    ("kv_push", lambda b, r, i: (*b, 0, r, r, 0, torch.tensor([9, 0, 4, 2, 5]))),
    ("kv_accumulate", lambda b, r, i: (*b, 1, r.bfloat16(), r.bfloat16(), 1, None)),
    ("kv_accumulate", lambda b, r, i: (*b, 0, r, r, 0, i.int())),
    ("kv_zero_grad", lambda b, r, i: (*b, 3, 9)),
]


@pytest.mark.parametrize("name,make", OPCHECK_CASES)
def test_opcheck(compiled, name, make):
    """Schema (declared mutations), fake kernel, and AOT dispatch with dynamic shapes."""
    bufs, rows, idx = _calls()
    torch.library.opcheck(getattr(torch.ops.dtree, name).default, make(bufs, rows, idx))


def test_fake_tensor_mode_checks_shapes(compiled):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        bufs = (torch.empty(2, 8, 3, 4), torch.empty(2, 8, 3, 4))
        rows = torch.empty(3, 3, 4)
        ext.push(*bufs, 0, rows, rows, 1)
        ext.accumulate(*bufs, 1, rows, rows, 0, torch.tensor([1, 1, 2]))
        ext.zero_grad(*bufs, 0, 8)
        with pytest.raises(RuntimeError, match=r"kv_push: slots \[6, 9\) out of range for capacity 8"):
            ext.push(*bufs, 0, rows, rows, 6)
    meta = torch.empty(2, 8, 3, 4, device="meta")
    rows = torch.empty(3, 3, 4, device="meta")
    ext.push(meta, meta.clone(), 0, rows, rows, 1)


def _compiled_session(stack: KVStack, k, v, lo: int):
    stack.zero_grad(lo, lo + k.shape[0])
    stack.write(0, lo, k, v)
    stack.accumulate(1, slice(lo, lo + k.shape[0]), k, v)
    stack.accumulate(1, torch.tensor([0, 0, 1], device=k.device), k[:3], v[:3])
    return stack.grad_k.sum() + stack.k.float().sum()


@pytest.mark.parametrize("use_ext", [True, False], ids=["extension", "fallback"])
def test_torch_compile_matches_eager(compiled, fresh, monkeypatch, use_ext):
    if not use_ext:
        monkeypatch.setenv("DTREE_NO_EXT", "1")
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(4, 2, 8, generator=gen) for _ in range(2))
    stacks = [KVStack(2, 16, 2, 8, dtype=torch.float32, device="cpu") for _ in range(2)]
    for s in stacks:
        s.grad_k.zero_(), s.grad_v.zero_(), s.k.zero_(), s.v.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ext.FallbackWarning)
        ext.zero_grad(stacks[0].grad_k, stacks[0].grad_v, 0, 0)  # decide the route before tracing
    fn = torch.compile(_compiled_session, backend="aot_eager", fullgraph=True, dynamic=True)
    for lo in (2, 9):  # two slot offsets through one (dynamic) graph
        got = fn(stacks[0], k, v, lo)
        want = _compiled_session(stacks[1], k, v, lo)
        torch.testing.assert_close(got, want)
    for name in ("k", "v", "grad_k", "grad_v"):
        assert torch.equal(getattr(stacks[0], name), getattr(stacks[1], name)), name
