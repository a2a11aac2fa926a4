"""What a token sequence and a field value may be: the checked conversion of user input
into the host arrays a :class:`~dtree.forest.forest.Forest` holds.

Every constructor (``Forest.from_sequences``, ``with_fields``, ``from_jsonl``, and the
padded layouts of :mod:`dtree.forest.padding`) goes through these functions, so they refuse
the same inputs with the same messages, naming the sequence, the position and the fix,
before anything runs:

* **token ids** are integers in ``[0, 2**63)``: Python ints, numpy integer arrays,
  integer tensors. Refused: bools, floats (``1.0`` too: a float id is a bug upstream,
  usually a tokenizer output cast to float), strings (tokenize first), nested lists,
  dicts and ``BatchEncoding`` objects (pass ``encoding["input_ids"]``), values that do
  not fit int64 (they would wrap around).
* **field values** are real numbers (a bool counts as 0 or 1), finite, stored as
  float64 at their own precision (a float64 tensor keeps every bit; bf16/fp16/fp32 are
  widened exactly). Refused: strings (``"1"`` too), complex numbers, ``None``, values
  too large for float64 (``10**400``), nested lists.
* **field names** are strings other than the reserved :data:`RESERVED_FIELD_NAMES`.

Errors: a ``TypeError`` when the argument itself is of the wrong kind (``sequences``
None, a number, a string, a set, a dict or ``BatchEncoding``; a field name that is not
a string); a ``ValueError`` for everything inside it (an entry or a value), as for any
other bad value of a batch. Shapes (1-D sequences, per-token or per-sequence field entries, lengths) are checked
here too. Vocabulary bounds are the model's: :func:`dtree.engine.checks.validate_forest`.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "RESERVED_FIELD_NAMES",
    "check_field_names",
    "field_array",
    "field_arrays",
    "sequence_entries",
    "token_array",
]

INT64_MAX = int(np.iinfo(np.int64).max)

# field names that would collide with an argument of Forest's constructors, or with the
# token ids' key in a JSONL line (Forest.to_jsonl would overwrite the tokens)
RESERVED_FIELD_NAMES = {
    "sequences": "the token sequences' argument of Forest.from_sequences",
    "cls": "a parameter name of Forest's constructors",
    "self": "a parameter name of Forest.with_fields",
    "tokens": "the key of the token ids in a JSONL line",
}

# element types numpy converts exactly and without a question: lists of them skip the
# per-element scan (a token list of Python ints, a field list of floats)
_PLAIN_INTS = {int, np.int64, np.int32, np.int16, np.int8}
_PLAIN_REALS = {float, int, bool, np.float64, np.float32, np.float16, np.int64, np.int32, np.bool_}

TOKENIZE_HINT = "dtree trains on token ids: tokenize first, e.g. tokenizer(texts)['input_ids']"


def _describe(x: Any) -> str:
    """A short description of ``x`` for an error message (never a deep repr)."""
    if isinstance(x, (list, tuple, dict, set)) or isinstance(x, Mapping):
        return f"a {type(x).__name__}"
    if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim > 0:
        return f"a {type(x).__name__} of shape {tuple(x.shape)}"
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > 10**30:
        digits = len(str(abs(x)))
        return f"an integer of {digits} digits ({str(x)[:6]}...)"
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _mapping_error(x: Mapping, what: str, error: type[Exception] = TypeError) -> Exception:
    """The error for a dict (a tokenizer's ``BatchEncoding`` is one) where sequences go."""
    if "input_ids" in x:
        return error(
            f"{what} is a {type(x).__name__} (a tokenizer's output?): pass its token ids, "
            "Forest.from_sequences(encoding['input_ids']), or for a padded batch "
            "Forest.from_padded(encoding['input_ids'], encoding['attention_mask'])"
        )
    return error(f"{what} is a {type(x).__name__}: pass a list of token-id sequences (lists, 1-D integer arrays "
                 "or tensors)")


# ----------------------------------------------------------------------------- sequences
def sequence_entries(sequences: Any) -> list:
    """The entries of ``Forest.from_sequences``' argument, one per sequence, as a list."""
    if isinstance(sequences, Mapping):
        raise _mapping_error(sequences, "sequences")
    if isinstance(sequences, (str, bytes)):
        raise TypeError(f"sequences is a string, not a list of token-id sequences; {TOKENIZE_HINT}")
    if isinstance(sequences, (torch.Tensor, np.ndarray)):
        if sequences.ndim == 2:  # a padded batch is the usual mistake
            raise ValueError(
                f"sequences is a [B, L] tensor (shape {tuple(sequences.shape)}): a padded batch would make its pads "
                "tokens. Use Forest.from_padded(input_ids, attention_mask), or list(tensor) if every row is a "
                "whole sequence without padding"
            )
        if sequences.ndim != 1 or sequences.dtype != object:
            raise ValueError(
                f"sequences is one array of shape {tuple(sequences.shape)}: pass a list of sequences, "
                "[ids] for a single sequence"
            )
    if isinstance(sequences, (set, frozenset)):
        raise TypeError("sequences is a set (no order): pass a list, so fields and results line up with it")
    try:
        entries = list(sequences)
    except TypeError:
        raise TypeError(
            f"sequences must be a list of token-id sequences (lists, 1-D integer arrays or tensors), got "
            f"{_describe(sequences)} ({type(sequences).__name__})"
        ) from None
    if not entries:
        raise ValueError("sequences is empty: a forest needs at least one sequence")
    return entries


def _token_problem(x: Any, where: str, t: int) -> Exception | None:
    """Why ``x``, at position ``t`` of sequence ``where``, is not a token id (None: it is)."""
    at = f"{where}, position {t}"
    if isinstance(x, (bool, np.bool_)):
        return ValueError(f"{at} is the bool {x}, not a token id (bools are refused: pass integer ids)")
    if isinstance(x, (int, np.integer)):
        return None
    if isinstance(x, torch.Tensor) and x.ndim == 0:
        if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            return ValueError(f"{at} is a {x.dtype} tensor; token ids must be integers")
        return None
    if isinstance(x, (float, np.floating)):
        return ValueError(
            f"{where} must hold integer token ids: position {t} is the float {x!r} (float ids are refused, 1.0 too: "
            "convert them with int(...) or .long() where they are whole numbers)"
        )
    if isinstance(x, (str, bytes)):
        return ValueError(f"{at} is the string {_describe(x)}; {TOKENIZE_HINT}")
    if isinstance(x, (list, tuple, np.ndarray, torch.Tensor)):
        return ValueError(
            f"{where} must be 1-D (a flat list of token ids), but position {t} holds {_describe(x)} (ragged "
            "nesting, or a batch where one sequence belongs)"
        )
    return ValueError(f"{at} is {_describe(x)} ({type(x).__name__}), not an integer token id")


def _check_range(arr: np.ndarray, where: str) -> np.ndarray:
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        t = int(negative[0])
        raise ValueError(f"token id {int(arr[t])} at {where}, position {t} is negative")
    return arr


def _token_list(items: list, where: str) -> np.ndarray:
    if not items:
        raise ValueError(f"{where} is empty: every sequence needs at least one token")
    if not set(map(type, items)) <= _PLAIN_INTS:  # plain ints (the usual case) need no scan
        for t, x in enumerate(items):
            problem = _token_problem(x, where, t)
            if problem is not None:
                raise problem
        items = [int(x) for x in items]
    try:
        arr = np.array(items, dtype=np.int64)
    except OverflowError:
        t = next(t for t, x in enumerate(items) if not -INT64_MAX - 1 <= x <= INT64_MAX)
        why = "is negative" if items[t] < 0 else "does not fit in int64 (token ids index the vocabulary)"
        raise ValueError(f"token id {_describe(items[t])} at {where}, position {t} {why}") from None
    return _check_range(arr, where)


def _token_ndarray(arr: np.ndarray, where: str) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(f"{where} must be 1-D, got shape {tuple(arr.shape)}")
    kind = arr.dtype.kind
    if kind == "O":
        return _token_list(arr.tolist(), where)
    if kind == "b":
        raise ValueError(f"{where} holds bools (dtype {arr.dtype}), not token ids: pass integer ids")
    if kind in "fc":
        raise ValueError(
            f"{where} must hold integer token ids, got dtype {arr.dtype} (float ids are refused: convert them "
            "with .astype(np.int64) or .long() where they are whole numbers)"
        )
    if kind in "USV":
        raise ValueError(f"{where} must hold integer token ids, got dtype {arr.dtype}; {TOKENIZE_HINT}")
    if kind not in "iu":
        raise ValueError(f"{where} must hold integer token ids, got dtype {arr.dtype}")
    if arr.size == 0:
        raise ValueError(f"{where} is empty: every sequence needs at least one token")
    if kind == "u" and arr.dtype.itemsize == 8:
        big = np.flatnonzero(arr > INT64_MAX)
        if big.size:
            t = int(big[0])
            raise ValueError(
                f"token id {int(arr[t])} at {where}, position {t} does not fit in int64 (token ids index the "
                "vocabulary)"
            )
    return _check_range(arr.astype(np.int64, copy=False), where)


def token_array(seq: Any, index: int) -> np.ndarray:
    """Sequence ``index`` as a ``[len]`` int64 array of token ids, or an error saying why not."""
    where = f"sequence {index}"
    if isinstance(seq, torch.Tensor):
        if seq.dtype == torch.bool:
            raise ValueError(f"{where} holds bools (a torch.bool tensor), not token ids: pass integer ids")
        if seq.is_floating_point() or seq.is_complex():
            raise ValueError(
                f"{where} must hold integer token ids, got a {seq.dtype} tensor (float ids are refused: convert "
                "with .long() where they are whole numbers)"
            )
        seq = seq.detach().cpu().numpy()
    if isinstance(seq, np.ndarray):
        return _token_ndarray(seq, where)
    if isinstance(seq, (str, bytes)):
        raise ValueError(f"{where} is a string, not a list of token ids; {TOKENIZE_HINT}")
    if isinstance(seq, Mapping):
        raise _mapping_error(seq, where, ValueError)
    if seq is None or isinstance(seq, (numbers.Number, np.generic)):
        raise ValueError(
            f"{where} is {_describe(seq)}, not a sequence: each sequence is a list of token ids ([id] for one token)"
        )
    try:
        items = list(seq)
    except TypeError:
        raise ValueError(f"{where} is {_describe(seq)} ({type(seq).__name__}), not a list of token ids") from None
    return _token_list(items, where)


# ----------------------------------------------------------------------------- fields
def _real(x: Any, where: str) -> float:
    """One field value as a float (``where`` names it), or an error saying why not."""
    if isinstance(x, (complex, np.complexfloating)):
        raise ValueError(f"{where} is the complex number {x!r}; fields hold real numbers")
    if isinstance(x, (bool, np.bool_, int, float, np.integer, np.floating)):
        try:
            return float(x)
        except OverflowError:
            raise ValueError(f"{where} is {_describe(x)}, too large for float64 (must be finite)") from None
    if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 0:
        if x.dtype in (torch.complex64, torch.complex128) or getattr(x.dtype, "kind", "") == "c":
            raise ValueError(f"{where} is a complex {type(x).__name__}; fields hold real numbers")
        return _real(x.item(), where)
    if isinstance(x, (str, bytes)):
        raise ValueError(
            f"{where} is the string {_describe(x)}; fields hold numbers (numeric strings are refused: convert them "
            "with float(...))"
        )
    if isinstance(x, numbers.Real):  # fractions.Fraction and other registered reals
        return _real(float(x), where)
    raise ValueError(f"{where} is {_describe(x)} ({type(x).__name__}), not a number")


def _field_ndarray(arr: np.ndarray, where: str) -> np.ndarray:
    kind = arr.dtype.kind
    if kind == "c":
        raise ValueError(f"{where} has complex values (dtype {arr.dtype}); fields hold real numbers")
    if kind in "USV":
        raise ValueError(f"{where} holds strings (dtype {arr.dtype}); fields hold numbers: convert them first")
    if kind == "O":
        if arr.ndim == 0:
            return np.asarray(_real(arr.item(), where))
        if arr.ndim > 1:
            raise ValueError(f"{where} must be a number (per sequence) or 1-D (per token), got shape {arr.shape}")
        return _field_sequence(arr.tolist(), where)
    if kind not in "biuf":
        raise ValueError(f"{where} has dtype {arr.dtype}; fields hold numbers")
    return arr.astype(np.float64)


def _field_sequence(items: Any, where: str) -> np.ndarray:
    """A Python list of one sequence's per-token values as float64 (0-d for a number)."""
    if not isinstance(items, list):
        return np.asarray(_real(items, where))
    if set(map(type, items)) <= _PLAIN_REALS:
        try:
            return np.array(items, dtype=np.float64)
        except OverflowError:
            pass  # an int too large for float64: the loop below names it
    values = np.empty(len(items), dtype=np.float64)
    for t, x in enumerate(items):
        if isinstance(x, (list, tuple)) or (isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim > 0):
            raise ValueError(
                f"{where} must be a number (per sequence) or 1-D (per token), got {_describe(x)} at position {t}"
            )
        values[t] = _real(x, f"{where} at position {t}")
    return values


def _field_values(value: Any, where: str) -> np.ndarray:
    """One sequence's entry of a field as float64, 0-d (one number) or N-d as given."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise ValueError(f"{where} is a complex tensor ({value.dtype}); fields hold real numbers")
        # float64 keeps every bit; 16-bit floats and float32 widen exactly
        return value.detach().to(device="cpu", dtype=torch.float64).numpy()
    if isinstance(value, np.ndarray):
        return _field_ndarray(value, where)
    if isinstance(value, (str, bytes, Mapping)) or value is None:
        raise ValueError(
            f"{where} must be a number or a 1-D list of numbers, got {_describe(value)}"
            + (" (numeric strings are refused: convert them with float(...))" if isinstance(value, str) else "")
        )
    if isinstance(value, (tuple, range)) or (not isinstance(value, list) and isinstance(value, Iterable)):
        value = list(value)
    return _field_sequence(value, where)


def field_array(name: str, value: Any, index: int, length: int, prediction_aligned: bool = False) -> np.ndarray:
    """One sequence's values of a field as ``[length]`` float64.

    ``value`` is either one number (a per-sequence scalar: Python number, numpy scalar,
    0-d array or tensor), broadcast to every token, or a 1-D array of ``length`` values.
    With ``prediction_aligned``, a 1-D array of ``length - 1`` values is accepted too
    (value ``i`` belongs to token ``i + 1``, as ``TreeRuntime.logprobs`` returns them)
    and gets a 0 at position 0, which is never predicted.
    """
    where = f"field {name!r} of sequence {index}"
    arr = _field_values(value, where)
    if arr.ndim == 0:
        arr = np.full(length, float(arr))
    if arr.ndim != 1:
        raise ValueError(f"{where} must be a number (per sequence) or 1-D (per token), got shape {tuple(arr.shape)}")
    if prediction_aligned and arr.shape[0] == length - 1:
        arr = np.concatenate([[0.0], arr])
    if arr.shape[0] != length:
        expected = f"{length} (or {length - 1}, prediction-aligned)" if prediction_aligned else f"{length}"
        hint = (
            "; for prediction-aligned values (one per predicted token, as TreeRuntime.logprobs returns them) "
            "use Forest.with_fields"
            if not prediction_aligned and arr.shape[0] == length - 1
            else ""
        )
        raise ValueError(
            f"{where} has {arr.shape[0]} values but the sequence has {length} tokens "
            f"(expected {expected} values, or one number per sequence){hint}"
        )
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"{where} at position {t} is {arr[t]} (must be finite)")
    return arr


def field_arrays(name: str, values: Any, lengths: Sequence[int], prediction_aligned: bool = False) -> list[np.ndarray]:
    """A field's values per sequence (see :func:`field_array`), one entry per sequence."""
    if isinstance(values, (str, bytes, Mapping)) or values is None:
        count = None
    else:
        try:
            count = len(values)
        except TypeError:  # a number or a 0-d array/tensor
            count = None
    if count is None:
        raise ValueError(
            f"field {name!r} must hold one entry per sequence (a list, array or tensor), got {_describe(values)}"
        )
    if count != len(lengths):
        raise ValueError(f"field {name!r} has {count} entries but there are {len(lengths)} sequences")
    return [field_array(name, v, i, n, prediction_aligned) for i, (v, n) in enumerate(zip(values, lengths))]


def check_field_names(names: Iterable[Any]) -> None:
    """Field names are strings, none of them reserved (:data:`RESERVED_FIELD_NAMES`)."""
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"field names must be strings, got {_describe(name)}")
        if name in RESERVED_FIELD_NAMES:
            raise ValueError(
                f"field name {name!r} is reserved ({RESERVED_FIELD_NAMES[name]}): rename the field"
            )
