"""Stack attention as plain varlen attention calls over two kinds of regions, merged
by log-sum-exp, with the region kernel pluggable.

The regions (:mod:`dtree.ops.stack_attention.region_plan`): every segment against its own K/V (causal,
one varlen call), and the prefix *levels*: non-causal varlen calls whose sequences pair
query rows with a contiguous range of stack slots, read in place (no gather, no copy).
For query row ``r`` with regions ``c`` (output ``o_c``, natural log-sum-exp ``l_c``)::

    l = log sum_c exp(l_c)        out = sum_c exp(l_c - l) * o_c

is its attention over the union of the regions' keys. The backward of each region
needs only ``P = exp(S - l)`` and ``delta = rowsum(dO * out)``, both of the *merged*
attention: so every region's backward is fed the merged ``out`` and ``l`` (as ring
attention does), and its dq adds up over the regions, its dK/dV belong to its keys
(the own region's to the call's k, v; a level's are added into the stack's gradient
buffers, in a fixed order: deterministic).

Region kernels (:class:`RegionKernel`): :data:`TORCH_REGIONS` here, pure torch, float32
math (float64 for float64 inputs), the reference every piece of this path is tested
with on CPU; flash-attn-4's varlen forward and backward on CUDA
(:mod:`dtree.ops.stack_attention.flash4`).

Plain attention only (no softcap, sinks, ALiBi or window): the backend that uses this
path hands calls with options to the Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ...device.transfer import upload
from ..stack_ops.kv_stack import KVStack
from .options import PLAIN, AttentionOptions, StackSlots
from .output_memo import kept_or_computed
from .region_plan import RegionLevel, RegionPlan, region_plan
from .segment_layout import SegmentLayout

__all__ = [
    "TORCH_REGIONS",
    "RegionKernel",
    "RegionSeqs",
    "lse_merge_reference",
    "stack_attention_regions",
]


@dataclass(frozen=True)
class RegionSeqs:
    """The sequences of one region call: sequence ``b`` is query rows ``[q_start[b],
    q_start[b] + q_len[b])`` against rows ``[k_start[b], k_start[b] + k_len[b])`` of the
    K/V tensors the call is given. ``ragged``: the sequences leave gaps (flash-attn
    then needs ``seqused``); otherwise they tile ``q``/``k`` from row 0.

    Attributes:
        q_start, q_len, k_start, k_len: [B] int64 (host).
    """

    q_start: np.ndarray
    q_len: np.ndarray
    k_start: np.ndarray
    k_len: np.ndarray
    ragged: bool
    key: tuple  # identifies these tables on their layout (the device copies are cached there)

    @property
    def max_q(self) -> int:
        return int(self.q_len.max())

    @property
    def max_k(self) -> int:
        return int(self.k_len.max())

    def device_tables(self, layout: SegmentLayout, device: torch.device) -> dict[str, torch.Tensor]:
        """int32 ``cu_q [B+1]``, ``cu_k [B+1]`` and, when ragged, ``used_q [B]``,
        ``used_k [B]`` (one upload, cached on ``layout``). Each table starts on a 16-byte
        boundary: flash-attn-4's backward copies a misaligned one on every call."""

        def build():
            cu_q = np.r_[self.q_start, self.q_start[-1] + self.q_len[-1]]
            cu_k = np.r_[self.k_start, self.k_start[-1] + self.k_len[-1]]
            names = ["cu_q", "cu_k"] + (["used_q", "used_k"] if self.ragged else [])
            parts = [cu_q, cu_k] + ([self.q_len, self.k_len] if self.ragged else [])
            starts = np.cumsum([0] + [-(-len(p) // 4) * 4 for p in parts])  # 4 int32 = 16 bytes
            packed = np.zeros(int(starts[-1]), dtype=np.int32)
            for p, start in zip(parts, starts):
                packed[start : start + len(p)] = p
            t = upload(packed, device)
            return {name: t[start : start + len(p)] for name, p, start in zip(names, parts, starts)}

        return layout.cached(("regions", self.key, device), build)


def own_seqs(plan: RegionPlan) -> RegionSeqs:
    """Every non-empty segment against its own keys (the call's k, v rows)."""
    off = plan.own_offsets
    return RegionSeqs(off[:-1], np.diff(off), off[:-1], np.diff(off), False, ("own",))


def level_seqs(plan: RegionPlan, index: int) -> RegionSeqs:
    """Level ``index`` of ``plan``, keys relative to the first slot of its span."""
    level: RegionLevel = plan.levels[index]
    lo, _ = level.span
    return RegionSeqs(level.q_start, level.q_len, level.k_start - lo, level.k_len, True, ("level", index))


class RegionKernel(Protocol):
    """Plain softmax attention over the sequences of one :class:`RegionSeqs`, causal or
    not (causal: bottom-right aligned, as flash-attn). Each method writes only the rows
    (and keys) of its sequences and leaves every other row of its outputs as it was."""

    def forward(self, q, k, v, seqs: RegionSeqs, layout: SegmentLayout, scale: float, causal: bool,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        """q [T, Hq, Dk], k [N, Hkv, Dk], v [N, Hkv, Dv]; writes out [T, Hq, Dv] and
        the natural log-sum-exp lse [Hq, T]."""

    def backward(self, q, k, v, out, dout, lse, seqs: RegionSeqs, layout: SegmentLayout, scale: float,
                 causal: bool, deterministic: bool, dq, dk, dv) -> None:
        """With ``out``/``lse`` the *merged* ones: writes dq [T, Hq, Dk], dk [N, Hkv, Dk],
        dv [N, Hkv, Dv] (in their dtypes)."""

    def merge(self, outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """outs [C, T, Hq, Dv], lses [C, Hq, T] (-inf: the region does not cover the
        row; its output row is then never read) -> (out [T, Hq, Dv], lse [Hq, T])."""


def lse_merge_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`RegionKernel.merge` in torch (float32 math, float64 for float64)."""
    acc = torch.float64 if outs.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(lses.to(acc), dim=0)  # [H, T]; every row is covered by the own region
    weight = torch.exp(lses.to(acc) - lse)  # [C, H, T], 0 where a region does not cover the row
    covered = torch.isfinite(lses).transpose(1, 2)[..., None]  # [C, T, H, 1]
    terms = torch.where(covered, outs.to(acc) * weight.transpose(1, 2)[..., None], 0.0)
    return terms.sum(0).to(outs.dtype), lse.to(lses.dtype)


class _TorchRegions:
    """:class:`RegionKernel` in pure torch, one sequence at a time."""

    @staticmethod
    def _scores(q, k, scale: float, causal: bool, acc: torch.dtype):
        group = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc).repeat_interleave(group, 1)) * scale
        if causal:  # bottom-right: row i sees keys j <= i + (Lk - Lq)
            lq, lk = q.shape[0], k.shape[0]
            hidden = torch.arange(lk, device=q.device)[None, :] > torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            s = s.masked_fill(hidden, float("-inf"))
        return s

    @staticmethod
    def _sequences(seqs: RegionSeqs):
        columns = (seqs.q_start, seqs.q_len, seqs.k_start, seqs.k_len)
        for qa, ql, ka, kl in zip(*(c.tolist() for c in columns)):
            yield slice(qa, qa + ql), slice(ka, ka + kl)

    def forward(self, q, k, v, seqs, layout, scale, causal, out, lse) -> None:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        group = q.shape[1] // k.shape[1]
        for rows, keys in self._sequences(seqs):
            s = self._scores(q[rows], k[keys], scale, causal, acc)
            l_rows = torch.logsumexp(s, dim=-1)  # [H, Lq]
            p = torch.exp(s - l_rows[..., None])
            out[rows] = torch.einsum("hqk,khd->qhd", p, v[keys].to(acc).repeat_interleave(group, 1)).to(out.dtype)
            lse[:, rows] = l_rows.to(lse.dtype)

    def backward(self, q, k, v, out, dout, lse, seqs, layout, scale, causal, deterministic, dq, dk, dv) -> None:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        hkv, group = k.shape[1], q.shape[1] // k.shape[1]
        for rows, keys in self._sequences(seqs):
            qa, do, vv = q[rows].to(acc), dout[rows].to(acc), v[keys].to(acc).repeat_interleave(group, 1)
            p = torch.exp(self._scores(q[rows], k[keys], scale, causal, acc) - lse[:, rows].to(acc)[..., None])
            delta = (do * out[rows].to(acc)).sum(-1).transpose(0, 1)  # [H, Lq]
            ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta[..., None])
            kk = k[keys].to(acc).repeat_interleave(group, 1)
            dq[rows] = (torch.einsum("hqk,khd->qhd", ds, kk) * scale).to(dq.dtype)
            n = k[keys].shape[0]
            dk_h = torch.einsum("hqk,qhd->khd", ds, qa) * scale
            dv_h = torch.einsum("hqk,qhd->khd", p, do)
            dk[keys] = dk_h.reshape(n, hkv, group, -1).sum(2).to(dk.dtype)
            dv[keys] = dv_h.reshape(n, hkv, group, -1).sum(2).to(dv.dtype)

    def merge(self, outs, lses):
        return lse_merge_reference(outs, lses)


TORCH_REGIONS: RegionKernel = _TorchRegions()


def _forward(q, k, v, stack: KVStack, layer: int, layout: SegmentLayout, scale: float, kernel: RegionKernel):
    """(out [T, Hq, Dv], lse [Hq, T]) of every region, merged."""
    plan = region_plan(layout)
    t, hq = q.shape[:2]
    n = len(plan.levels) + 1
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs = torch.empty((n, t, hq, v.shape[-1]), dtype=q.dtype, device=q.device)
    lses = torch.empty((n, hq, t), dtype=lse_dtype, device=q.device)
    if n > 1:  # rows a level does not cover
        lses[:-1].fill_(float("-inf"))
    for c, level in enumerate(plan.levels):
        lo, hi = level.span
        kernel.forward(q, stack.k[layer, lo:hi], stack.v[layer, lo:hi], level_seqs(plan, c), layout, scale, False,
                       outs[c], lses[c])
    kernel.forward(q, k, v, own_seqs(plan), layout, scale, True, outs[-1], lses[-1])
    return (outs[0], lses[0]) if n == 1 else kernel.merge(outs, lses)


class _RegionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, stack: KVStack, layer: int, layout: SegmentLayout, scale: float,
                kernel: RegionKernel, deterministic: bool):
        t, hq = q.shape[:2]
        out, lse = kept_or_computed(lambda: _forward(q, k, v, stack, layer, layout, scale, kernel),
                                    (t, hq, v.shape[-1]), (hq, t), q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.stack, ctx.layer, ctx.layout, ctx.scale = stack, layer, layout, scale
        ctx.kernel, ctx.deterministic = kernel, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        stack, layer, layout, kernel = ctx.stack, ctx.layer, ctx.layout, ctx.kernel
        plan = region_plan(layout)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        kernel.backward(q, k, v, out, dout, lse, own_seqs(plan), layout, ctx.scale, True, ctx.deterministic,
                        dq, dk, dv)
        for c, level in enumerate(plan.levels):
            lo, hi = level.span
            sk, sv = stack.k[layer, lo:hi], stack.v[layer, lo:hi]
            covers_rows = int(level.q_len.sum()) == q.shape[0]
            dq_c = (torch.empty if covers_rows else torch.zeros)(q.shape, dtype=q.dtype, device=q.device)
            alloc = torch.empty if level.gapless else torch.zeros  # unread slots add 0
            dk_c = alloc(sk.shape, dtype=sk.dtype, device=sk.device)
            dv_c = alloc(sv.shape, dtype=sv.dtype, device=sv.device)
            kernel.backward(q, sk, sv, out, dout, lse, level_seqs(plan, c), layout, ctx.scale, False,
                            ctx.deterministic, dq_c, dk_c, dv_c)
            dq.add_(dq_c)
            if stack.has_grad:
                stack.grad_slots_through(hi)
                stack.grad_k[layer, lo:hi].add_(dk_c)
                stack.grad_v[layer, lo:hi].add_(dv_c)
        return dq, dk, dv, None, None, None, None, None, None


def stack_attention_regions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: StackSlots,
    options: AttentionOptions = PLAIN,
    *,
    kernel: RegionKernel = TORCH_REGIONS,
) -> torch.Tensor:
    """Plain stack attention (the backends' signature and contract,
    :mod:`dtree.ops.stack_attention.options`; no score options) as region calls of
    ``kernel`` (:data:`TORCH_REGIONS`, or flash-attn-4's) merged by log-sum-exp. q, k, v
    with a unit last stride (the kernels take other strides as they are).
    ``options.deterministic`` asks the kernel for a backward with a fixed order of
    summation (the merge and the stack-gradient adds have one already).
    """
    if not options.plain:
        raise ValueError("stack_attention_regions takes no score options (softcap, sinks, ALiBi, window)")
    stack, layer, layout = slots.stack, slots.layer, slots.layout
    scale, deterministic = options.softmax_scale(q.shape[-1]), options.deterministic
    if q.shape[0] == 0:
        raise ValueError("stack attention needs at least one query row")
    slots_end = region_plan(layout).slots_end
    if slots_end > stack.capacity:
        raise ValueError(f"prefix ranges reach slot {slots_end}, past the stack capacity {stack.capacity}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _RegionAttention.apply(q, k, v, stack, layer, layout, float(scale), kernel, bool(deterministic))
