"""Padded batches in and out: the ``[B, L]`` tensors RL trainers hold rollouts in.

Two layouts, each with its inverse:

* **Full rows** (verl's ``input_ids`` / ``attention_mask``, OpenRLHF, AReaL):
  :func:`from_padded` and :func:`to_padded`. A row's real tokens (``attention_mask``
  1) are one contiguous run: a left-padded prompt followed by a right-padded response,
  or all right-padded, or any mix across rows. Fields are ``[B, L]``, aligned with
  ``input_ids``: the value at column ``c`` belongs to the token at column ``c``, i.e.
  to its prediction from the tokens before it (dtree's convention), or ``[B]``, one
  number per row (an advantage per sequence), broadcast to the row's tokens.
* **Prompt + completion** (TRL's ``prompt_ids`` / ``completion_ids``, verl's
  ``prompts`` / ``responses``): :func:`from_prompt_completion` and
  :func:`to_padded_completion`. Each part is its own contiguous run (prompts
  left-padded, completions right-padded); fields are ``[B, R]``, aligned with the
  completion tokens, or ``[B]``.

Row ``b`` becomes sequence ``b`` of the forest; padding never enters it. Values at
padding columns (ids, fields) are never read, so any pad id or NaN there is fine.

Round trip::

    forest = Forest.from_padded(input_ids, attention_mask, loss_mask=response_mask, advantages=adv)
    old_log_probs = to_padded(rt.logprobs(forest), attention_mask)   # [B, L], 0 at padding

Bad input raises ``ValueError`` naming the row and column, before anything runs: a
mask with a hole inside a row, an all-zero row, shapes that disagree, non-integer or
negative ids, a mask that is not 0/1, a non-finite field value where the mask is 1,
a ``loss_mask`` that is non-zero on padding.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..forest.forest import Forest
from ..forest.padding import host_array

__all__ = ["from_padded", "to_padded", "from_prompt_completion", "to_padded_completion"]


# the constructors are Forest's own, under this module's names beside their inverses
from_padded = Forest.from_padded
from_prompt_completion = Forest.from_prompt_completion


def _scatter(
    values: Sequence[Any], columns: list[np.ndarray], shape: tuple[int, int], fill: float, device, tail_only: bool
) -> torch.Tensor:
    """[B, L] tensor of ``fill``, with the last columns of ``columns[r]`` set to the last
    values of ``values[r]`` (both end at the sequence's last token). ``index_put`` keeps
    it differentiable w.r.t. the values."""
    if isinstance(values, torch.Tensor) and values.ndim == 2:
        raise ValueError(f"values must be a list of per-sequence 1-D tensors, got a {tuple(values.shape)} tensor")
    if len(values) != shape[0]:
        raise ValueError(f"got {len(values)} value tensors for {shape[0]} rows")
    parts, rows, cols = [], [], []
    dtype = None
    for r, v in enumerate(values):
        v = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v, dtype=np.float32))
        if v.ndim != 1:
            raise ValueError(f"values[{r}] must be 1-D, got shape {tuple(v.shape)}")
        n = columns[r].size
        if tail_only:  # any length that covers the tail: the row's columns are its sequence's last tokens
            ok, expected = v.shape[0] >= n - 1, f"at least {n - 1}"
        else:
            ok, expected = v.shape[0] in (n, n - 1), f"{n} (token-aligned) or {n - 1} (prediction-aligned)"
        if not ok:
            raise ValueError(f"values[{r}] has {v.shape[0]} entries but row {r} has {n} tokens: expected {expected}")
        take = min(v.shape[0], n)
        parts.append(v[v.shape[0] - take :])
        cols.append(columns[r][n - take :])
        rows.append(np.full(take, r))
        dtype = dtype or (v.dtype if v.dtype.is_floating_point else torch.float32)
    out = torch.full(shape, fill, dtype=dtype or torch.float32, device=device)
    if parts:
        flat = torch.cat([p.to(device=device, dtype=out.dtype) for p in parts])
        r_idx = torch.as_tensor(np.concatenate(rows), device=device)
        c_idx = torch.as_tensor(np.concatenate(cols), device=device)
        out = out.index_put((r_idx, c_idx), flat)
    return out


def _device_of(*xs: Any):
    for x in xs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def to_padded(values: Sequence[Any], like: Any, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-sequence, token-aligned results back into the padded layout.

    Args:
        values: one 1-D tensor per row (sequence), either token-aligned (``len`` values,
            one per real token) or prediction-aligned (``len - 1`` values, as
            ``TreeRuntime.logprobs`` returns: the row's first real column gets ``fill``).
        like: [B, L] the ``attention_mask`` the forest was built from.
        fill: value at padding columns (and at the first real column of
            prediction-aligned values).

    Returns:
        [B, L] tensor on ``like``'s device (CPU for an array), dtype of ``values``
        (float32 for integer values); differentiable w.r.t. ``values``.
    """
    mask = host_array("like", like)
    if mask.ndim != 2:
        raise ValueError(f"like must be the 2-D [batch, length] attention_mask, got shape {tuple(mask.shape)}")
    columns = [np.flatnonzero(row) for row in mask != 0]
    return _scatter(values, columns, mask.shape, fill, _device_of(like, *values[:1]), tail_only=False)


def to_padded_completion(values: Sequence[Any], completion_mask: Any, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-sequence results back into the completion layout ``[B, R]`` (the
    inverse of :func:`from_prompt_completion`, e.g. TRL's ``old_per_token_logps``).

    Args:
        values: one 1-D tensor per row over its whole sequence (prompt + completion),
            token-aligned (``len``) or prediction-aligned (``len - 1``). Both end at the
            sequence's last token, so each row's last ``completion_mask[b].sum()`` values
            are its completion's.
        completion_mask: [B, R] the completion mask the forest was built from.
        fill: value at padding columns.

    Returns:
        [B, R] tensor (see :func:`to_padded`).
    """
    mask = host_array("completion_mask", completion_mask)
    if mask.ndim != 2:
        raise ValueError(f"completion_mask must be 2-D [batch, completion length], got shape {tuple(mask.shape)}")
    columns = [np.flatnonzero(row) for row in mask != 0]
    return _scatter(values, columns, mask.shape, fill, _device_of(completion_mask, *values[:1]), tail_only=True)
