"""JSON Lines storage of a batch of sequences: one object per line.

Each line is ``{"tokens": [int, ...], "<field>": [number, ...], ...}``; every field
list has one value per token. Lines may omit a field only if every line omits it.
Blank lines are skipped. This is the format ``dtree stats`` and ``dtree bench --data`` read.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["read_jsonl", "write_jsonl"]


def read_jsonl(path: str) -> tuple[list[list[int]], dict[str, list[list[float]]]]:
    """Read sequences and per-token fields. Errors name the file and line."""
    sequences: list[list[int]] = []
    fields: dict[str, list[Any]] = {}
    field_names: set[str] | None = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or "tokens" not in obj:
                raise ValueError(f'{path}:{lineno}: each line must be an object with a "tokens" list')
            names = set(obj) - {"tokens"}
            if field_names is None:
                field_names = names
                fields = {n: [] for n in sorted(names)}
            elif names != field_names:
                raise ValueError(
                    f"{path}:{lineno}: fields {sorted(names)} differ from the first line's {sorted(field_names)}"
                )
            sequences.append(obj["tokens"])
            for n in names:
                fields[n].append(obj[n])
    if not sequences:
        raise ValueError(f"{path}: no sequences found")
    return sequences, fields


def _plain(values: np.ndarray) -> list:
    """Integers stay integers in the file; other values keep full float precision."""
    if np.all(values == np.round(values)):
        return [int(v) for v in values]
    return [float(v) for v in values]


def write_jsonl(path: str, sequences: list[np.ndarray], fields: dict[str, list[np.ndarray]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s, seq in enumerate(sequences):
            obj: dict[str, Any] = {"tokens": [int(t) for t in seq]}
            for name, values in fields.items():
                obj[name] = _plain(np.asarray(values[s]))
            f.write(json.dumps(obj) + "\n")
