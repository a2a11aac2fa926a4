"""The kernel side of :mod:`dtree.ops.stack_attention.flash4_slot_bounds`: flash-attn-4's
``AttentionMask.apply_mask`` with the per-key path for the marked mask functions. Imported only where
flash-attn-4 is installed (by :func:`~dtree.ops.stack_attention.flash4_slot_bounds.install`).

Every name the traced functions use is a module global: the CuTe DSL re-executes a function's
transformed source in its module's namespace, where a default argument's class imported inside an
enclosing function was not found (session AH's first device run)."""

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import cutlass
from cutlass import Float32, const_expr, cute
from flash_attn.cute import utils
from flash_attn.cute.utils import AuxData
from quack import layout_utils

__all__ = ["BOUNDS_ATTR", "STOCK_APPLY_MASK", "apply_mask", "bounds_mask", "per_score_mask"]

BOUNDS_ATTR = "dtree_slot_bounds"  # on a mask function: "packed" (one word per slot) or "two_tables"
STOCK_APPLY_MASK = None  # flash-attn-4's own apply_mask, set by install() before it puts apply_mask in its place
# in the marked functions' hash: a kernel flash-attn-4 cached on disk (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1)
# under an older form of this file is not loaded for this one
_SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _per_score(kind: str):
    """A new per-score mask function of ``kind``: row ``m`` sees key ``n`` iff ``lo <= m <= last`` of the word
    ``lo + 65536 * last`` ("packed", its one auxiliary tensor), or iff ``slot_row_lo[n] <= m < slot_row_hi[n]``
    ("two_tables", its two)."""
    if kind == "packed":
        @cute.jit
        def stack_call_mask_packed(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            word = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
            return (word % 65536 <= m_idx) & (m_idx <= word // 65536)

        return stack_call_mask_packed
    if kind == "two_tables":
        @cute.jit
        def stack_call_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            row_lo = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
            row_hi = utils.scalar_to_ssa(aux_tensors[1][n_idx[0]], cutlass.Int32)
            return (row_lo <= m_idx) & (m_idx < row_hi)

        return stack_call_mask
    raise ValueError(f"slot bounds kind {kind!r}: 'packed' or 'two_tables'")


@functools.cache
def per_score_mask(kind: str, marked: bool):
    """The mask function of ``kind`` (:func:`_per_score`), built once per ``(kind, marked)`` so its hash (part of
    flash-attn-4's compile key) stays the same. ``marked``: with :data:`BOUNDS_ATTR` (:func:`apply_mask` takes
    the per-key path for it) and a hash of its own, apart from the unmarked function's."""
    fn = _per_score(kind)
    if marked:
        setattr(fn, BOUNDS_ATTR, kind)
        fn.__cute_hash__ = f"dtree-slot-bounds-{kind}-{_SOURCE_HASH}"
    return fn


@cute.jit
def apply_mask(
    self,
    acc_S: cute.Tensor,
    batch_idx: cutlass.Int32,
    head_idx: cutlass.Int32,
    m_block: cutlass.Int32,
    n_block: cutlass.Int32,
    thr_mma: cute.TiledMma,
    mask_seqlen: cutlass.Constexpr[bool],
    mask_causal: cutlass.Constexpr[bool],
    mask_local: cutlass.Constexpr[bool] = False,
    mask_mod: cutlass.Constexpr[Callable | None] = None,
    aux_data: AuxData = AuxData(),  # noqa: B008 (the stock signature's default)
    fastdiv_mods=(None, None),
) -> None:
    """``AttentionMask.apply_mask`` (flash-attn-4 4.0.0b36's signature): the per-key path for a mask
    function marked with :data:`BOUNDS_ATTR`, flash-attn-4's own for every other mask."""
    if const_expr(getattr(mask_mod, BOUNDS_ATTR, None) is not None and not mask_causal and not mask_local):
        bounds_mask(self, acc_S, m_block, n_block, thr_mma, getattr(mask_mod, BOUNDS_ATTR), aux_data)
    else:
        STOCK_APPLY_MASK(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen, mask_causal,
                         mask_local, mask_mod, aux_data, fastdiv_mods)


@cute.jit
def bounds_mask(mask, acc_S: cute.Tensor, m_block: cutlass.Int32, n_block: cutlass.Int32, thr_mma: cute.TiledMma,
                kind: cutlass.Constexpr[str], aux_data: AuxData):
    """The per-key path: each thread reads the bounds of each key it holds once and masks the rows it holds
    outside them (``acc_S`` in logical (query, key) order whether or not the kernel computed the transposed
    scores; with packed GQA, query rows are ``row // heads per KV head``). No wrap of the indices and no check
    against the lengths: the tables are padded past the call's keys, and no ``last`` reaches the rows past it."""
    swap = mask.swap_AB
    acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=swap)
    tile = (mask.tile_m, mask.tile_n)
    cS = cute.make_identity_tensor(tile if not swap else tile[::-1])
    tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS), transpose=swap)
    t0ScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS), transpose=swap)
    ROW = 0 if const_expr(not swap) else 1
    COL = 1 if const_expr(not swap) else 0
    if n_block < 0:  # noqa: PLR1730 (a traced branch, as the stock code has it): rows with no key block
        n_block = 0
    key_start = n_block * mask.tile_n + tScS_mn[0][COL]
    row_start = m_block * mask.tile_m
    per_kv = const_expr(mask.qhead_per_kvhead_packgqa)
    nrow = const_expr(cute.size(tScS_mn.shape[0]))
    ncol = const_expr(cute.size(tScS_mn.shape[1]))
    rows = [None] * nrow
    for r in cutlass.range_constexpr(nrow):
        rows[r] = tScS_mn[r, 0][ROW] + row_start
        if const_expr(per_kv != 1):
            rows[r] = rows[r] // per_kv
    for c in cutlass.range_constexpr(ncol):
        key = key_start + t0ScS_mn[0, c][COL]
        if const_expr(kind == "packed"):
            word = aux_data.tensors[0][key]
            lo = word % 65536
            last = word // 65536
        else:
            lo = aux_data.tensors[0][key]
            last = aux_data.tensors[1][key] - 1
        for r in cutlass.range_constexpr(nrow):
            acc_S_mn[r, c] = acc_S_mn[r, c] if rows[r] >= lo else -Float32.inf
            acc_S_mn[r, c] = acc_S_mn[r, c] if rows[r] <= last else -Float32.inf
