"""The one-call path's kernel on Hopper (:mod:`dtree.ops.stack_attention.masked_call`):
flash-attn-4's forward and backward over stack slots ``[0, base + T)`` under the call's tree
mask (:mod:`dtree.ops.stack_attention.call_mask`): block sparsity skips the tiles no row sees
and runs the fully visible ones unmasked; the rest are masked from two tables in the forward and from
one packed table in the backward (:func:`~.call_mask.packed_bounds`), each key's bounds read once per
thread and tile (:mod:`.flash4_slot_bounds`; flash-attn-4's own evaluation, once per score, where that
is not installed). One
forward and one backward kernel per layer and call, where the region path
(:mod:`dtree.ops.stack_attention.regions`) runs one pair per prefix level plus a log-sum-exp
merge, per-level dq adds and fills (5 to 13 levels on 64k agentic calls).

flash-attn-4 (4.0.0b36) takes block sparsity and a mask function on Hopper, forward and
backward, for fixed-length batches (no varlen); its kernels compile once per model (lengths
are runtime values). After the first call of a shape and mask, later calls (a model
call's other layers) launch the recorded kernels directly (:mod:`.flash4_launch_replay`).
Not deterministic (its dQ and GQA dK/dV accumulate with atomics):
deterministic calls take the region path.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...device.transfer import upload
from .call_mask import BLOCK, BlockLists, CallMask, kernel_tables
from .flash4_launch_replay import Flash4LaunchReplay, tensor_key
from .flash4_slot_bounds import install, slot_bounds_mask
from .segment_layout import SegmentLayout

__all__ = ["FLASH4_MASKED_CALL", "device_tables"]


def _mask_function():
    """The forward's mask as flash-attn-4 evaluates it itself, once per score: row ``m`` sees key ``n`` iff
    ``slot_row_lo[n] <= m < slot_row_hi[n]`` (its two auxiliary tensors). The reference of the per-key path
    (:mod:`.flash4_slot_bounds`), and what runs where that is not installed."""
    from .flash4_slot_bounds_kernel import per_score_mask

    return per_score_mask("two_tables", marked=False)


def _packed_mask_function():
    """The backward's mask as flash-attn-4 evaluates it itself: row ``m`` sees key ``n`` iff ``lo <= m <= last``
    for the word ``lo + 65536 * last`` of its one auxiliary tensor (:func:`~.call_mask.packed_bounds`; the same
    mask as :func:`_mask_function`'s, 9-14% faster than it in the Hopper backward on agentic calls evaluated per
    score, not faster in the forward). The reference of the per-key path, as :func:`_mask_function`."""
    from .flash4_slot_bounds_kernel import per_score_mask

    return per_score_mask("packed", marked=False)


def device_tables(mask: CallMask, layout: SegmentLayout, device: torch.device) -> dict:
    """The mask tables (:func:`~.call_mask.kernel_tables`) and both block-sparsity structures on ``device``
    (one upload, each part 16-byte aligned; cached on the layout): ``aux`` and ``fwd_mask`` the forward's two
    tables and their mask function, ``bwd_aux`` and ``bwd_mask`` the backward's (the packed table and its
    function when the call has at most ``PACKED_MAX_ROWS`` rows, else the forward's)."""

    def build():
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        lists = (mask.by_row_tile, mask.by_slot_tile)
        lo, hi, packed = kernel_tables(mask)
        parts = [lo, hi] + ([] if packed is None else [packed])
        at = len(parts)
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

        two_tables, one_table = mask_functions()
        bwd_aux, bwd_mask = (views[:2], two_tables) if packed is None else (views[2:3], one_table)
        return {"aux": views[:2], "fwd": sparse(lists[0], at), "bwd": sparse(lists[1], at + 4), "bwd_aux": bwd_aux,
                "bwd_mask": bwd_mask, "fwd_mask": two_tables}

    return layout.cached(("flash4_masked_call", device), build)


def mask_functions() -> tuple:
    """(two tables, packed) mask functions the calls run: the per-key path's
    (:func:`~.flash4_slot_bounds.slot_bounds_mask`) where :func:`~.flash4_slot_bounds.install` put it
    in place, else flash-attn-4's per-score evaluation of :func:`_mask_function` and :func:`_packed_mask_function`."""
    if install():
        return slot_bounds_mask("two_tables"), slot_bounds_mask("packed")
    return _mask_function(), _packed_mask_function()


@functools.cache
def _launcher() -> Flash4LaunchReplay:
    from importlib.metadata import PackageNotFoundError, version

    from flash_attn.cute import interface

    try:
        installed = version("flash-attn-4")
    except PackageNotFoundError:
        installed = None
    return Flash4LaunchReplay(interface, installed)


class _Flash4MaskedCall:
    """:class:`dtree.ops.stack_attention.masked_call.MaskedCallKernel` on flash-attn-4: the
    interface's first call of each shape and mask, its launches replayed for the rest
    (:mod:`.flash4_launch_replay`; a model call's layers share them)."""

    def forward(self, q, k, v, mask, layout, scale):
        tables = device_tables(mask, layout, q.device)
        t, hq = q.shape[:2]
        out = torch.empty(1, t, hq, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(1, hq, t, dtype=torch.float32, device=q.device)
        qb, kb, vb = q[None], k[None], v[None]
        launcher = _launcher()

        def call():
            launcher.fi._flash_attn_fwd(
                qb, kb, vb, softmax_scale=scale, causal=False, mask_mod=tables["fwd_mask"], aux_tensors=tables["aux"],
                block_sparse_tensors=tables["fwd"], return_lse=True, out=out, lse=lse,
            )

        key = ("fwd", tensor_key(qb, kb, vb), float(scale), tables["aux"][0].data_ptr())
        launcher.run("fwd", key, (qb, kb, vb, out, lse), tables["aux"][:1], call)
        return out[0], lse[0]

    def backward(self, q, k, v, out, dout, lse, mask, layout, scale):
        tables = device_tables(mask, layout, q.device)
        ins = (q[None], k[None], v[None], out[None], dout[None], lse[None])
        grads = tuple(torch.empty_like(x) for x in ins[:3])
        launcher = _launcher()

        def call():
            launcher.fi._flash_attn_bwd(
                *ins, softmax_scale=scale, causal=False, mask_mod=tables["bwd_mask"], aux_tensors=tables["bwd_aux"],
                block_sparse_tensors=tables["bwd"], dq=grads[0], dk=grads[1], dv=grads[2],
            )

        key = ("bwd", tensor_key(*ins), float(scale), tables["bwd_aux"][0].data_ptr())
        launcher.run("bwd", key, ins + grads, tables["bwd_aux"][:1], call)
        return grads[0][0], grads[1][0], grads[2][0]


FLASH4_MASKED_CALL = _Flash4MaskedCall()
