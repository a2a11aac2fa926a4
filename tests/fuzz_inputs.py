"""Generators of malformed batches and JSONL files for tests/test_fuzz_inputs.py, and
the oracle (padded batches: tests/fuzz_padded.py).

Every generator starts from a valid batch and applies zero or more mutations from a
catalog of what careless users and broken pipelines produce, recording what it broke.
An unmutated batch must be accepted exactly (tokens and float64 fields equal to an
independent conversion); a mutated one must be refused by an error that dtree raised
itself (:func:`assert_dtree_error`).
"""

from __future__ import annotations

import linecache
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import dtree

DTREE_DIR = os.path.dirname(dtree.__file__)
INT64 = 2**63


class Encoding(dict):
    """A stand-in for a tokenizer's BatchEncoding (a dict subclass, like the real one)."""


def assert_dtree_error(exc: BaseException) -> None:
    """``exc`` is a ValueError or TypeError raised by a ``raise`` statement of dtree's own
    code (not numpy's, json's or Python's error passing through a dtree line), and so is
    any error it replaced (``raise ... from None`` keeps it as ``__context__``)."""
    assert isinstance(exc, (ValueError, TypeError)), f"{type(exc).__name__}: {exc}"
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    path, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
    source = linecache.getline(path, line).strip()
    assert path.startswith(DTREE_DIR) and source.startswith("raise"), (
        f"{type(exc).__name__} not raised by dtree ({path}:{line}: {source!r}): {exc}"
    )
    inner = exc.__context__
    if inner is not None and exc.__suppress_context__ and isinstance(inner, (ValueError, TypeError)):
        if str(inner) in str(exc) and not _from_json(inner):  # a wrapped message: dtree's own too (json's parse
            assert_dtree_error(inner)  # errors are reported as "not valid JSON (...)" on purpose)


