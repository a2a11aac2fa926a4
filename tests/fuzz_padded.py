"""Generators of malformed padded batches for tests/test_fuzz_inputs.py (the oracle and
the junk values are tests/fuzz_inputs.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fuzz_inputs import Encoding, assert_dtree_error
from hypothesis import strategies as st

import dtree


@dataclass
class PaddedCase:
    input_ids: Any
    attention_mask: Any
    fields: dict
    rows: list[list[int]]
    broken: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


PADDED_MUTATIONS = ("none", "ids dtype", "negative id", "hole", "empty row", "mask value", "mask shape", "nan field",
                    "field shape", "field dtype", "loss on padding", "reserved", "ids kind")


@st.composite
def padded_cases(draw, first: str) -> PaddedCase:
    """Rows with left and/or right padding (junk ids and NaN fields on the padding are
    fine: padding is never read), with the mutation ``first`` (``"none"``: valid)."""
    b, length = draw(st.integers(1, 4)), draw(st.integers(2, 7))
    ids = np.array(draw(st.lists(st.integers(-5, 100), min_size=b * length, max_size=b * length))).reshape(b, length)
    mask = np.zeros((b, length), dtype=np.int64)
    rows = []
    for r in range(b):
        lo = draw(st.integers(0, length - 1))
        hi = draw(st.integers(lo + 1, length))
        mask[r, lo:hi] = 1
        ids[r, lo:hi] = np.abs(ids[r, lo:hi])
        rows.append(ids[r, lo:hi].tolist())
    adv = np.where(mask == 1, 0.5, np.nan)
    case = PaddedCase(torch.tensor(ids), torch.tensor(mask), {"loss_mask": mask.astype(float), "advantages": adv}, rows)
    if first != "none":
        _mutate_padded(draw, case, mask, first)
    return case


def _host(x) -> np.ndarray:
    """A writable numpy copy (tensors through .numpy(): no __array__ deprecation warning)."""
    return x.numpy().copy() if isinstance(x, torch.Tensor) else np.array(x)


def _mutate_padded(draw, case: PaddedCase, mask: np.ndarray, kind: str) -> None:
    real = np.argwhere(mask == 1)
    r, c = (int(v) for v in real[draw(st.integers(0, len(real) - 1))])
    ids = _host(case.input_ids)
    if kind == "ids dtype":
        case.input_ids = draw(st.sampled_from([torch.tensor(ids, dtype=torch.float32), torch.tensor(ids > 0),
                                                ids.astype(np.float64), ids.astype(str).tolist()]))
        case.names.append("input_ids")
    elif kind == "negative id":
        ids[r, c] = draw(st.sampled_from([-1, -(2**40)]))
        case.input_ids = torch.tensor(ids)
        case.names.append(f"row {r}")
    elif kind == "hole":
        cols = np.flatnonzero(mask[r])
        if len(cols) < 3:
            return
        m = _host(case.attention_mask)
        m[r, cols[1]] = 0
        case.attention_mask = m
        case.names.append(f"row {r}")
    elif kind == "empty row":
        m = _host(case.attention_mask)
        m[r] = 0
        case.attention_mask = m
        case.names.append(f"row {r}")
    elif kind == "mask value":
        m = _host(case.attention_mask).astype(float)
        m[r, c] = draw(st.sampled_from([2.0, -1.0, np.nan, 0.5]))
        case.attention_mask = m
        case.names.append(f"row {r}")
    elif kind == "mask shape":
        case.attention_mask = np.ones((mask.shape[0], mask.shape[1] + 1))
        case.names.append("attention_mask")
    elif kind == "nan field":
        a = _host(case.fields["advantages"])
        a[r, c] = draw(st.sampled_from([np.nan, np.inf]))
        case.fields["advantages"] = a
        case.names.append(f"row {r}")
    elif kind == "field shape":
        case.fields["advantages"] = np.zeros((mask.shape[0] + 1,))
        case.names.append("advantages")
    elif kind == "field dtype":
        case.fields["advantages"] = draw(st.sampled_from([np.zeros(mask.shape, dtype=complex),
                                                          np.full(mask.shape, "1"), [[0.5, [1]]]]))
        case.names.append("advantages")
    elif kind == "loss on padding":
        pads = np.argwhere(mask == 0)
        if not len(pads):
            return
        lm = _host(case.fields["loss_mask"])
        pr, pc = (int(v) for v in pads[draw(st.integers(0, len(pads) - 1))])
        lm[pr, pc] = 1.0
        case.fields["loss_mask"] = lm
        case.names.append(f"row {pr}")
    elif kind == "reserved":
        case.fields[draw(st.sampled_from(["sequences", "cls", "tokens", "self"]))] = case.fields.pop("advantages")
        case.names.append("reserved")
    else:
        case.input_ids = draw(st.sampled_from([ids[0], Encoding(input_ids=ids), None, "1 2 3"]))
        case.names.append("input_ids")
    case.broken.append(kind)


def check_padded_case(case: PaddedCase) -> None:
    try:
        forest = dtree.Forest.from_padded(case.input_ids, case.attention_mask, **case.fields)
    except BaseException as e:  # noqa: BLE001 -- the oracle judges every exception
        assert case.broken, f"a valid padded batch was refused: {type(e).__name__}: {e}"
        assert_dtree_error(e)
        assert any(n in str(e) for n in case.names + ["input_ids", "attention_mask"]), f"{case.names}: {e}"
        return
    assert not case.broken, f"accepted a padded batch with a {case.broken} mutation"
    assert [s.tolist() for s in forest.sequences()] == case.rows
