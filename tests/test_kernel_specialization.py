"""One compile per kernel variant per process: two calls of different shapes give every
Triton kernel the same specialization key.

Triton compiles a kernel again for each new specialization of its non-constexpr
arguments (an int equal to 1 or divisible by 16, a pointer aligned to 16 bytes). The
kernels mark the arguments that change between calls ``do_not_specialize``; here the
launches of two realistic calls are recorded on CPU tensors (nothing runs), and the
key Triton's own binder would compute for an sm_90 target (``native_specialize_impl``
under the kernel's parameter flags) is compared. Needs no GPU; skipped when the session
runs the Triton interpreter (its kernels are not JIT functions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from dtree.ops.logprobs import fused_head as fh  # noqa: E402
from dtree.ops.logprobs import triton_kernels as lt  # noqa: E402
from dtree.ops.stack_attention import PLAIN, AttentionOptions, SegmentLayout, StackSlots  # noqa: E402
from dtree.ops.stack_attention import triton_autograd as sat  # noqa: E402
from dtree.ops.stack_attention import triton_launch as launch  # noqa: E402
from dtree.ops.stack_ops.kv_stack import KVStack  # noqa: E402

pytestmark = pytest.mark.skipif(sat._INTERPRET, reason="the session runs the Triton interpreter")


def _binder(kernel):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    try:
        backend = make_backend(GPUTarget("cuda", 90, 32))
    except Exception as e:  # a Triton build without the NVIDIA backend
        pytest.skip(f"no CUDA backend in this Triton: {e}")
    return create_function_from_signature(kernel.signature, kernel.params, backend)


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = (kernel.kernel if isinstance(kernel, _Recorder) else kernel), calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.kernel, args, kwargs))

        return launch


def _keys(calls) -> dict[str, list]:
    """Per kernel name, the specialization keys of its recorded launches."""
    keys: dict[str, list] = {}
    for kernel, args, kwargs in calls:
        _, spec, _ = _binder(kernel)(*args, **kwargs)
        keys.setdefault(kernel.fn.__name__, []).append(spec)
    return keys


def _stack_attention_calls(
    monkeypatch, layout: SegmentLayout, used: int, options: AttentionOptions, deterministic: bool, backward: str
) -> list:
    calls: list = []
    for name in ("fwd", "dq", "dkdv", "fused"):
        monkeypatch.setitem(launch._KERNELS, name, _Recorder(launch._KERNELS[name], calls))
    monkeypatch.setattr(sat, "_delta_kernel", _Recorder(sat._delta_kernel, calls))
    t = int(layout.q_offsets[-1])
    hq, hkv, d = 12, 2, 128
    stack = KVStack(2, used + t, hkv, d, dtype=torch.bfloat16, device="cpu")
    # q as the HF adapter passes it: a [T, H, D] view of [1, H, T, D]
    q = torch.zeros(1, hq, t, d, dtype=torch.bfloat16)[0].transpose(0, 1).requires_grad_()
    k = torch.zeros(1, hkv, t, d, dtype=torch.bfloat16)[0].transpose(0, 1).requires_grad_()
    v = torch.zeros(1, hkv, t, d, dtype=torch.bfloat16)[0].transpose(0, 1).requires_grad_()
    tuning = sat._Tuning(deterministic=deterministic, backward=backward)
    out = sat._StackAttention.apply(q, k, v, None, stack, 1, layout, d**-0.5, options, tuning)
    out.backward(torch.zeros_like(out))
    return calls


def _grpo(prompt: int, answers: list[int]) -> tuple[SegmentLayout, int]:
    q_off = np.concatenate([[0], np.cumsum(answers)])
    return SegmentLayout(q_off, prompt + q_off[:-1], [((0, prompt),)] * len(answers)), prompt


def _agentic(seed: int) -> tuple[SegmentLayout, int]:
    """Segments under several multi-range prefixes, some with in-call ancestors."""
    rng = np.random.default_rng(seed)
    used = int(rng.integers(3000, 5000))
    lens = rng.integers(20, 700, int(rng.integers(3, 12)))
    q_off = np.concatenate([[0], np.cumsum(lens)])
    ranges = []
    for i in range(len(lens)):
        cut = int(rng.integers(100, used - 100))
        r = ((0, cut), (cut + int(rng.integers(1, 50)), used))
        if i and rng.random() < 0.5:  # reads the previous segment of the call
            r = r + ((used + int(q_off[i - 1]), used + int(q_off[i])),)
        ranges.append(r)
    return SegmentLayout(q_off, used + q_off[:-1], ranges), used


@pytest.mark.parametrize(
    "options,deterministic,backward",
    [(PLAIN, False, "fused"), (AttentionOptions(window=4096), False, "fused"), (PLAIN, False, "split"),
     (PLAIN, True, "split")],
    ids=["plain", "window", "split", "deterministic"],
)
def test_stack_attention_kernels_compile_once(monkeypatch, options, deterministic, backward):
    layouts = [_grpo(2048, [512] * 8), _grpo(1999, [301, 77, 512, 9, 1000, 3, 40]), _agentic(0), _agentic(1)]
    keys: dict[str, list] = {}
    for layout, used in layouts:
        calls = _stack_attention_calls(monkeypatch, layout, used, options, deterministic, backward)
        for name, spec in _keys(calls).items():
            keys.setdefault(name, []).extend(spec)
    if backward == "split":  # dq stores delta: no delta launch
        assert set(keys) == {"_fwd_kernel", "_dkdv_kernel", "_dq_kernel"}
    else:  # the delta kernel zeroes the dq accumulator; the dK/dV kernel adds dq into it
        assert set(keys) == {"_fwd_kernel", "_delta_kernel", "_dkdv_kernel"}
    for name, specs in keys.items():
        distinct = {repr(s) for s in specs}
        assert len(distinct) == 1, f"{name} compiles {len(distinct)} variants over these calls: {distinct}"


@pytest.mark.parametrize("vocab", [1024, 1000])
def test_logprob_kernels_compile_once(monkeypatch, vocab):
    """Once per kernel over calls of several row counts (so the backward's vocabulary slices
    differ in width and first id); a vocabulary whose size is not a multiple of 16 compiles
    the dL/dlogits kernel a second time, for the last slice's row stride."""
    calls: list = []
    monkeypatch.setattr(lt, "_row_stats_kernel", _Recorder(lt._row_stats_kernel, calls))
    monkeypatch.setattr(lt, "_dlogits_kernel", _Recorder(lt._dlogits_kernel, calls))
    weight = torch.zeros(vocab, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.zeros(200, dtype=torch.int64)
    tf = lt.LogitTransform()
    for start, rows in [(0, 64), (1, 37), (3, 48), (17, 100)]:  # label slices at any offset, as the runtime's
        hidden = torch.zeros(rows, 64, dtype=torch.bfloat16, requires_grad=True)
        logp, ent = fh._FusedLogprobs.apply(hidden, weight, None, labels[start : start + rows], tf, True, 32, True, False)
        torch.autograd.backward([logp, ent], [torch.zeros_like(logp), torch.zeros_like(ent)])
    keys = _keys(calls)
    assert set(keys) == {"_row_stats_kernel", "_dlogits_kernel"}
    for name, specs in keys.items():
        distinct = {repr(s) for s in specs}
        most = 2 if name == "_dlogits_kernel" and vocab % 16 else 1
        assert len(distinct) <= most, f"{name} compiles {len(distinct)} variants over these calls: {distinct}"


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_calls_run_the_split_backward(monkeypatch, deterministic):
    """``backward=None`` resolves to the split backward in deterministic mode (no float
    atomics on dq) and to ``DEFAULT_BACKWARD`` otherwise."""
    calls: list = []
    for name in ("fwd", "dq", "dkdv", "fused"):
        monkeypatch.setitem(launch._KERNELS, name, _Recorder(launch._KERNELS[name], calls))
    monkeypatch.setattr(sat, "_delta_kernel", _Recorder(sat._delta_kernel, calls))
    monkeypatch.setattr(sat, "require_triton", lambda device: None)  # records launches on CPU tensors
    layout, used = _grpo(64, [16, 9])
    stack = KVStack(1, used + 25, 1, 16, dtype=torch.bfloat16, device="cpu")
    q, k, v = (torch.zeros(25, h, 16, dtype=torch.bfloat16, requires_grad=True) for h in (2, 1, 1))
    out = sat.stack_attention_triton(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=0.25, deterministic=deterministic))
    out.backward(torch.zeros_like(out))
    launched = [kernel.fn.__name__ for kernel, _, kwargs in calls]
    fused = [kwargs.get("FUSED_DQ") for kernel, _, kwargs in calls if kernel.fn.__name__ == "_dkdv_kernel"]
    split = deterministic or sat.DEFAULT_BACKWARD == "split"
    assert ("_dq_kernel" in launched) == split
    assert fused == [not split]


def test_lse_merge_kernel_compiles_once(monkeypatch):
    """The flash-attn backend's merge: one variant whatever the call's region count and
    length (the count, one more than the prefix levels, changes from call to call)."""
    from dtree.ops.stack_attention import lse_merge_triton as lm

    calls: list = []
    monkeypatch.setattr(lm, "_lse_merge_kernel", _Recorder(lm._lse_merge_kernel, calls))
    for c, t in [(2, 64), (3, 70), (7, 1001), (13, 4096), (16, 333)]:
        lm.lse_merge_triton(torch.zeros(c, t, 12, 128, dtype=torch.bfloat16), torch.zeros(c, 12, t))
    keys = _keys(calls)
    assert len({repr(s) for s in keys["_lse_merge_kernel"]}) == 1