def _from_json(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if f"{os.sep}json{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


# ----------------------------------------------------------------------------- junk values
JUNK_TOKENS = [
    True, False, np.bool_(True), 1.0, 2.5, float("nan"), float("inf"), 1e19, 1e300, np.float32(3.0), "3", b"3",
    None, [1], [[1]], {"a": 1}, 1 + 0j, INT64, INT64 + 7, 2**200, -1, -(2**70), torch.tensor(1.0),
    torch.tensor(True), np.array([1, 2]), object(),
]
JUNK_SEQUENCES = [
    "", "1 2 3", b"12", 5, 5.0, None, {}, Encoding(input_ids=[1, 2]), [], np.array([], dtype=np.int64),
    np.zeros((2, 2), dtype=np.int64), np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([True]),
    np.array(["1", "2"]), np.array([1 + 1j]), np.array([1, INT64], dtype=np.uint64),
    torch.zeros(2, 2, dtype=torch.long),
    torch.tensor(3), np.array([True, False]), torch.tensor([1, 2], dtype=torch.complex64),
]
JUNK_TOP = [
    None, 0, 1.5, "abc", b"abc", {1, 2}, Encoding(input_ids=[[1, 2]], attention_mask=[[1, 1]]), {"input_ids": [[1]]},
    [], np.zeros((2, 3), dtype=np.int64), torch.tensor([1, 2, 3]), torch.zeros((2, 3), dtype=torch.long), np.array(5),
    torch.tensor(5),
]
JUNK_FIELD_VALUES = [
    "1", "nan", "", None, 1 + 2j, np.complex64(1), 10**400, -(10**500), float("nan"), float("inf"), -float("inf"),
    [1], {"a": 1}, b"1", torch.tensor(1 + 1j), np.float64("nan"), object(),
]
JUNK_FIELD_CONTAINERS = [1.0, "abc", {"a": [1.0]}, torch.tensor(1.0), np.float64(2.0), b"x"]
RESERVED = ["cls", "tokens", "self"]


@dataclass
class Case:
    """An input and what the oracle expects of it: accepted (``broken`` empty) with
    ``tokens`` and ``fields`` (float64 per linearized token), or refused, naming
    ``names`` (any one of them) in the message."""

    sequences: Any
    fields: dict
    tokens: list[list[int]]
    expected_fields: dict[str, list[float]]
    broken: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def _render_sequence(seq: list[int], kind: str):
    if kind == "list":
        return list(seq)
    if kind == "tuple":
        return tuple(seq)
    if kind == "np_scalars":
        return [np.int64(t) for t in seq]
    if kind.startswith("np_"):
        return np.array(seq, dtype=getattr(np, kind[3:]))
    return torch.tensor(seq, dtype=getattr(torch, kind[6:]))


SEQUENCE_KINDS = ["list", "tuple", "np_scalars", "np_int64", "np_int32", "np_uint16", "torch_int64", "torch_int32",
                  "torch_uint8"]


def _render_field(values: list[float], per_sequence: bool, kind: str):
    """One entry of a field, and its expected float64 values per token."""
    if per_sequence:
        v = values[0]
        given = {"float": float(v), "np": np.float32(v), "tensor": torch.tensor(v, dtype=torch.float64),
                 "int": int(v), "bool": bool(v > 0)}[kind]
        expect = float(given) if not isinstance(given, torch.Tensor) else given.item()
        return given, [expect] * len(values)
    if kind == "float":
        return list(values), [float(v) for v in values]
    if kind == "np":
        arr = np.array(values, dtype=np.float32)
        return arr, arr.astype(np.float64).tolist()
    if kind == "tensor":
        t = torch.tensor(values, dtype=torch.bfloat16)
        return t, t.double().tolist()
    if kind == "int":
        return [int(v) for v in values], [float(int(v)) for v in values]
    return [bool(v > 0) for v in values], [float(v > 0) for v in values]


@st.composite
def valid_batches(draw) -> Case:
    n = draw(st.integers(1, 5))
    base = draw(st.lists(st.integers(0, 200), min_size=1, max_size=6))
    tokens = []
    for _ in range(n):  # shared prefixes: tries with branches
        cut = draw(st.integers(0, len(base)))
        tokens.append(base[:cut] + draw(st.lists(st.integers(0, 200), min_size=0 if cut else 1, max_size=5)))
    sequences = [_render_sequence(s, draw(st.sampled_from(SEQUENCE_KINDS))) for s in tokens]
    fields, expected = {}, {}
    for name in draw(st.lists(st.sampled_from(["loss_mask", "advantages", "old_logprobs", "x"]), unique=True)):
        entries, flat = [], []
        for s in tokens:
            values = draw(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=len(s), max_size=len(s)))
            given, expect = _render_field(values, draw(st.booleans()), draw(st.sampled_from(
                ["float", "np", "tensor", "int", "bool"])))
            entries.append(given)
            flat += expect
        fields[name], expected[name] = entries, flat
    return Case(sequences, fields, tokens, expected)


MUTATIONS = ("token", "sequence", "top", "field value", "field entry", "field container", "field count", "reserved")


@st.composite
def mutated_batches(draw, first: str) -> Case:
    """A valid batch with the mutation ``first`` (``"none"``: none, and the batch must be
    accepted exactly), then maybe one more of any kind."""
    case = draw(valid_batches())
    if first == "none":
        return case
    if first.startswith("field") or first == "reserved":
        case.fields.setdefault("advantages", [0.5] * len(case.tokens))
        case.expected_fields.setdefault("advantages", [0.5] * sum(map(len, case.tokens)))
    _mutate(draw, case, first)
    if draw(st.booleans()):
        _mutate(draw, case, draw(st.sampled_from(MUTATIONS)))
    return case


def _ndim(seq) -> int | None:
    """``np.ndim`` of a sequence, or None for a ragged one (a junk token an earlier mutation put in:
    ``[array([1, 2]), 0]``), which numpy cannot shape."""
    try:
        return np.ndim(seq)
    except ValueError:
        return None


