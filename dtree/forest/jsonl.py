"""JSON Lines storage of a batch of sequences: one object per line.

Each line is ``{"tokens": [int, ...], "<field>": [number, ...] or number, ...}``; a field
holds one value per token, or one number for the whole sequence. Lines may omit a field
only if every line omits it. Blank lines are skipped; the file is UTF-8 (a UTF-8 byte
order mark is fine). This is the format ``dtree stats`` and ``dtree bench --data`` read.

Every problem with a file's content is a ``ValueError`` that starts with
``path:line:`` and says what is wrong and how to fix it (not UTF-8, not JSON, nested
too deeply, a duplicate key, a reserved field name, and every check of
:mod:`dtree.forest.inputs` on the tokens and fields); a missing file is a
``FileNotFoundError``, a directory a ``ValueError``.
"""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO

import numpy as np

from .inputs import check_field_names, field_array, token_array

__all__ = ["read_jsonl", "write_jsonl"]

_UTF8_BOM = b"\xef\xbb\xbf"
_OTHER_BOMS = {b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16", b"\x00\x00\xfe\xff": "UTF-32"}


def _open(path: Any) -> tuple[str, BinaryIO]:
    """``(path as text, the file opened for binary reading)``."""
    try:
        name = os.fspath(path)
    except TypeError:
        raise TypeError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}") from None
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    if os.path.isdir(name):
        raise ValueError(f"{name} is a directory, not a JSON Lines file")
    try:
        return name, open(name, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: no such file") from None
    except OSError as e:  # permission denied, a device, ...
        raise ValueError(f"{name}: cannot be read ({e.strerror or e})") from None


def _text(raw: bytes, lineno: int) -> str:
    """One line of the file as text (UTF-8; a BOM on the first line is dropped)."""
    if lineno == 1:
        for bom, encoding in _OTHER_BOMS.items():
            if raw.startswith(bom):
                raise ValueError(
                    f"the file is {encoding}-encoded; dtree reads UTF-8 JSON Lines: convert it "
                    f"(e.g. iconv -f {encoding} -t UTF-8)"
                )
        if raw.startswith(_UTF8_BOM):
            raw = raw[len(_UTF8_BOM) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); dtree reads UTF-8 JSON Lines: "
            "save the file as UTF-8"
        ) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"the key {key!r} appears twice in one object")
        obj[key] = value
    return obj


def _parse(text: str) -> dict[str, Any]:
    """One line's object, with ``"tokens"``."""
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError(
            "nested too deeply: a line holds one object of token ids and numbers (at most two levels deep)"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg}, column {e.colno})") from None
    except ValueError as e:  # an integer literal of more digits than Python converts, a duplicate key
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict) or "tokens" not in obj:
        raise ValueError('each line must be an object with a "tokens" list')
    return obj


def read_jsonl(path: Any) -> tuple[list[np.ndarray], dict[str, list[np.ndarray]]]:
    """Read and check sequences and fields: per line, the token ids as ``[len]`` int64
    and each field as ``[len]`` float64 (checked by :mod:`dtree.forest.inputs`). Every error
    names the file and line (see the module docstring)."""
    sequences: list[np.ndarray] = []
    fields: dict[str, list[np.ndarray]] = {}
    field_names: set[str] | None = None
    name, f = _open(path)
    with f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = _text(raw, lineno)
                if not text.strip():
                    continue
                obj = _parse(text)
                names = set(obj) - {"tokens"}
                check_field_names(names)
                if field_names is None:
                    field_names = names
                    fields = {n: [] for n in sorted(names)}
                elif names != field_names:
                    raise ValueError(f"fields {sorted(names)} differ from the first line's {sorted(field_names)}")
                index = len(sequences)
                seq = token_array(obj["tokens"], index)
                for n in names:
                    fields[n].append(field_array(n, obj[n], index, len(seq)))
                sequences.append(seq)
            except (ValueError, TypeError) as e:  # a file's content is a value: one type, file and line first
                raise ValueError(f"{name}:{lineno}: {e}") from None
    if not sequences:
        raise ValueError(f"{name}: no sequences found")
    return sequences, fields


def _plain(values: np.ndarray) -> list:
    """Integers stay integers in the file; other values keep full float precision."""
    if np.all(values == np.round(values)):
        return [int(v) for v in values]
    return [float(v) for v in values]


def write_jsonl(path: str, sequences: list[np.ndarray], fields: dict[str, list[np.ndarray]]) -> None:
    check_field_names(fields)
    with open(path, "w", encoding="utf-8") as f:
        for s, seq in enumerate(sequences):
            obj: dict[str, Any] = {"tokens": [int(t) for t in seq]}
            for name, values in fields.items():
                obj[name] = _plain(np.asarray(values[s]))
            f.write(json.dumps(obj) + "\n")
