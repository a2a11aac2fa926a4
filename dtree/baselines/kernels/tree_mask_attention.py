"""Attention under a tree mask: prefix trees packed into one row in depth-first order.

This is the tree-mask baseline's op (AReaL's "sparse" mode, the Tree Training paper's
Tree Packing). Every row is one token of a trie; it attends to its ancestors and to
itself. In depth-first order the descendants of row ``j`` (itself included) are the
contiguous rows ``[j, subtree_end[j])``, so the whole mask is one interval test:

    query i may read key j   <=>   j <= i < subtree_end[j]

Several trees packed side by side need no tree id: each ``subtree_end`` stays inside
its own tree, so rows of different trees never see each other. Position ids (depths)
are the caller's business.

Backends, all with the signature of :func:`tree_mask_attention`:

* ``sdpa``: a dense ``[N, N]`` boolean mask through ``scaled_dot_product_attention``.
  O(N^2) memory (1 GiB at N = 32k): for small rows, and the CPU path.
* ``flex``: FlexAttention with a ``BlockMask`` computed straight from the intervals in
  O((N/128)^2); no ``N x N`` tensor is ever built (``create_block_mask`` would evaluate
  the mask on the full grid unless compiled). The mask is still evaluated exactly,
  inside the kernel, on the blocks that are only partly visible. On CUDA the function
  is ``torch.compile``-d once per process (as the FlexAttention docs recommend) and
  never runs uncompiled: dynamo falls back to eager code once a function has been compiled
  for ``recompile_limit`` input configurations, which for FlexAttention means the full
  ``[N, N]`` score matrix (106 GiB at N = 32k, session AK's GPU tests), so the calls
  raise that limit for themselves and fail with :class:`FlexRecompileLimitError` past it
  (:func:`compiled_call`). On the CPU it runs eagerly, forward only (torch has no CPU
  FlexAttention backward): tests use it to check the mask.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from ...device.transfer import upload
from ...ops.backends import Backends, Target
from ...ops.stack_attention.options import check_packed_qkv

__all__ = [
    "BACKENDS",
    "FLEX_RECOMPILE_LIMIT",
    "FlexRecompileLimitError",
    "TreeMaskLayout",
    "compiled_call",
    "flex_unavailable",
    "tree_mask_attention",
    "tree_mask_attention_flex",
    "tree_mask_attention_sdpa",
]

BLOCK_SIZE = 128  # FlexAttention's default tile


class TreeMaskLayout:
    """The tree mask of one packed row (host side, plus masks cached per device).

    Args:
        subtree_end: [N] row ``j``'s subtree is rows ``[j, subtree_end[j])``, so
            ``j < subtree_end[j] <= N``.
    """

    def __init__(self, subtree_end) -> None:
        end = np.asarray(subtree_end, dtype=np.int64)
        if end.ndim != 1 or end.size == 0:
            raise ValueError(f"subtree_end must be a non-empty 1-D array, got shape {end.shape}")
        n = end.size
        bad = np.flatnonzero((end <= np.arange(n)) | (end > n))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"subtree_end[{j}] = {int(end[j])} must be in ({j}, {n}]: a row's subtree holds itself")
        self.subtree_end = end
        self._cache: dict = {}

    @property
    def num_tokens(self) -> int:
        return self.subtree_end.size

    def device_ends(self, device: torch.device) -> torch.Tensor:
        """[N] int64 ``subtree_end`` on ``device``, copied once (asynchronously) and cached."""
        key = ("ends", device)
        if key not in self._cache:
            self._cache[key] = upload(self.subtree_end, device)
        return self._cache[key]

    def dense_mask(self, device: torch.device) -> torch.Tensor:
        """[N, N] bool, ``mask[i, j]`` = query ``i`` may read key ``j``. O(N^2) memory."""
        key = ("dense", device)
        if key not in self._cache:
            end = self.device_ends(device)
            rows = torch.arange(self.num_tokens, device=device)
            self._cache[key] = (rows[None, :] <= rows[:, None]) & (rows[:, None] < end[None, :])
        return self._cache[key]

    def block_mask(self, device: torch.device, block_size: int = BLOCK_SIZE):
        """FlexAttention ``BlockMask`` of the tree mask, built in O((N/block)^2).

        For query block ``r`` (rows ``[rB, rB+B)``) and key block ``c``:

        * ``c > r``: empty (keys after every query);
        * ``c == r``: partial (each row sees itself, not the rows after it);
        * ``c < r``: every key precedes every query, so the block is
          non-empty iff some key's subtree reaches the block (``max end > rB``) and
          full iff every key's subtree covers it (``min end >= rB + B``).

        Partial blocks run ``mask_mod`` (the interval test) per element in the kernel.
        A query block cut short by the end of the row is never full, as with
        ``create_block_mask``, which is how the tests check this construction.
        """
        key = ("block", device, block_size)
        if key not in self._cache:
            self._cache[key] = _interval_block_mask(self.device_ends(device), block_size)
        return self._cache[key]


def _kv_blocks(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, nb] bool -> (counts [1, 1, nb] int32, indices [1, 1, nb, nb] int32 with each
    row's visible key blocks first, ascending), the layout BlockMask stores."""
    counts = visible.sum(-1, dtype=torch.int32)
    order = torch.argsort((~visible).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def _interval_block_mask(end: torch.Tensor, block: int):
    from torch.nn.attention.flex_attention import BlockMask

    n = end.numel()
    nb = -(-n // block)
    # padded keys get end 0, so they never raise a block's maximum; the minimum is only
    # read for key blocks before the last one, which have no padding
    blocks = F.pad(end, (0, nb * block - n)).view(nb, block)
    max_end, min_end = blocks.amax(1), blocks.amin(1)
    r = torch.arange(nb, device=end.device)[:, None]
    c = r.T
    before = c < r
    nonempty = (c == r) | (before & (max_end[None, :] > r * block))
    full = before & (min_end[None, :] >= (r + 1) * block)
    partial_num, partial_idx = _kv_blocks(nonempty & ~full)
    full_num, full_idx = _kv_blocks(full)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    return BlockMask.from_kv_blocks(
        partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(n, n)
    )


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeMaskLayout) -> None:
    check_packed_qkv(q, k, v, layout.num_tokens, "the tree mask")


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [N, H, D] -> [1, H, N, D]


def tree_mask_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeMaskLayout, scale: float
) -> torch.Tensor:
    """Tree-mask attention through SDPA with the dense boolean mask.

    Args:
        q: [N, Hq, D] rows in depth-first order; k, v: [N, Hkv, D].
        layout: the row's subtree ends.
        scale: softmax scale.

    Returns:
        [N, Hq, D]; row ``i`` attends to its ancestors and itself.
    """
    _check(q, k, v, layout)
    mask = layout.dense_mask(q.device)
    out = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(0).transpose(0, 1)  # a view back (a select's backward zero-fills and copies)