def _mutate(draw, case: Case, kind: str) -> None:
    seqs = case.sequences
    if "top" in case.broken or not isinstance(seqs, list) or not seqs:  # already a junk top-level value
        return
    i = draw(st.integers(0, len(seqs) - 1))
    if kind == "token":
        seq = seqs[i]
        if not isinstance(seq, (list, tuple, np.ndarray, torch.Tensor)) or _ndim(seq) != 1 or not len(seq):
            return  # already junk from an earlier mutation
        seq = list(seqs[i])
        seq[draw(st.integers(0, len(seq) - 1))] = draw(st.sampled_from(JUNK_TOKENS))
        seqs[i] = seq
        case.names.append(f"sequence {i}")
    elif kind == "sequence":
        seqs[i] = draw(st.sampled_from(JUNK_SEQUENCES))
        case.names.append(f"sequence {i}")
    elif kind == "top":
        case.sequences = draw(st.sampled_from(JUNK_TOP))
        case.names.append("sequences")
    elif not case.fields:
        return
    else:
        name = draw(st.sampled_from(sorted(case.fields)))
        entries = case.fields[name]
        if not isinstance(entries, list) or len(entries) != len(case.tokens):
            return  # already junk from an earlier mutation
        if kind == "field value":
            entry = entries[i]
            if isinstance(entry, (list, np.ndarray, torch.Tensor)) and np.ndim(entry) == 1:
                entry = list(entry)
            elif isinstance(entry, (int, float, bool, np.generic, torch.Tensor)) and np.ndim(entry) == 0:
                entry = [entry] * len(case.tokens[i])
            else:
                return
            entry[draw(st.integers(0, len(entry) - 1))] = draw(st.sampled_from(JUNK_FIELD_VALUES))
            entries[i] = entry
        elif kind == "field entry":
            n = len(case.tokens[i])
            entries[i] = draw(st.sampled_from(
                [[0.5] * (n + 1), [0.5] * (n - 1) if n > 1 else [], np.ones((n, 1)),
                 torch.ones(n, dtype=torch.complex64), np.array(["1"] * n), "0.5", None, {"x": 1.0}]
            ))
        elif kind == "field container":
            case.fields[name] = draw(st.sampled_from(JUNK_FIELD_CONTAINERS))
        elif kind == "field count":
            case.fields[name] = entries + entries[:1] if draw(st.booleans()) or len(entries) == 1 else entries[1:]
        else:
            name = draw(st.sampled_from(RESERVED))
            case.fields[name] = case.fields.pop(draw(st.sampled_from(sorted(case.fields))))
        case.names.append(name)
    case.broken.append(kind)


def check_forest_case(case: Case) -> None:
    """The oracle for :func:`mutated_batches` through ``Forest.from_sequences``."""
    try:
        forest = dtree.Forest.from_sequences(case.sequences, **case.fields)
    except BaseException as e:  # noqa: BLE001 -- the oracle judges every exception
        assert case.broken, f"a valid batch was refused: {type(e).__name__}: {e}"
        assert_dtree_error(e)
        assert any(n in str(e) for n in case.names + ["sequences"]), f"{case.names} not named in: {e}"
        return
    assert not case.broken, f"accepted a batch with a {case.broken} mutation: {case.sequences!r} {case.fields!r}"
    assert [s.tolist() for s in forest.sequences()] == case.tokens
    assert set(forest.fields) == set(case.expected_fields)
    for name, values in case.expected_fields.items():
        assert forest.fields[name].tolist() == values, name


# ----------------------------------------------------------------------------- JSONL files
JUNK_JSON_TOKENS = ["true", "1.5", "1.0", "1e19", "1e400", '"3"', "null", "[1]", "[[1, 2]]", '{"a": 1}',
                    "9223372036854775808", "-1", "1" * 5000, "NaN", "-Infinity"]
JUNK_JSON_VALUES = ['"1"', "null", "NaN", "Infinity", "1e999", "1" * 401, "[[1]]", "{}", "true false"]


@dataclass
class JsonlCase:
    """A JSONL file's bytes; ``bad_line`` is the 1-based line a mutation broke (None:
    the file is valid, or broken as a whole: ``broken`` says)."""

    content: bytes
    broken: list[str]
    bad_line: int | None
    tokens: list[list[int]]


JSONL_MUTATIONS = ("none", "token", "value", "truncate", "nest", "utf8", "array line", "reserved", "missing field",
                   "duplicate key", "no tokens", "utf16", "empty")


