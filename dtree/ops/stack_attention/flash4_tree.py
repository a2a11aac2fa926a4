"""The ``flash-attn`` backend's one-call path: a stack-attention call as a single
flash-attn-4 attention over stack slots ``[0, base + T)`` under the call's tree mask
(:mod:`dtree.ops.stack_attention.tree_mask`): block sparsity skips the tiles no row sees
and runs the fully visible ones unmasked; the rest evaluate a two-table mask function.
One forward and one backward kernel per layer and call, where the region path
(:mod:`dtree.ops.stack_attention.regions`) runs one pair per prefix level plus a
log-sum-exp merge, per-level dq adds and fills (5 to 13 levels on 64k agentic calls).

The own K/V must sit in the stack's slots ``[base, base + T)``: the forward writes them
there (the same values a push writes; :class:`dtree.stacks.GroupAttention` pushes for
this backend on every call, and the plan sizes the stack for every call's slots). The
backward adds the slots below the call into the stack's gradient buffers and returns
the call's own slots as the gradients of ``k, v``: they hold every contribution of this
call (its own rows' and its in-call descendants'), so nothing of the call goes through
the stack's gradient slots, and :func:`.seed_from_stack` adds only later calls' terms.

flash-attn-4 (4.0.0b36) takes block sparsity and a mask function on Hopper, forward and
backward, for fixed-length batches (no varlen); its kernels compile once per model
(lengths are runtime values). Not deterministic (its dQ and GQA dK/dV accumulate with
atomics): deterministic calls take the region path.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...device.transfer import upload
from ..stack_ops.kv_stack import KVStack
from .output_memo import kept_or_computed
from .segment_layout import SegmentLayout
from .tree_mask import BLOCK, BlockLists, TreeMask

__all__ = ["stack_attention_tree"]


@functools.lru_cache(maxsize=None)
def _mask_function():
    """The mask function flash-attn-4 compiles in: row ``m`` sees key ``n`` iff
    ``slot_row_lo[n] <= m < slot_row_hi[n]`` (its two auxiliary tensors). Built once,
    so its hash (part of flash-attn-4's compile key) stays the same."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def stack_tree_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        row_lo = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
        row_hi = utils.scalar_to_ssa(aux_tensors[1][n_idx[0]], cutlass.Int32)
        return (row_lo <= m_idx) & (m_idx < row_hi)

    return stack_tree_mask


def _device_tables(mask: TreeMask, layout: SegmentLayout, device: torch.device) -> dict:
    """The two mask tables and both block-sparsity structures on ``device`` (one upload,
    each part 16-byte aligned; cached on the layout)."""

    def build():
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        lists = (mask.by_row_tile, mask.by_slot_tile)
        parts = [mask.slot_row_lo, mask.slot_row_hi]
        for b in lists:
            parts += [b.partial_cnt, b.partial_idx.ravel(), b.full_cnt, b.full_idx.ravel()]
        starts = np.cumsum([0] + [-(-p.size // 4) * 4 for p in parts])
        packed = np.zeros(int(starts[-1]), dtype=np.int32)
        for p, s in zip(parts, starts):
            packed[s : s + p.size] = p.ravel()
        t = upload(packed, device)
        views = [t[s : s + p.size] for p, s in zip(parts, starts)]

        def sparse(b: BlockLists, at: int):
            cnt, idx, fcnt, fidx = views[at : at + 4]
            n = len(b.partial_cnt)
            return BlockSparseTensorsTorch(
                mask_block_cnt=cnt.view(1, 1, n), mask_block_idx=idx.view(1, 1, n, -1),
                full_block_cnt=fcnt.view(1, 1, n), full_block_idx=fidx.view(1, 1, n, -1), block_size=(BLOCK, BLOCK),
            )

        return {"aux": views[:2], "fwd": sparse(lists[0], 2), "bwd": sparse(lists[1], 6)}

    return layout.cached(("flash4_tree", device), build)


def _interface():
    from flash_attn.cute import interface

    return interface


class _TreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, stack: KVStack, layer: int, layout: SegmentLayout, mask: TreeMask, scale: float):
        base, n = mask.base, mask.num_keys
        stack.k[layer, base:n].copy_(k)
        stack.v[layer, base:n].copy_(v)
        tables = _device_tables(mask, layout, q.device)
        t, hq = q.shape[:2]

        def compute():
            out, lse = _interface()._flash_attn_fwd(
                q[None], stack.k[layer, :n][None], stack.v[layer, :n][None], softmax_scale=scale, causal=False,
                mask_mod=_mask_function(), aux_tensors=tables["aux"], block_sparse_tensors=tables["fwd"],
                return_lse=True,
            )[:2]
            return out[0], lse[0]

        out, lse = kept_or_computed(compute, (t, hq, v.shape[-1]), (hq, t), q.dtype)
        ctx.save_for_backward(q, out, lse)
        ctx.stack, ctx.layer, ctx.layout, ctx.mask, ctx.scale = stack, layer, layout, mask, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        stack, layer, mask = ctx.stack, ctx.layer, ctx.mask
        base, n = mask.base, mask.num_keys
        tables = _device_tables(mask, ctx.layout, q.device)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = _interface()._flash_attn_bwd(
            q[None], stack.k[layer, :n][None], stack.v[layer, :n][None], out[None], dout[None], lse[None],
            softmax_scale=ctx.scale, causal=False, mask_mod=_mask_function(), aux_tensors=tables["aux"],
            block_sparse_tensors=tables["bwd"],
        )[:3]
        dk, dv = dk[0], dv[0]
        if stack.has_grad and base > 0:
            stack.grad_k[layer, :base].add_(dk[:base])
            stack.grad_v[layer, :base].add_(dv[:base])
        return dq[0], dk[base:], dv[base:], None, None, None, None, None


def stack_attention_tree(q, k, v, stack: KVStack, layer: int, layout: SegmentLayout, mask: TreeMask,
                         scale: float) -> torch.Tensor:
    """Plain stack attention of one call as one masked flash-attn-4 attention (see the
    module docstring). q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] with unit last
    strides; the stack holds at least ``mask.num_keys`` slots."""
    if stack.capacity < mask.num_keys:
        raise ValueError(f"the call's slots end at {mask.num_keys}, past the stack capacity {stack.capacity}")
    return _TreeAttention.apply(q, k, v, stack, layer, layout, mask, float(scale))
