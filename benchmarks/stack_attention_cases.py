"""Layouts, inputs and timing helpers shared by the stack-attention kernel benchmarks
(``bench_stack_attention.py``, ``bench_triton_tuning.py``).

Layouts (tokens of one call): ``grpo`` one 2048-token prompt shared by 8 answers of
512; ``agentic`` 32 tool results of 256 tokens in 4 branches, each under a shared
4096-token task prefix plus its branch's own 1024-token history (two ranges per
prefix); ``grpo_long`` a 256-token prompt under 8 answers of 2048; ``chain`` one
2048-token segment under a 6144-token prefix; ``many_small`` 256 segments of 32 tokens,
16 groups of 16 siblings under a shared 1024-token system prompt plus the group's
256-token context. ``--smoke`` sizes divide every length by 64.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F

from dtree.ops.stack_attention import AttentionOptions, SegmentLayout, StackSlots
from dtree.ops.stack_ops.kv_stack import KVStack

__all__ = ["Case", "bench_ms", "cases", "dense_inputs", "environment", "flash", "kernel_ms", "relative_error",
           "stack_inputs", "table"]


class Case:
    """One call: segments of equal length ``seg_len`` with equal-length prefixes, so
    the dense equivalent is one batched SDPA call of ``len(prefixes)`` rows."""

    def __init__(self, name: str, seg_len: int, prefixes: list[tuple[tuple[int, int], ...]], note: str):
        self.name, self.seg_len, self.note = name, seg_len, note
        self.prefix_len = sum(hi - lo for lo, hi in prefixes[0])
        assert all(sum(hi - lo for lo, hi in p) == self.prefix_len for p in prefixes)
        self.slots = max(hi for p in prefixes for _, hi in p)
        n = len(prefixes)
        q_off = np.arange(n + 1, dtype=np.int64) * seg_len
        self.layout = SegmentLayout(q_off, self.slots + q_off[:-1], list(prefixes))
        self.tokens = n * seg_len

    def pairs(self) -> float:
        """Visible (query, key) pairs."""
        n = self.layout.num_segments
        return n * (self.seg_len * self.prefix_len + self.seg_len * (self.seg_len + 1) / 2)


def cases(names: list[str], scale: int = 1) -> list[Case]:
    """The named layouts, every length divided by ``scale``."""
    s = scale
    groups = [((0, 1024 // s), (1024 // s + 256 // s * g, 1024 // s + 256 // s * (g + 1))) for g in range(16)]
    task, branch = 4096 // s, 1024 // s
    branches = [((0, task), (task + b * branch, task + (b + 1) * branch)) for b in range(4)]
    all_cases = {
        "grpo": Case("grpo", 512 // s, [((0, 2048 // s),)] * 8, f"prompt {2048 // s}, 8 answers x {512 // s}"),
        "agentic": Case("agentic", 256 // s, [branches[i // 8] for i in range(32)],
                        f"32 x {256 // s} tool results, 4 branches of prefix {task} + {branch}"),
        "grpo_long": Case("grpo_long", 2048 // s, [((0, 256 // s),)] * 8,
                          f"prompt {256 // s}, 8 answers x {2048 // s}"),
        "chain": Case("chain", 2048 // s, [((0, 6144 // s),)], f"1 segment x {2048 // s} under a {6144 // s} prefix"),
        "many_small": Case("many_small", max(1, 32 // s), [groups[i // 16] for i in range(256)],
                           f"256 x {max(1, 32 // s)} tokens, prefix {1024 // s} + {256 // s} (2 ranges)"),
    }
    return [all_cases[n] for n in names]


def stack_inputs(case: Case, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str = "cuda", seed: int = 0):
    """KV stack holding the ancestors, and this call's q, k, v (leaves, pushed onto the
    stack as the runtime does); the stack's gradients zeroed."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    stack = KVStack(1, case.slots + case.tokens, hkv, d, dtype=dtype, device=device)
    stack.k[0, : case.slots] = rand(case.slots, hkv, d)
    stack.v[0, : case.slots] = rand(case.slots, hkv, d)
    stack.zero_grad(0, stack.capacity)
    q, k, v = (rand(case.tokens, h, d).requires_grad_() for h in (hq, hkv, hkv))
    stack.push(0, case.slots, k.detach(), v.detach())
    return stack, q, k, v