@st.composite
def jsonl_cases(draw, first: str) -> JsonlCase:
    """A valid batch as a JSONL file, with the mutation ``first`` (``"none"``: valid)."""
    case = draw(valid_batches())
    if first in ("value", "missing field"):
        case.fields.setdefault("advantages", [0.5] * len(case.tokens))
        case.expected_fields.setdefault("advantages", [0.5] * sum(map(len, case.tokens)))
    names = sorted(n for n in case.fields if n != "x")
    lines, tokens = [], case.tokens
    for s, seq in enumerate(tokens):
        start, n = sum(map(len, tokens[:s])), len(seq)
        values = {k: ", ".join(repr(v) for v in case.expected_fields[k][start : start + n]) for k in names}
        obj = ", ".join([f'"tokens": [{", ".join(map(str, seq))}]'] + [f'"{k}": [{values[k]}]' for k in names])
        lines.append("{" + obj + "}")
    blank = draw(st.integers(0, len(lines)))  # a blank line somewhere: line numbers still count it
    lines.insert(blank, "")
    text_lines = list(lines)
    broken, bad = [], None
    mutation = first
    filled = [i for i, line in enumerate(text_lines) if line]
    if mutation == "missing field":  # on the first line, the next line would be the one that differs
        mutation = mutation if len(filled) > 1 else "none"
        filled = filled[1:] or filled
    k = draw(st.sampled_from(filled))
    line = text_lines[k]
    if mutation == "token":
        line = line.replace('"tokens": [', f'"tokens": [{draw(st.sampled_from(JUNK_JSON_TOKENS))}, ', 1)
    elif mutation == "value" and names:
        line = line.replace(f'"{names[0]}": [', f'"{names[0]}": [{draw(st.sampled_from(JUNK_JSON_VALUES))}, ', 1)
    elif mutation == "truncate":
        line = line[: draw(st.integers(0, len(line) - 1))] or "{"
    elif mutation == "nest":
        depth = draw(st.sampled_from([3, 1200, 50_000]))
        line = line.replace('"tokens": [', '"tokens": ' + "[" * depth, 1).replace("]", "]" * depth, 1)
    elif mutation == "array line":
        line = "[" + line + "]"
    elif mutation == "reserved":
        line = line[:-1] + f', "{draw(st.sampled_from(["sequences", "cls", "self"]))}": 1' + "}"
    elif mutation == "missing field" and names:
        line = line.split(f', "{names[0]}"')[0] + "}"
    elif mutation == "duplicate key":
        line = line[:-1] + ', "tokens": [1]}'
    elif mutation == "no tokens":
        line = line.replace('"tokens"', '"ids"', 1)
    if mutation in ("none", "utf16", "empty") or (mutation in ("value", "missing field") and not names):
        mutation = mutation if mutation in ("utf16", "empty") else "none"
    elif line != text_lines[k] or mutation == "utf8":
        text_lines[k], bad = line, k + 1
        broken.append(mutation)
    content = ("\n".join(text_lines) + "\n").encode("utf-8")
    if mutation == "utf8":
        raw = [x.encode("utf-8") for x in text_lines]
        raw[k] = raw[k][:-1] + b', "n\xe9": 1}'  # a latin-1 byte inside the object
        content = b"\n".join(raw) + b"\n"
    elif mutation == "utf16":
        content, broken = ("\n".join(text_lines) + "\n").encode("utf-16"), ["utf16"]
    elif mutation == "empty":
        content, broken = b"\n" * draw(st.integers(0, 3)), ["empty"]
    return JsonlCase(content, broken, bad, tokens)


def check_jsonl_case(case: JsonlCase, path: str) -> None:
    """The oracle for :func:`jsonl_cases` through ``Forest.from_jsonl``."""
    try:
        forest = dtree.Forest.from_jsonl(path)
    except BaseException as e:  # noqa: BLE001 -- the oracle judges every exception
        assert case.broken, f"a valid file was refused: {type(e).__name__}: {e}"
        assert_dtree_error(e)
        prefix = f"{path}:{case.bad_line}: " if case.bad_line else f"{path}"
        assert str(e).startswith(prefix), f"expected {prefix!r}: {e}"
        return
    assert not case.broken, f"accepted a file with a {case.broken} mutation: {case.content[:300]!r}"
    assert [s.tolist() for s in forest.sequences()] == case.tokens
