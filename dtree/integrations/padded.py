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

from ..tree import Forest

__all__ = ["from_padded", "to_padded", "from_prompt_completion", "to_padded_completion"]


def _host(name: str, x: Any) -> np.ndarray:
    """A tensor, array or nested list as a host numpy array (bfloat16 widened to float32)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype.is_floating_point and x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        return x.cpu().numpy()
    try:
        return np.asarray(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a tensor or an array, got {type(x).__name__}") from None


def _ids(name: str, x: Any) -> np.ndarray:
    arr = _host(name, x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [batch, length], got shape {tuple(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _mask(name: str, x: Any, shape: tuple[int, ...], like: str) -> np.ndarray:
    """A 0/1 mask of ``shape`` as bool."""
    arr = _host(name, x)
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {tuple(arr.shape)} but {like} has shape {shape}")
    bad = np.argwhere((arr != 0) & (arr != 1))
    if bad.size:
        r, c = (int(v) for v in bad[0])
        raise ValueError(f"{name} must hold 0 or 1, got {arr[r, c]} at row {r}, column {c}")
    return arr != 0


def _runs(name: str, mask: np.ndarray, allow_empty: bool) -> list[np.ndarray]:
    """Per row, the columns where ``mask`` is set; they must be one contiguous run."""
    runs = []
    for r in range(mask.shape[0]):
        cols = np.flatnonzero(mask[r])
        if cols.size == 0 and not allow_empty:
            raise ValueError(f"row {r} of {name} is all zeros: a row needs at least one real token (drop the row)")
        if cols.size and cols[-1] - cols[0] + 1 != cols.size:
            hole = int(cols[0] + np.flatnonzero(np.diff(cols) > 1)[0] + 1)
            raise ValueError(
                f"{name} has a hole at row {r}, column {hole}: a row's real tokens must be one contiguous run "
                "(padding only on the left and/or right)"
            )
        runs.append(cols)
    return runs


def _check_ids(name: str, ids: np.ndarray, mask: np.ndarray) -> None:
    bad = np.argwhere(mask & (ids < 0))
    if bad.size:
        r, c = (int(v) for v in bad[0])
        raise ValueError(f"{name} has a negative token id {int(ids[r, c])} at row {r}, column {c}")


def _field(name: str, value: Any, mask: np.ndarray, like: str) -> np.ndarray:
    """A field as float64 ``[B, L]`` (``[B]`` broadcast over columns), finite where ``mask``."""
    arr = _host(name, value)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"field {name!r} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    batch, length = mask.shape
    if arr.ndim == 1 and arr.shape[0] == batch:  # one number per row, for every token of the row
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise ValueError(f"field {name!r} is {arr[bad[0]]} at row {int(bad[0])} (must be finite)")
        arr = np.repeat(arr[:, None], length, axis=1)
    elif arr.shape != mask.shape:
        raise ValueError(
            f"field {name!r} has shape {tuple(arr.shape)}; expected {tuple(mask.shape)} (like {like}) "
            f"or [{batch}] (one number per row)"
        )
    bad = np.argwhere(mask & ~np.isfinite(arr))
    if bad.size:
        r, c = (int(v) for v in bad[0])
        raise ValueError(f"field {name!r} is {arr[r, c]} at row {r}, column {c}, where the mask is 1 (must be finite)")
    return arr


def _check_loss_mask(loss_mask: np.ndarray, real: np.ndarray, where: str) -> None:
    bad = np.argwhere((loss_mask != 0) & ~real)
    if bad.size:
        r, c = (int(v) for v in bad[0])
        raise ValueError(
            f"loss_mask is {loss_mask[r, c]} at row {r}, column {c}, where {where} is 0 (padding): "
            f"multiply it by {where}"
        )


def from_padded(input_ids: Any, attention_mask: Any, loss_mask: Any = None, **fields: Any) -> Forest:
    """A forest from a padded ``[B, L]`` batch; row ``b`` is sequence ``b``.

    Args:
        input_ids: [B, L] integer token ids.
        attention_mask: [B, L] 0/1; each row's ones are one contiguous run (left and/or
            right padding), with at least one token.
        loss_mask: [B, L] weights aligned with ``input_ids`` (e.g. verl's response mask
            placed at the response columns); 0 wherever ``attention_mask`` is 0. Default:
            every token counts (dtree never counts a sequence's first token).
        **fields: each [B, L] aligned with ``input_ids`` (the value at column ``c`` belongs
            to the prediction of the token at column ``c``), or [B], one number per row.

    Returns:
        A :class:`Forest` over the rows' real tokens, in row order.
    """
    ids = _ids("input_ids", input_ids)
    real = _mask("attention_mask", attention_mask, ids.shape, "input_ids")
    runs = _runs("attention_mask", real, allow_empty=False)
    _check_ids("input_ids", ids, real)
    per_token = {}
    if loss_mask is not None:
        lm = _field("loss_mask", loss_mask, real, "input_ids")
        _check_loss_mask(lm, real, "attention_mask")
        per_token["loss_mask"] = lm
    for name, value in fields.items():
        if value is not None:
            per_token[name] = _field(name, value, real, "input_ids")
    return Forest.from_sequences(
        [ids[r, cols] for r, cols in enumerate(runs)],
        **{name: [arr[r, cols] for r, cols in enumerate(runs)] for name, arr in per_token.items()},
    )


def from_prompt_completion(
    prompt_ids: Any,
    prompt_mask: Any,
    completion_ids: Any,
    completion_mask: Any,
    *,
    loss_mask: Any = None,
    **completion_fields: Any,
) -> Forest:
    """A forest from separate prompt and completion tensors (TRL's layout); row ``b``
    is sequence ``b``: its prompt tokens, then its completion tokens.

    Args:
        prompt_ids, prompt_mask: [B, P]; the prompt's real tokens are one contiguous run
            (TRL left-pads them). May be empty for a row whose completion is not.
        completion_ids, completion_mask: [B, R]; one contiguous run (right-padded). A
            row may have no completion token (TRL's ``mask_truncated_completions`` zeroes
            a whole row): the sequence is then its prompt, with no loss token, and still
            counts as a sequence (``Normalization.num_sequences``).
        loss_mask: [B, R] aligned with the completion, 0 where ``completion_mask`` is 0
            (TRL: ``completion_mask * tool_mask``). Default: ``completion_mask``. Prompt
            tokens never count.
        **completion_fields: each [B, R] aligned with the completion tokens
            (``advantages``, ``old_logprobs``, ...; 0 is put on the prompt tokens), or
            [B], one number per row, broadcast to the whole sequence.
    """
    p_ids = _ids("prompt_ids", prompt_ids)
    c_ids = _ids("completion_ids", completion_ids)
    if c_ids.shape[0] != p_ids.shape[0]:
        raise ValueError(
            f"completion_ids has {c_ids.shape[0]} rows but prompt_ids has {p_ids.shape[0]}: "
            "one completion per prompt row"
        )
    p_real = _mask("prompt_mask", prompt_mask, p_ids.shape, "prompt_ids")
    c_real = _mask("completion_mask", completion_mask, c_ids.shape, "completion_ids")
    p_runs = _runs("prompt_mask", p_real, allow_empty=True)
    c_runs = _runs("completion_mask", c_real, allow_empty=True)
    empty = [r for r in range(p_ids.shape[0]) if p_runs[r].size + c_runs[r].size == 0]
    if empty:
        raise ValueError(
            f"row {empty[0]} has no token: prompt_mask and completion_mask are both all zeros there (drop the row)"
        )
    _check_ids("prompt_ids", p_ids, p_real)
    _check_ids("completion_ids", c_ids, c_real)
    lm = (
        c_real.astype(np.float64)
        if loss_mask is None
        else _field("loss_mask", loss_mask, c_real, "completion_ids")
    )
    _check_loss_mask(lm, c_real, "completion_mask")

    def whole(arr: np.ndarray, prompt_values: np.ndarray) -> list[np.ndarray]:
        """Per row: ``prompt_values[r]`` on the prompt tokens, then ``arr``'s completion values."""
        return [
            np.concatenate([np.full(p.size, prompt_values[r]), arr[r, c]])
            for r, (p, c) in enumerate(zip(p_runs, c_runs))
        ]

    batch = p_ids.shape[0]
    fields: dict[str, list[np.ndarray]] = {"loss_mask": whole(lm, np.zeros(batch))}
    for name, value in completion_fields.items():
        if value is None:
            continue
        host = _host(name, value)
        arr = _field(name, host, c_real, "completion_ids")
        # a per-row number covers the prompt tokens too; a per-token field has no value there
        fields[name] = whole(arr, host.astype(np.float64) if host.ndim == 1 else np.zeros(batch))
    seqs = [np.concatenate([p_ids[r, p_runs[r]], c_ids[r, c_runs[r]]]) for r in range(len(p_runs))]
    return Forest.from_sequences(seqs, **fields)


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
    mask = _host("like", like)
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
    mask = _host("completion_mask", completion_mask)
    if mask.ndim != 2:
        raise ValueError(f"completion_mask must be 2-D [batch, completion length], got shape {tuple(mask.shape)}")
    columns = [np.flatnonzero(row) for row in mask != 0]
    return _scatter(values, columns, mask.shape, fill, _device_of(completion_mask, *values[:1]), tail_only=True)