def dense_inputs(case: Case, stack: KVStack, q, k, v):
    """The equivalent dense batch [segments, Hq, len, D] / [segments, Hq, prefix + len, D]:
    each segment's ancestors gathered in front of its own keys, K/V heads repeated."""
    n, length, group = case.layout.num_segments, case.seg_len, q.shape[1] // k.shape[1]
    rows = []
    for own, store in ((k.detach(), stack.k[0]), (v.detach(), stack.v[0])):
        batch = [
            torch.cat([store[case.layout.prefix_index(i, q.device)], own[i * length : (i + 1) * length]])
            for i in range(n)
        ]
        rows.append(torch.stack(batch).repeat_interleave(group, dim=2).transpose(1, 2).contiguous())
    qd = q.detach().view(n, length, q.shape[1], q.shape[2]).transpose(1, 2).contiguous()
    return [x.requires_grad_() for x in (qd, *rows)]


def flash(q, k, v, *, scale):
    """SDPA on the flash backend, lower-right causal: q [B, H, Lq, D], k/v [B, H, Lk, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        mask = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def fa4_dense(q, k, v, *, scale):
    """flash-attn-4's own kernel (``flash_attn.cute.flash_attn_func``, bottom-right causal,
    grouped-query attention in the kernel) on the dense batch: q [B, Lq, Hq, D], k/v
    [B, Lk, Hkv, D] (:func:`fa4_dense_inputs`). What a FlashAttention-class kernel does with
    the same (query, key) pairs without a tree: the reference for the stack kernels'
    speed and backward/forward ratio."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def fa4_dense_inputs(dense: list[torch.Tensor], go: torch.Tensor, group: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`dense_inputs`' batch ([B, H, L, D], K/V heads repeated ``group`` times) and its
    output gradient in flash-attn-4's layout: [B, L, H, D], K/V at the model's head count."""
    q, k, v = (x.detach() for x in dense)
    k, v = (x[:, ::group] for x in (k, v))
    leaves = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    return leaves, go.transpose(1, 2).contiguous()


def bench_ms(fn, grads=None) -> float:
    """Median ms of ``fn`` (``triton.testing.do_bench``); on CPU (smoke runs) one timed call."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, grad_to_none=grads, return_mode="median")


def kernel_ms(fn, iters: int = 10) -> dict[str, float]:
    """GPU time per call of ``fn`` by kernel name (torch.profiler), longest first; empty on CPU."""
    if not torch.cuda.is_available():
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        if getattr(event, "device_type", None) == DeviceType.CUDA and event.self_device_time_total:
            out[event.key] = out.get(event.key, 0.0) + event.self_device_time_total / iters / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| relative to the largest |b| (two kernels' bf16 results of float32 sums)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def short_kernel_name(name: str, width: int = 48) -> str:
    """A kernel name fit for a table cell (CuTe DSL names run to hundreds of characters)."""
    name = name.replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."


def environment(device: str = "cuda") -> dict:
    import triton

    flash_attn = "not importable"
    try:
        from importlib.metadata import version

        flash_attn = f"flash-attn-4 {version('flash-attn-4')}, nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}"
    except Exception:  # noqa: BLE001 (absent or a different distribution: report what is there)
        pass
    return {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter; times are meaningless)",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "flash_attn": flash_attn,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + ["| " + " | ".join(c) + " |" for c in lines]


def variant(attention, deterministic: bool | None = None, **tuning):
    """A stack-attention backend (``(q, k, v, slots, options)``) with ``options.deterministic``
    and the Triton kernel's tuning knobs (``stack_attention_triton_tuned``) fixed."""

    def call(q, k, v, slots, options):
        return attention(q, k, v, slots, dataclasses.replace(options, deterministic=deterministic), **tuning)

    return call


def bind(attention, stack: KVStack, layout: SegmentLayout, scale: float, **options):
    """A stack-attention backend as ``(q, k, v) -> out`` on layer 0 of ``stack``, with the
    scale and the score options bound."""
    slots, opts = StackSlots(stack, 0, layout), AttentionOptions(scale=scale, **options)
    return lambda q, k, v: attention(q, k, v, slots, opts)