# Input configurations (head dims, GQA, dtypes, dynamic lengths) the compiled FlexAttention
# may be compiled for in one process, against dynamo's default of 8: a process that benchmarks
# several models or runs the GPU tests meets more than 8.
FLEX_RECOMPILE_LIMIT = 64


class FlexRecompileLimitError(RuntimeError):
    """The compiled FlexAttention met more input configurations than its recompile limit;
    dynamo would run the next one uncompiled, on the full score matrix."""


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def compiled_call(fn, *args, limit: int = FLEX_RECOMPILE_LIMIT, **kwargs):
    """``fn(*args, **kwargs)`` for a ``torch.compile``-d ``fn`` that must not run eagerly:
    dynamo's recompile limit raised to ``limit`` for the call (never lowered), and a
    :class:`FlexRecompileLimitError` naming the way out where dynamo would fall back to
    eager code past it. Inside an outer ``torch.compile`` the call is left to it."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.exc import FailOnRecompileLimitHit

    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    limit = max(limit, dynamo_config.recompile_limit)
    with dynamo_config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        try:
            return fn(*args, **kwargs)
        except FailOnRecompileLimitHit as e:
            raise FlexRecompileLimitError(
                f"FlexAttention has been compiled for {limit} input configurations in this process (head dims, "
                "dtypes, GQA, lengths: torch._dynamo's recompile limit); dynamo would run the next one uncompiled, "
                "which for FlexAttention builds the full [N, N] score matrix. Call torch._dynamo.reset() between "
                "models or configurations, or raise torch._dynamo.config.recompile_limit."
            ) from e


def tree_mask_attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeMaskLayout, scale: float
) -> torch.Tensor:
    """Tree-mask attention through FlexAttention and the interval ``BlockMask``; shapes
    as :func:`tree_mask_attention_sdpa`. Peak memory O(N) plus O((N/128)^2) ints."""
    _check(q, k, v, layout)
    args = (_heads_first(q), _heads_first(k), _heads_first(v))
    kwargs = {"block_mask": layout.block_mask(q.device), "scale": scale, "enable_gqa": q.shape[1] != k.shape[1]}
    if q.device.type == "cuda":
        out = compiled_call(_compiled_flex(), *args, **kwargs)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(*args, **kwargs)
    return out.squeeze(0).transpose(0, 1)  # a view back (a select's backward zero-fills and copies)


def flex_unavailable(target: Target) -> str | None:
    """Why the ``flex`` backend cannot train on ``target`` (None: it can)."""
    if target.device.type == "cuda":
        return None
    return f"trains on CUDA only (no FlexAttention backward on {target.device}); use 'sdpa'"


BACKENDS = Backends(
    "tree-mask attention",
    {"sdpa": tree_mask_attention_sdpa, "flex": tree_mask_attention_flex},
    {"other": ("flex", "sdpa")},
    unavailable={"flex": flex_unavailable},
)


def tree_mask_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeMaskLayout, scale: float, backend: str = "sdpa"
) -> torch.Tensor:
    """Dispatch to a backend of :data:`BACKENDS` by name."""
    return BACKENDS.function(backend)(q, k, v, layout, scale)
