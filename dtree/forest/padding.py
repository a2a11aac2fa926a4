"""The rows of padded ``[B, L]`` batches as sequences and fields, checked: what
:meth:`dtree.Forest.from_padded` and :mod:`dtree.integrations.padded` build forests
from (the layouts and the checks are described there).

Bad input raises ``ValueError`` naming the row and column: a mask with a hole inside
a row, an all-zero row, shapes that disagree, non-integer or negative ids, a mask that
is not 0/1, a non-finite field value where the mask is 1, a ``loss_mask`` that is
non-zero on padding.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["Rows", "host_array", "padded_rows", "prompt_completion_rows"]

# (sequences, fields): one int64 array per row, and per field one array per row
Rows = tuple[list[np.ndarray], dict[str, list[np.ndarray]]]


def host_array(name: str, x: Any) -> np.ndarray:
    """A tensor, array or nested list as a host numpy array (bfloat16 widened to float32)."""
    if isinstance(x, Mapping):
        hint = f": pass encoding[{name!r}]" if name in x else ""
        raise TypeError(f"{name} is a {type(x).__name__}, not a tensor or an array{hint}")
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype.is_floating_point and x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        return x.cpu().numpy()
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a tensor or an array, got {type(x).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy's own complaint precedes ours
            return np.asarray(x)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a tensor or a rectangular array, got a ragged {type(x).__name__}") from None


def _ids(name: str, x: Any) -> np.ndarray:
    arr = host_array(name, x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [batch, length], got shape {tuple(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        hint = "; dtree trains on token ids: tokenize first" if arr.dtype.kind in "USO" else ""
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}{hint}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        r, c = (int(v) for v in np.argwhere(arr > np.iinfo(np.int64).max)[0])
        raise ValueError(f"{name} has a token id {int(arr[r, c])} at row {r}, column {c} that does not fit in int64")
    return arr.astype(np.int64, copy=False)


def _mask(name: str, x: Any, shape: tuple[int, ...], like: str) -> np.ndarray:
    """A 0/1 mask of ``shape`` as bool."""
    arr = host_array(name, x)
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
    arr = host_array(name, value)
    if arr.dtype.kind not in "biuf":  # strings, objects (ragged, huge ints), complex
        raise ValueError(f"field {name!r} must hold real numbers, got dtype {arr.dtype}")
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


def padded_rows(input_ids: Any, attention_mask: Any, loss_mask: Any = None, **fields: Any) -> Rows:
    """The sequences and fields of a padded ``[B, L]`` batch; row ``b`` is sequence ``b``.
    Arguments as :meth:`dtree.Forest.from_padded`.

    Returns:
        ``(sequences, fields)``: the rows' real tokens in row order, and per field one
        array per row (``Forest.from_sequences(sequences, **fields)`` takes them).
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
    sequences = [ids[r, cols] for r, cols in enumerate(runs)]
    return sequences, {name: [arr[r, cols] for r, cols in enumerate(runs)] for name, arr in per_token.items()}


def prompt_completion_rows(
    prompt_ids: Any,
    prompt_mask: Any,
    completion_ids: Any,
    completion_mask: Any,
    *,
    loss_mask: Any = None,
    **completion_fields: Any,
) -> Rows:
    """The sequences and fields of separate prompt and completion tensors (TRL's
    layout), as :func:`padded_rows` returns them; row ``b`` is sequence ``b``: its
    prompt tokens, then its completion tokens. Arguments as
    :meth:`dtree.Forest.from_prompt_completion`."""
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
        host = host_array(name, value)
        arr = _field(name, host, c_real, "completion_ids")
        # a per-row number covers the prompt tokens too; a per-token field has no value there
        fields[name] = whole(arr, host.astype(np.float64) if host.ndim == 1 else np.zeros(batch))
    seqs = [np.concatenate([p_ids[r, p_runs[r]], c_ids[r, c_runs[r]]]) for r in range(len(p_runs))]
    return seqs, fields
