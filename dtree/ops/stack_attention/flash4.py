"""The ``flash-attn`` stack attention backend: flash-attn-4's varlen kernels
(``flash_attn.cute``, CuTe DSL; Hopper and Blackwell) as the region kernel of
:mod:`dtree.ops.stack_attention.regions`.

Per call and layer, when the call is one masked attention over the stack
(:mod:`dtree.ops.stack_attention.flash4_masked_call`, the default: every call of the walk):
one flash-attn-4 forward and one backward with block sparsity and a mask function.
Otherwise, the region path: one non-causal varlen forward per prefix level (the stack's K/V
read in place: ``k = stack.k[layer, lo:hi]`` with ``cu_seqlens_k``/``seqused_k`` picking
each pair's slots, ``cu_seqlens_q``/``seqused_q`` its rows), one causal varlen forward
over the segments' own K/V, and one Triton kernel that merges them by log-sum-exp
(:mod:`dtree.ops.stack_attention.lse_merge_triton`). The backward runs flash-attn-4's varlen backward
per region with the merged output and log-sum-exp; ``deterministic`` asks it for its
semaphore-ordered dQ (and GQA dK/dV) accumulation. The private entry points
``_flash_attn_fwd`` / ``_flash_attn_bwd`` take preallocated outputs and return the
log-sum-exp, which the public ``flash_attn_varlen_func`` does not let a caller feed back;
they are pinned with the ``flash`` extra (``flash-attn-4==4.0.0b36``).

Host cost (:mod:`dtree.ops.stack_attention.flash4_replay`): the first call of each call class goes through
those entry points, later ones launch the kernels they compiled directly; max lengths
are bucketed so that fresh forests reuse the compiled kernels; the ``cu_seqlens`` /
``seqused`` tables are 16-byte aligned, which the backward otherwise copies.

Calls with attention options (softcap, sinks, ALiBi, a window) run the fused Triton
kernel (:mod:`dtree.ops.stack_attention.triton_autograd`): the prefix level's query depths vary
inside one varlen sequence, which flash-attn's position-based masks cannot express.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch

from ..backends import Target
from .call_mask import CallMask, call_mask
from .flash4_masked_call import FLASH4_MASKED_CALL, device_tables
from .flash4_replay import bucket_len
from .masked_call import stack_attention_masked_call
from .options import PLAIN, AttentionOptions, StackSlots, check_stack_attention
from .regions import stack_attention_regions
from .segment_layout import SegmentLayout

__all__ = ["FLASH4_REGIONS", "DTYPES", "flash4_unavailable", "prepare_flash4_call", "stack_attention_flash4"]

DTYPES = (torch.float16, torch.bfloat16)
# Calls whose tree the two tables of call_mask express (every call of the walk's depth-first
# schedule) and whose slots fit the stack run as one masked attention (masked_call, flash4_masked_call);
# DTREE_FLASH_REGIONS=1 keeps every call on the region path (benchmarks compare the two).
ONE_CALL_PATH = os.environ.get("DTREE_FLASH_REGIONS", "0") != "1"
# Head dims the backend runs at: those its GPU tests pass at. At head dim 16 (the tests' small
# GPT-J, Granite and hybrid configs) both paths gave gradients 27x off the bf16 error on an H100
# (session I), so other dims run the Triton kernel (and "auto" picks it).
HEAD_DIMS = (64, 128)
_INSTALL = "pip install 'dtree[flash]' (flash-attn-4, CuTe DSL wheels)"


@functools.lru_cache(maxsize=None)
def _flash4():
    """flash-attn-4's launcher (:class:`dtree.ops.stack_attention.flash4_replay.Flash4Calls` over
    ``flash_attn.cute.interface``), or the reason it cannot be imported."""
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        return f"flash-attn-4 does not import ({e}); {_INSTALL}"
    missing = [name for name in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(interface, name)]
    if missing:  # an older or newer package without these entry points
        return f"flash-attn-4 lacks {', '.join(missing)} (the flash extra pins 4.0.0b36); {_INSTALL}"
    from .flash4_replay import Flash4Calls

    return Flash4Calls(interface)


def _calls():
    found = _flash4()
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


class _Flash4Regions:
    """:class:`dtree.ops.stack_attention.regions.RegionKernel` on flash-attn-4."""

    def forward(self, q, k, v, seqs, layout, scale, causal, out, lse) -> None:
        tables = seqs.device_tables(layout, q.device)
        _calls().forward(q, k, v, tables, bucket_len(seqs.max_q), bucket_len(seqs.max_k), scale, causal, out, lse)

    def backward(self, q, k, v, out, dout, lse, seqs, layout, scale, causal, deterministic, dq, dk, dv) -> None:
        tables = seqs.device_tables(layout, q.device)
        _calls().backward(q, k, v, out, dout, lse, tables, bucket_len(seqs.max_q), bucket_len(seqs.max_k), scale,
                          causal, deterministic, dq, dk, dv)

    def merge(self, outs, lses):
        from .lse_merge_triton import lse_merge_triton

        return lse_merge_triton(outs, lses)


FLASH4_REGIONS = _Flash4Regions()


def flash4_unavailable(target: Target) -> str | None:
    """Why the ``flash-attn`` backend cannot run on ``target`` (None: it runs):
    flash-attn-4 missing, not a CUDA GPU of compute capability >= 9.0, a dtype other
    than float16/bfloat16, head dims other than 64 and 128 (the ones verified)."""
    found = _flash4()
    if isinstance(found, str):
        return f"cannot run here: {found}; use attention='triton'"
    device = torch.device(target.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"runs on CUDA GPUs, got {device}; use attention='sdpa'"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return (f"needs compute capability >= 9.0 (Hopper), {torch.cuda.get_device_name(device)} has {major}.x; "
                "use attention='triton'")
    if target.dtype is not None and target.dtype not in DTYPES:
        return f"runs float16/bfloat16, this model is {target.dtype}; use attention='triton'"
    if target.head_dim is not None and target.head_dim not in HEAD_DIMS:
        return f"is verified at head dims {HEAD_DIMS}, this model has {target.head_dim}; use attention='triton'"
    return None


@functools.lru_cache(maxsize=None)
def _why_not(device: torch.device, dtype: torch.dtype, key_dim: int, value_dim: int) -> str | None:
    """:func:`flash4_unavailable` for both head dims of a call (cached: it runs per call)."""
    for dim in (key_dim, value_dim):
        why = flash4_unavailable(Target(device, dtype, head_dim=dim))
        if why is not None:
            return why
    return None


def stack_attention_flash4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions = PLAIN
) -> torch.Tensor:
    """Stack attention through flash-attn-4 region calls (the ``flash-attn`` backend;
    shapes, arguments and gradients in :mod:`dtree.ops.stack_attention.options`; CUDA
    float16/bfloat16, head dims 64 and 128). With a score option set, the call runs the
    Triton kernel. ``options.deterministic`` (None:
    ``torch.are_deterministic_algorithms_enabled()``): a backward whose sums have a fixed
    order, so two runs give bitwise-equal gradients.
    """
    check_stack_attention(q, k, v, slots, options)
    deterministic = options.deterministic
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if not options.plain:
        from .triton_autograd import stack_attention_triton

        return stack_attention_triton(q, k, v, slots, replace(options, deterministic=deterministic))
    why = _why_not(q.device, q.dtype, k.shape[-1], v.shape[-1])
    if why is not None:
        raise ValueError(f"attention='flash-attn' {why}")
    stack = slots.stack
    if not (q.dtype == k.dtype == v.dtype == stack.dtype):
        raise TypeError(f"q, k, v and the stack must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {stack.dtype}")
    mask = _one_call_mask(slots.layout, deterministic)
    if mask is not None and stack.capacity >= mask.num_keys:
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        scale = options.softmax_scale(q.shape[-1])
        return stack_attention_masked_call(q, k, v, stack, slots.layer, slots.layout, mask, scale,
                                           kernel=FLASH4_MASKED_CALL, own_in_stack=slots.own_in_stack)
    return stack_attention_regions(q, k, v, slots, replace(options, deterministic=deterministic), kernel=FLASH4_REGIONS)


def _one_call_mask(layout: SegmentLayout, deterministic: bool) -> CallMask | None:
    """The call's mask when it may run as one masked attention (the stack's capacity aside),
    else None: the region path."""
    return call_mask(layout) if ONE_CALL_PATH and not deterministic else None


def prepare_flash4_call(layout: SegmentLayout, device: torch.device, deterministic: bool) -> None:
    """The host work of a call's one-call path done ahead of its first layer: the call's mask
    tables built and uploaded (cached on ``layout``, where :func:`stack_attention_flash4` finds
    them). Nothing for a call that will take the region path."""
    mask = _one_call_mask(layout, deterministic)
    if mask is not None:
        device_tables(mask, layout, device)
