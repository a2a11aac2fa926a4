"""Every malformed batch a careless user or a broken pipeline produces gets a ValueError or
TypeError from dtree that names the sequence, position, field, file and line, and the
fix (issue 24's tables and the first-mistakes table of issue 18), never a raw error
from numpy, json or Python, and nothing malformed is accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtree import Forest

SEQ = [[1, 2, 3], [1, 2, 4]]


class FakeEncoding(dict):
    """What a tokenizer returns (transformers' BatchEncoding is a dict subclass too)."""


ENC = FakeEncoding(input_ids=[[1, 2, 3]], attention_mask=[[1, 1, 1]])

# (what is passed to Forest.from_sequences, the error type, a regex of the message)
SEQUENCE_CASES = {
    "None": (None, TypeError, r"sequences must be a list of token-id sequences .* got None"),
    "int": (7, TypeError, r"sequences must be a list .* got 7 \(int\)"),
    "float": (3.5, TypeError, r"got 3.5 \(float\)"),
    "string": ("hello", TypeError, r"sequences is a string.*tokenize first"),
    "set": ({1, 2}, TypeError, r"sequences is a set"),
    "one 1-D tensor": (torch.tensor([1, 2, 3]), ValueError, r"one array of shape \(3,\).*\[ids\] for a single"),
    "list of strings": (["hello world", "bye"], ValueError,
                        r"sequence 0 is a string.*tokenizer\(texts\)\['input_ids'\]"),
    "BatchEncoding": (ENC, TypeError, r"FakeEncoding \(a tokenizer's output\?\).*encoding\['input_ids'\]"),
    "dict of lists": ({"a": [1]}, TypeError, r"sequences is a dict: pass a list"),
    "ragged": ([[1, [2]]], ValueError, r"sequence 0 must be 1-D .*position 1 holds a list"),
    "3-D": ([[[1, 2]]], ValueError, r"sequence 0 must be 1-D"),
    "bool ids": ([[True, False]], ValueError, r"sequence 0, position 0 is the bool True"),
    "bool mixed": ([[1, True]], ValueError, r"sequence 0, position 1 is the bool True"),
    "bool tensor": ([torch.tensor([True, False])], ValueError, r"sequence 0 holds bools"),
    "bool array": ([np.array([True])], ValueError, r"sequence 0 holds bools"),
    "float ids": ([[1.0, 2.0, 3.0]], ValueError, r"sequence 0 must hold integer token ids: position 0 is the float 1.0"),
    "float tensor": ([torch.tensor([1.0, 2.0])], ValueError, r"got a torch.float32 tensor .*\.long\(\)"),
    "float array": ([np.array([1.0, 2.0])], ValueError, r"got dtype float64"),
    "2**63": ([[1, 2**63]], ValueError, r"token id 9223372036854775808 at sequence 0, position 1 does not fit in int64"),
    "-2**70": ([[1, -(2**70)]], ValueError, r"position 1 is negative"),
    "1e19": ([[1, 1e19]], ValueError, r"position 1 is the float 1e\+19"),
    "1e300": ([[1, 1e300]], ValueError, r"position 1 is the float 1e\+300"),
    "uint64": ([np.array([1, 2**63], dtype=np.uint64)], ValueError, r"token id 9223372036854775808 .* does not fit"),
    "negative": ([[1, -3, 2]], ValueError, r"token id -3 at sequence 0, position 1 is negative"),
    "string ids": ([["1", "2"]], ValueError, r"sequence 0, position 0 is the string '1'"),
    "None id": ([[1, None]], ValueError, r"sequence 0, position 1 is None"),
    "empty": ([[1], []], ValueError, r"sequence 1 is empty"),
    "no sequences": ([], ValueError, r"sequences is empty"),
    "number as sequence": ([5], ValueError, r"sequence 0 is 5, not a sequence.*\[id\] for one token"),
    "dict as sequence": ([{"input_ids": [1]}], ValueError, r"sequence 0 is a dict .*encoding\['input_ids'\]"),
}


@pytest.mark.parametrize("name", SEQUENCE_CASES)
def test_bad_sequences(name):
    value, error, match = SEQUENCE_CASES[name]
    with pytest.raises(error, match=match):
        Forest.from_sequences(value)


# (fields for Forest.from_sequences(SEQ, ...), the error type, a regex of the message)
FIELD_CASES = {
    "10**400 per sequence": ({"a": [10**400, 1]}, ValueError, r"field 'a' of sequence 0 is an integer of 401 digits"),
    "10**400 per token": ({"a": [[1, 2, 10**400], 1]}, ValueError, r"sequence 0 at position 2 is an integer of 401"),
    "numeric string": ({"a": [["1", 2, 3], 1]}, ValueError, r"at position 0 is the string '1'.*float\(\.\.\.\)"),
    "numeric string scalar": ({"a": ["1", 1]}, ValueError, r"field 'a' of sequence 0 must be a number .* got '1'"),
    "complex": ({"a": [[1 + 2j, 1, 1], 1]}, ValueError, r"at position 0 is the complex number"),
    "complex tensor": ({"a": [torch.ones(3, dtype=torch.complex64), 1]}, ValueError, r"complex tensor"),
    "complex array": ({"a": np.ones((2, 3), dtype=complex)}, ValueError, r"complex values"),
    "string array": ({"a": [np.array(["1", "2", "3"]), 1]}, ValueError, r"holds strings"),
    "None entry": ({"a": [None, 1]}, ValueError, r"field 'a' of sequence 0 must be a number .* got None"),
    "nested": ({"a": [[1, [2], 3], 1]}, ValueError, r"got a list at position 1"),
    "nan": ({"a": [[0, float("nan"), 1], 1]}, ValueError, r"sequence 0 at position 1 is nan"),
    "nan loss_mask": ({"loss_mask": [[0, float("nan"), 1], 1]}, ValueError,
                      r"'loss_mask' of sequence 0 at position 1 is nan"),
    "inf tensor": ({"a": torch.tensor([[0, 1, float("inf")], [0, 1, 1]])}, ValueError, r"position 2 is inf"),
    "one number": ({"a": 1.0}, ValueError, r"field 'a' must hold one entry per sequence"),
    "a string": ({"a": "abc"}, ValueError, r"field 'a' must hold one entry per sequence"),
    "too few entries": ({"a": [1.0]}, ValueError, r"field 'a' has 1 entries but there are 2 sequences"),
    "cls": ({"cls": [1, 1]}, ValueError, r"field name 'cls' is reserved"),
    "tokens": ({"tokens": [1, 1]}, ValueError, r"field name 'tokens' is reserved"),
}


@pytest.mark.parametrize("name", FIELD_CASES)
def test_bad_fields(name):
    fields, error, match = FIELD_CASES[name]
    with pytest.raises(error, match=match):
        Forest.from_sequences(SEQ, **fields)


def test_bool_fields_are_numbers():
    """A bool mask is a mask: True is 1, False 0 (only token ids refuse bools)."""
    f = Forest.from_sequences(SEQ, loss_mask=[[False, True, True], torch.tensor([False, True, False])])
    assert f.fields["loss_mask"].tolist() == [0, 1, 1, 0, 1, 0]


def test_with_fields_refuses_what_from_sequences_refuses():
    f = Forest.from_sequences(SEQ)
    with pytest.raises(ValueError, match="field name 'sequences' is reserved"):
        f.with_fields(sequences=[1, 1])
    with pytest.raises(ValueError, match="field name 'self' is reserved"):
        f.with_fields(self=[1, 1])
    with pytest.raises(ValueError, match=r"sequence 0 at position 0 is the string '0'"):
        f.with_fields(a=[["0", "0.5"], 1])


IDS, MASK = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
PADDED_CASES = {
    "sequences field": (dict(sequences=IDS), ValueError, r"field name 'sequences' is reserved"),
    "cls field": (dict(cls=IDS), ValueError, r"field name 'cls' is reserved"),
    "complex field": (dict(a=IDS.to(torch.complex64)), ValueError, r"must hold real numbers, got dtype complex64"),
    "string field": (dict(a=[["1"] * 4] * 2), ValueError, r"must hold real numbers, got dtype <U1"),
    "nan loss_mask": (dict(loss_mask=MASK * float("nan")), ValueError, r"'loss_mask' is nan at row 0, column 1"),
}


@pytest.mark.parametrize("name", PADDED_CASES)
def test_bad_padded_fields(name):
    fields, error, match = PADDED_CASES[name]
    with pytest.raises(error, match=match):
        Forest.from_padded(IDS, MASK, **fields)


def test_bad_padded_ids():
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids, got dtype bool"):
        Forest.from_padded(IDS.bool(), MASK)
    with pytest.raises(ValueError, match=r"input_ids has a token id 9223372036854775808 at row 0, column 1"):
        Forest.from_padded(np.array([[1, 2**63]], dtype=np.uint64), np.ones((1, 2)))
    with pytest.raises(TypeError, match=r"input_ids is a FakeEncoding.*encoding\['input_ids'\]"):
        Forest.from_padded(FakeEncoding(input_ids=IDS, attention_mask=MASK), MASK)
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids, got dtype <U5; .*tokenize first"):
        Forest.from_padded([["hello"]], [[1]])
    with pytest.raises(ValueError, match=r"ragged list"):
        Forest.from_padded([[1, 2], [3]], [[1, 1], [1]])
    with pytest.raises(ValueError, match=r"field name 'cls' is reserved"):
        Forest.from_prompt_completion(IDS, MASK, IDS, MASK, cls=IDS)


# (a line of a JSONL file, a regex of the message after "path:line: ")
JSONL_LINES = {
    "deep 5000": ('{"tokens": ' + "[" * 5000 + "]" * 5000 + "}", r"nested too deeply"),
    "deep 100000": ('{"tokens": ' + "[" * 100_000 + "]" * 100_000 + "}", r"nested too deeply"),
    "field 10**400": ('{"tokens": [1, 2], "a": [1, ' + "1" * 401 + "]}", r"an integer of 401 digits"),
    "a 5000-digit int": ('{"tokens": [1, ' + "1" * 5000 + "]}", r"not valid JSON \(Exceeds the limit"),
    "field 1e400": ('{"tokens": [1, 2], "a": [1, 1e400]}', r"position 1 is inf \(must be finite\)"),
    "field NaN": ('{"tokens": [1, 2], "a": [NaN, 1]}', r"position 0 is nan"),
    "sequences field": ('{"tokens": [1, 2], "sequences": [1, 1]}', r"field name 'sequences' is reserved"),
    "cls field": ('{"tokens": [1, 2], "cls": [1, 1]}', r"field name 'cls' is reserved"),
    "ragged": ('{"tokens": [1, [2]]}', r"sequence 0 must be 1-D .*position 1 holds a list"),
    "2**63": ('{"tokens": [1, 9223372036854775808]}', r"token id 9223372036854775808 .* does not fit in int64"),
    "1e19": ('{"tokens": [1, 1e19]}', r"position 1 is the float 1e\+19"),
    "1e300": ('{"tokens": [1, 1e300]}', r"position 1 is the float 1e\+300"),
    "bool ids": ('{"tokens": [true, false]}', r"position 0 is the bool True"),
    "float ids": ('{"tokens": [1.0, 2.0]}', r"must hold integer token ids: position 0 is the float 1.0"),
    "string field": ('{"tokens": [1, 2], "a": ["1", 1]}', r"the string '1'"),
    "string tokens": ('{"tokens": "hello"}', r"sequence 0 is a string"),
    "null tokens": ('{"tokens": null}', r"sequence 0 is None"),
    "object field": ('{"tokens": [1, 2], "a": {"x": 1}}', r"got a dict"),
    "no tokens": ('{"ids": [1, 2]}', r'an object with a "tokens" list'),
    "not an object": ("[1, 2, 3]", r'an object with a "tokens" list'),
    "duplicate key": ('{"tokens": [1, 2], "tokens": [3]}', r"the key 'tokens' appears twice"),
    "broken JSON": ('{"tokens": [1, 2]', r"not valid JSON"),
    "empty tokens": ('{"tokens": []}', r"sequence 0 is empty"),
}


@pytest.mark.parametrize("name", JSONL_LINES)
def test_bad_jsonl_lines(name, tmp_path):
    line, match = JSONL_LINES[name]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n" + line + "\n", encoding="utf-8")  # line 2: blank lines count
    with pytest.raises(ValueError, match=rf"batch.jsonl:2: .*{match}"):
        Forest.from_jsonl(str(path))


def test_bad_jsonl_files(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"tokens": [1, 2], "n\xe9": [1, 1]}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.jsonl:1: not valid UTF-8 \(byte 0xe9 at column 22\)"):
        Forest.from_jsonl(str(latin))
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_text('{"tokens": [1, 2]}\n', encoding="utf-16")
    with pytest.raises(ValueError, match=r"utf16.jsonl:1: the file is UTF-16-encoded.*iconv"):
        Forest.from_jsonl(str(utf16))
    with pytest.raises(ValueError, match=r"is a directory, not a JSON Lines file"):
        Forest.from_jsonl(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl: no such file"):
        Forest.from_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TypeError, match=r"path must be a file path"):
        Forest.from_jsonl(3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: no sequences found"):
        Forest.from_jsonl(str(empty))
    bom = tmp_path / "bom.jsonl"  # a UTF-8 byte order mark (Windows editors) is fine
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"tokens": [1, 2], "a": 0.5}\n')
    f = Forest.from_jsonl(bom)  # a pathlib.Path works too
    assert f.sequence(0).tolist() == [1, 2] and f.fields["a"].tolist() == [0.5, 0.5]


def test_a_real_batch_encoding():
    """transformers' own BatchEncoding, padded or not: the error says what to pass."""
    from transformers import BatchEncoding

    enc = BatchEncoding({"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])})
    with pytest.raises(TypeError, match=r"sequences is a BatchEncoding .*Forest.from_padded\(encoding\['input_ids'\], "
                                        r"encoding\['attention_mask'\]\)"):
        Forest.from_sequences(enc)
    forest = Forest.from_padded(enc["input_ids"], enc["attention_mask"])  # what the message says works
    assert forest.sequence(0).tolist() == [5, 6]
