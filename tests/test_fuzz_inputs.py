"""A seeded fuzz over malformed inputs (tests/fuzz_inputs.py and tests/fuzz_padded.py
generate them): every failure is a ValueError or TypeError raised by dtree itself,
naming the sequence, row, field, or file and line (never a raw numpy, json, Attribute,
Overflow or Recursion error); nothing malformed is accepted and everything valid is,
exactly;
``forward_backward`` misuse leaves ``param.grad`` untouched; the CLI answers a malformed
file with exit code 2 and one ``dtree <cmd>: error:`` line.

The default run is a seeded subset (derandomized hypothesis, as CI runs it);
``-m slow`` runs the larger sweep of the same properties."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from fuzz_inputs import (
    JSONL_MUTATIONS,
    MUTATIONS,
    Encoding,
    assert_dtree_error,
    check_forest_case,
    check_jsonl_case,
    jsonl_cases,
    mutated_batches,
)
from fuzz_padded import PADDED_MUTATIONS, check_padded_case, padded_cases
from hf_models import make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from setups import assert_grads_equal, grads_of

import dtree
from dtree.cli import main

# examples per mutation kind: the default (CI) run, and the -m slow sweep
DEFAULT, SWEEP = 15, 300
KINDS = ("none",) + MUTATIONS


SIZES = [pytest.param(DEFAULT, id="ci"), pytest.param(SWEEP, id="sweep", marks=pytest.mark.slow)]


def fuzz(cases, check, examples: int) -> None:
    """``check`` on ``examples`` draws of the strategy ``cases`` (seeded by the profile)."""
    settings(max_examples=examples)(given(cases)(check))()


@pytest.mark.parametrize("examples", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_from_sequences(kind, examples):
    fuzz(mutated_batches(kind), check_forest_case, examples)


def _jsonl(case) -> str:
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    with os.fdopen(fd, "wb") as f:
        f.write(case.content)
    return path


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


def check_jsonl_and_cli(case) -> None:
    path = _jsonl(case)
    try:
        check_jsonl_case(case, path)
        rc, err = _cli(["stats", path])
        if case.broken:
            lines = err.splitlines()
            assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"dtree stats: error: {path}"), (rc, err)
        else:
            assert rc == 0 and not err, (rc, err)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("examples", SIZES)
@pytest.mark.parametrize("kind", JSONL_MUTATIONS)
def test_fuzz_jsonl_and_cli(kind, examples):
    fuzz(jsonl_cases(kind), check_jsonl_and_cli, examples)


@pytest.mark.parametrize("examples", SIZES)
@pytest.mark.parametrize("kind", PADDED_MUTATIONS)
def test_fuzz_from_padded(kind, examples):
    fuzz(padded_cases(kind), check_padded_case, examples)


# ----------------------------------------------------------------------------- forward_backward
MODEL = make_model("llama", max_positions=64)
GOOD = dtree.Forest.from_sequences([[1, 2, 3, 4], [1, 2, 5], [7, 8]], advantages=[1.0, -1.0, 0.5])
FORESTS = {
    "forest": GOOD, "list": [[1, 2, 3]], "None": None, "string": "1 2 3", "tensor": torch.ones(2, 3, dtype=torch.long),
    "encoding": Encoding(input_ids=[[1, 2]]), "number": 3,
}
LOSSES = {
    "nll": dtree.losses.nll(), "ppo without old_logprobs": dtree.losses.ppo_clip(), "uncalled nll": dtree.losses.nll,
    "uncalled ppo_clip": dtree.losses.ppo_clip, "uncalled cispo": dtree.losses.cispo,
    "uncalled sapo": dtree.losses.sapo,
    "uncalled gspo": dtree.losses.gspo, "TokenLoss class": dtree.losses.TokenLoss, "aggregation dict":
    dtree.losses.aggregation("grpo"), "None": None, "number": 1.0, "one-argument lambda": lambda lps: lps[0].sum(),
    "numpy terms": dtree.losses.TokenLoss(lambda lp, f: (-lp).detach().numpy()),
    "detached terms": dtree.losses.TokenLoss(lambda lp, f: (-lp).detach()),
    "undeclared field": dtree.losses.TokenLoss(lambda lp, f: -lp * f["advantages"]),
    "missing field": dtree.losses.TokenLoss(lambda lp, f: -lp * f["nope"]),
    "scalar terms": dtree.losses.TokenLoss(lambda lp, f: (-lp).sum()),
    "two-pass detached": lambda lps, f: sum(lp.sum() for lp in lps).detach(),
    "two-pass": lambda lps, f: -sum(lp.sum() for lp in lps),
}
VALID = {("forest", "nll"), ("forest", "two-pass")}
NORMS = {
    "none": None, "dict": {"loss_tokens": 4.0}, "string": "global", "number": 4.0,
    "counts": dtree.Normalization(6.0, 3.0, 3.0), "zero": dtree.Normalization(0.0, 0.0, 0.0),
}


@settings(max_examples=60)
@given(forest=st.sampled_from(sorted(FORESTS)), loss=st.sampled_from(sorted(LOSSES)),
       norm=st.sampled_from(sorted(NORMS)), grad_mode=st.booleans())
def test_fuzz_forward_backward(forest, loss, norm, grad_mode):
    """Random combinations of arguments: the valid ones run; every other one is refused by
    dtree with param.grad exactly as it was (two-pass callables take no normalization)."""
    rt = dtree.TreeRuntime(MODEL)
    before = grads_of(MODEL)
    valid = (forest, loss) in VALID and grad_mode and (norm == "none" or (norm == "counts" and loss == "nll"))
    try:
        with torch.set_grad_enabled(grad_mode):
            rt.forward_backward(FORESTS[forest], LOSSES[loss], normalization=NORMS[norm])
    except BaseException as e:  # noqa: BLE001 -- judged below
        assert not valid, f"a valid call was refused: {type(e).__name__}: {e}"
        assert_dtree_error(e)
        assert_grads_equal(MODEL, before)
        return
    assert valid, f"accepted forest={forest} loss={loss} normalization={norm} grad_mode={grad_mode}"


STATS, BENCH = ["stats"], ["bench", "--no-report", "--data"]


@pytest.mark.parametrize("argv,content", [(STATS, "deep"), (BENCH, "deep"), (STATS, "directory"), (BENCH, "huge"),
                                          (STATS, "reserved")])
def test_cli_malformed_files_in_a_process(argv, content, tmp_path):
    """The issue's files in a real process: exit code 2, one error line, no traceback
    (``dtree bench --data`` reads the file before it builds a model; tests/test_cli.py
    runs every file through both commands in process)."""
    path = tmp_path / "batch.jsonl"
    text = {
        "deep": '{"tokens": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        "huge": '{"tokens": [1, 2], "a": [1, ' + "1" * 401 + "]}\n",
        "reserved": '{"tokens": [1, 2], "sequences": [1, 1]}\n',
    }.get(content)
    if text is None:
        path = tmp_path
    else:
        path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "dtree", *argv, str(path)], capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"dtree {argv[0]}: error: "), r.stderr
    assert "Traceback" not in r.stderr
