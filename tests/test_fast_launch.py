"""``dtree.ops.fast_launch``: a launch reuses a compiled kernel only where Triton would.

The soundness test needs no GPU: it records the launches of dtree's Triton kernels on
CPU tensors (nothing runs), varies every non-constexpr argument over the values Triton
specializes on (pointer offsets, integers equal to 1, multiples of 16, 32- and 64-bit
widths), and checks with Triton's own binder for an sm_90 target that two launches of
one argument class always get one specialization. The GPU tests compare the fast
launches with ``kernel[grid]`` bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from dtree.ops import fast_launch as fl  # noqa: E402
from dtree.ops.stack_attention import triton_autograd as sat  # noqa: E402

from test_kernel_specialization import (  # noqa: E402
    _agentic,
    _binder,
    _grpo,
    _Recorder,
    _stack_attention_calls,
)

_INTERPRET = sat._INTERPRET
_INTS = [0, 1, 2, 15, 16, 17, 48, 4096, 12_345, 2**31 - 16, 2**31 - 1, 2**31, 2**32 + 16, 2**40 + 3, -1, -16]


def _vary(kernel, args: tuple, kwargs: dict, rng: np.random.Generator) -> tuple[tuple, dict]:
    """The launch with each non-constexpr tensor moved to a random element offset of a
    larger buffer and each non-constexpr int replaced by one of ``_INTS``."""
    constexpr = {kernel.arg_names[i] for i in kernel.constexprs}

    def vary(name, value):
        if name in constexpr:
            return value
        if isinstance(value, torch.Tensor):
            flat = torch.zeros(value.numel() + 16, dtype=value.dtype)
            return flat[int(rng.integers(0, 9)) :][: value.numel()].view(value.shape)
        if type(value) is int:
            return int(rng.choice(_INTS))
        return value

    names = kernel.arg_names
    new_args = tuple(vary(names[i], a) for i, a in enumerate(args))
    new_kwargs = {k: vary(k, v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _classes_are_sound(calls, variants: int = 40) -> int:
    """For every recorded launch and ``variants`` variations of it: launches of one fast
    class have one Triton specialization, and the table's generated reader gives the
    reference binding and key (:meth:`_KernelTable.bind`, :meth:`_KernelTable.key`).
    Returns the number of classes seen."""
    rng = np.random.default_rng(0)
    seen: dict[tuple, str] = {}
    for kernel, args, kwargs in calls:
        table = fl._KernelTable(kernel)
        for i in range(variants + 1):
            a, kw = (args, kwargs) if i == 0 else _vary(kernel, args, kwargs, rng)
            values, options = table.bind(a, kw)
            assert table.read(a, kw, 0) == (values, table.key(values, options, 0)), kernel.fn.__name__
            fast = (kernel.fn.__name__, options, tuple(map(fl.argument_class, values, table.constexpr)))
            _, spec, _ = _binder(kernel)(*a, **kw)
            triton_key = repr(spec)
            assert seen.setdefault(fast, triton_key) == triton_key, (
                f"{kernel.fn.__name__}: one fast-launch class, two Triton specializations:\n"
                f"{seen[fast]}\n{triton_key}"
            )
    return len(seen)


@pytest.mark.skipif(_INTERPRET, reason="the session runs the Triton interpreter")
@pytest.mark.parametrize("backward", ["fused", "split"])
def test_stack_attention_classes_match_triton_specialization(monkeypatch, backward):
    calls = []
    for layout, used in [_grpo(2048, [512] * 8), _agentic(0)]:
        calls += _stack_attention_calls(monkeypatch, layout, used, sat.PLAIN, False, backward)
    assert {k.fn.__name__ for k, _, _ in calls} >= {"_fwd_kernel", "_dkdv_kernel"}
    assert _classes_are_sound(calls) > len({k.fn.__name__ for k, _, _ in calls})


@pytest.mark.skipif(_INTERPRET, reason="the session runs the Triton interpreter")
def test_layer_kernel_classes_match_triton_specialization(monkeypatch):
    """The norms, SwiGLU, the stack glue, the log-prob head and the bias sums, as a training step calls them."""
    from dtree.ops.logprobs import fused_head as fh
    from dtree.ops.logprobs import triton_kernels as lt
    from dtree.ops.rms_norm import triton_kernels as rt
    from dtree.ops.shared_input_linear import triton_kernels as bt
    from dtree.ops.stack_ops import triton_kernels as st
    from dtree.ops.swiglu import triton_kernels as wt

    calls: list = []
    for module, names in [
        (rt, ["_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_dweight_sum_kernel"]),
        (wt, ["_silu_mul_fwd_kernel", "_silu_mul_bwd_kernel"]),
        (st, ["_push_kernel", "_fold_kernel"]),
        (lt, ["_row_stats_kernel", "_dlogits_kernel"]),
        (bt, ["_column_sums_kernel", "_column_sums_finish_kernel"]),
    ]:
        for name in names:
            monkeypatch.setattr(module, name, _Recorder(getattr(module, name), calls))
    x = torch.zeros(37, 1536, dtype=torch.bfloat16)
    w = torch.ones(1536, dtype=torch.bfloat16)
    y, r = rt.rms_norm_forward(x, w, 1e-6)
    rt.rms_norm_backward(x, x, w, r, True)
    gate = torch.zeros(37, 8960, dtype=torch.bfloat16)
    wt.silu_mul_forward(gate, gate)
    wt.silu_mul_backward(gate, gate, gate)
    k = torch.zeros(37, 2, 128, dtype=torch.bfloat16)
    slots = torch.zeros(37, 2 * 128, dtype=torch.bfloat16)
    st.push_kv(slots, slots, k, k)
    st.fold_seed(slots.float(), slots.float(), slots, slots, (torch.bfloat16, torch.bfloat16))
    weight = torch.zeros(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.zeros(37, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.zeros(37, dtype=torch.int64)
    logp, ent = fh._FusedLogprobs.apply(hidden, weight, None, labels, lt.LogitTransform(), True, 32, True, False)
    torch.autograd.backward([logp, ent], [torch.zeros_like(logp), torch.zeros_like(ent)])
    dq, dkv = torch.zeros(37, 1536, dtype=torch.bfloat16), torch.zeros(37, 256, dtype=torch.bfloat16)
    bt.column_sums([dq, dkv, dkv], [torch.bfloat16] * 3)  # one row split: the sums in one launch
    long_dq, long_dkv = torch.zeros(1100, 1536, dtype=torch.bfloat16), torch.zeros(1100, 256, dtype=torch.bfloat16)
    bt.column_sums([long_dq, long_dkv, long_dkv], [torch.bfloat16] * 3)  # three splits, then their sum
    assert len({k.fn.__name__ for k, _, _ in calls}) == 11
    _classes_are_sound(calls)


def test_argument_class():
    assert fl.argument_class(1) != fl.argument_class(2) != fl.argument_class(16)
    assert fl.argument_class(32) == fl.argument_class(48) != fl.argument_class(2**31)
    assert fl.argument_class(2**31) != fl.argument_class(2**63)
    assert fl.argument_class(3) == fl.argument_class(5)
    assert fl.argument_class(True) != fl.argument_class(False) != fl.argument_class(0)
    assert fl.argument_class(0.5) == fl.argument_class(2.0)
    assert fl.argument_class(64, constexpr=True) != fl.argument_class(128, constexpr=True)
    assert fl.argument_class(1, constexpr=True) != fl.argument_class(True, constexpr=True)
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert fl.argument_class(x[8:]) == fl.argument_class(x) != fl.argument_class(x[1:])
    assert fl.argument_class(x) != fl.argument_class(x.float())
    assert fl.argument_class(None) == fl.argument_class(None)


@pytest.mark.skipif(_INTERPRET, reason="the session runs the Triton interpreter")
def test_bind_orders_parameters_and_separates_options():
    from dtree.ops.rms_norm import triton_kernels as rt

    table = fl._KernelTable(rt._rms_norm_bwd_kernel)
    args = tuple(range(11))
    values, options = table.bind(args, {"rows_per_program": 11, "NEED_DW": True, "BLOCK_N": 8, "num_warps": 4})
    assert values == [*range(11), 11, 8, True]  # BLOCK_N before NEED_DW, as declared
    assert options == (("num_warps", 4),)
    assert table.bind(args, {"BLOCK_N": 8}) is None  # a missing parameter goes to Triton, which raises


class _Signature:
    """What :class:`fl._KernelTable` reads of a jitted function: parameters a..e (``e``
    constexpr, ``d`` and ``e`` with defaults)."""

    def __init__(self):
        import inspect

        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter(n, kind) for n in "abc"]
        params += [inspect.Parameter("d", kind, default=7), inspect.Parameter("e", kind, default=64)]
        self.signature = inspect.Signature(params)
        self.constexprs = [4]
        self.fn = _Signature


_VALUES = [1, 2, 16, 48, -16, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 + 16, True, False, 0.5, None, "x"]


def test_a_reader_gives_the_reference_binding_and_key_for_every_value():
    """Every way of passing the arguments (positional, keywords in either order, defaults, launch
    options), every kind of value (tensors aligned or not, of two dtypes and a subclass, ints across
    Triton's classes, bools, floats, None), and values of another type than the reader's first
    launch (the reference answers): always the reference's values and key."""
    table = fl._KernelTable(_Signature())
    buf = torch.zeros(64, dtype=torch.bfloat16)
    tensors = [buf, buf[1:], buf[8:], buf.float(), torch.nn.Parameter(buf.clone())]
    rng = np.random.default_rng(0)
    pool = tensors + _VALUES
    for _ in range(600):
        a, b, c = (pool[int(i)] for i in rng.integers(0, len(pool), 3))
        extra = {"num_warps": 4} if rng.integers(0, 2) else {}
        for args, kwargs in [((a, b, c), extra), ((a,), {"c": c, "b": b, **extra}), ((a, b), {"c": c, "d": b}),
                             ((a, b, c, a), {"e": int(rng.integers(0, 3)), **extra})]:
            values, options = table.bind(args, kwargs)
            assert table.read(args, kwargs, 1) == (values, table.key(values, options, 1)), (args, kwargs)
    assert 1 <= len(table.readers) <= 8  # one per way of passing, whatever the values' types
    anonymous = _Signature()
    anonymous.fn = type("F", (), {"__name__": "<lambda>"})  # not an identifier: the reader gets another name
    assert fl._KernelTable(anonymous).read((buf, 1, 2.0), {}, 0)[0] == [buf, 1, 2.0, 7, 64]
    assert table.read((buf,), {}, 0) is None and table.bind((buf,), {}) is None  # b and c missing: Triton raises


def test_keys_tell_apart_what_argument_classes_tell_apart():
    """The flattened key of a launch is as fine as the tuple of :func:`fl.argument_class`:
    two launches share a key exactly where they share every argument's class."""
    table = fl._KernelTable(_Signature())
    buf = torch.zeros(64, dtype=torch.bfloat16)
    pool = [buf, buf[1:], buf[8:], buf.float(), *_VALUES]
    by_key: dict[tuple, tuple] = {}
    for a in pool:
        for b in pool:
            values, options = table.bind((a, b, 3), {"e": 32})
            classes = (options, tuple(map(fl.argument_class, values, table.constexpr)))
            assert by_key.setdefault(table.key(values, options, 0), classes) == classes
    assert len(by_key) == len({v for v in by_key.values()})


def test_falls_back_to_triton_without_a_jit_function_or_a_gpu():
    calls: list = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    fl.fast_launch(Kernel(), (3,), 1, 2, BLOCK=4)
    assert calls == [((3,), (1, 2), {"BLOCK": 4})]
    assert fl.launch_counts(Kernel()) == (0, 0)


@pytest.mark.gpu
def test_gpu_fast_launches_match_triton_launches(monkeypatch):
    """The RMSNorm op, forward and backward, over pointer alignments and row counts of
    every integer class: its launches through ``fast_launch`` and through
    ``kernel[grid]`` (``fast_launch`` disabled) agree bit for bit, and the second launch
    of each class reuses the kept kernel."""
    from dtree.ops.rms_norm import triton_kernels as rt

    def run(x, w):
        y, r = rt.rms_norm_forward(x, w, 1e-6)
        dx, dw = rt.rms_norm_backward(y, x, w, r, True)
        return y, r, dx, dw

    torch.manual_seed(0)
    buf = torch.randn(40 * 1536 + 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, device="cuda", dtype=torch.bfloat16)
    hits = fl.launch_counts(rt._rms_norm_fwd_kernel)[1]
    for offset in (0, 8, 1, 3):  # x 16-byte aligned, then not
        for rows in (1, 3, 16, 33):
            x = buf[offset : offset + rows * 1536].view(rows, 1536)
            fast = [run(x, w) for _ in range(2)]
            monkeypatch.setattr(fl, "_ENABLED", False)
            ref = run(x, w)
            monkeypatch.setattr(fl, "_ENABLED", True)
            for got in fast:
                for a, b in zip(got, ref):
                    assert torch.equal(a, b)
    classes, after = fl.launch_counts(rt._rms_norm_fwd_kernel)
    assert after - hits >= 16  # the second launch of each (offset, rows) at least
    assert classes >= 2  # aligned and misaligned x


def test_grid_arithmetic_matches_triton():
    assert all(fl.next_power_of_2(n) == triton.next_power_of_2(n) for n in range(0, 20_000))
    assert all(fl.cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 2000) for b in (1, 3, 16, 64, 1024))
