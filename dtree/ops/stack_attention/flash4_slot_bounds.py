"""The masked call's partial tiles masked from each key's row bounds, read once per key and thread
(:mod:`dtree.ops.stack_attention.flash4_masked_call`).

flash-attn-4 masks a partially visible tile by calling the mask function once per score. For the
call's mask (row ``m`` sees slot ``n`` iff ``lo[n] <= m <= last[n]``) that is one or two table loads
per score, and on Hopper's backward every score also wraps both indices into the sequence lengths
(two fast divisions) and checks them against the bounds: a partial tile cost 2.3-3.5x a full one in
the backward, and evaluating the mask was 12% of the backward with the packed table (session AG,
``benchmarks/mask_tile_cost.py``; 23% with two tables). A thread holds scores of few distinct keys
(two per tile in Hopper's backward, which computes the transposed scores), so this module reads each
key's bounds once per thread and tile, and compares every row it holds with them: no wrap, no bound
check. The tables are padded past the last key tile with bounds no row is in
(:func:`~dtree.ops.stack_attention.call_mask.kernel_tables`), so the keys past the call and the rows
past it (every ``last`` is below the call's rows) come out masked, as the bound checks had them.

How: :func:`install` replaces ``flash_attn.cute.mask.AttentionMask.apply_mask`` (what Hopper's and
Ampere's kernels call on each partial tile) with a function that takes this path for the mask
functions :func:`slot_bounds_mask` makes (marked with ``dtree_slot_bounds``) and calls the original for
every other mask. The marked functions are also plain mask functions with the same result: on a
kernel that does not call ``apply_mask`` (Blackwell's), or with the patch not installed, flash-attn-4
evaluates them per score. The reference is flash-attn-4's own evaluation of the unmarked functions
(``flash4_masked_call._mask_function``, ``_packed_mask_function``); the GPU tests compare the two.
Installed only on the flash-attn-4 versions it was checked on (:data:`CHECKED_VERSIONS`); the
environment variable ``DTREE_FLASH4_SLOT_BOUNDS=0`` keeps flash-attn-4's own evaluation.
"""

import functools
import os

__all__ = ["CHECKED_VERSIONS", "install", "slot_bounds_mask"]

CHECKED_VERSIONS = ("4.0.0b36",)
_ENV = "DTREE_FLASH4_SLOT_BOUNDS"


def slot_bounds_mask(kind: str):
    """The mask function for ``kind`` ("packed": the one table ``lo + 65536 * last``; "two_tables":
    ``slot_row_lo``, ``slot_row_hi`` with ``lo <= m < hi``), marked for :func:`install`'s path and
    hashed apart from the unmarked ones (flash-attn-4 keys its compiled kernels on the hash)."""
    from .flash4_slot_bounds_kernel import per_score_mask

    return per_score_mask(kind, marked=True)


@functools.cache
def install() -> bool:
    """Whether the per-key path is in place (installed now if flash-attn-4 is a checked version and
    ``DTREE_FLASH4_SLOT_BOUNDS`` is not 0). Call it before the first kernel with a marked mask compiles."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get(_ENV, "1") == "0":
        return False
    try:
        if version("flash-attn-4") not in CHECKED_VERSIONS:
            return False
    except PackageNotFoundError:
        return False
    from flash_attn.cute import mask as fa_mask

    from . import flash4_slot_bounds_kernel as kernel

    cls = fa_mask.AttentionMask
    if cls.apply_mask is not kernel.apply_mask:
        kernel.STOCK_APPLY_MASK = cls.apply_mask
        cls.apply_mask = kernel.apply_mask
    return True
