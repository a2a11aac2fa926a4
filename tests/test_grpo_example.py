"""examples/grpo.py end to end, CI-sized: 2 steps of the tiny model with each update
backend, the JSON history and the PNG written, trees deeper than prompt -> answers, and
the two backends agreeing on the first step (same rollouts, same loss)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "grpo.py")


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    grpo = load_example()
    out = {}
    for method in ("dtree", "linearized"):
        prefix = str(tmp_path_factory.mktemp("grpo") / method)
        argv = ["--model", "tiny", "--device", "cpu", "--steps", "2", "--prompts", "2", "--group-size", "6",
                "--max-new", "10", "--method", method, "--out", prefix]
        out[method] = (grpo.main(argv), prefix)
    return out


def test_smoke_history_and_files(runs):
    history, prefix = runs["dtree"]
    assert len(history) == 2
    saved = json.load(open(prefix + ".json"))
    assert saved["history"] == history and saved["info"]["args"]["method"] == "dtree"
    assert os.path.getsize(prefix + ".png") > 10_000
    for row in history:
        for key in ("reward", "kl", "clip_fraction", "entropy", "tokens_per_s", "peak_memory_gb", "compression"):
            assert math.isfinite(row[key]), key
        assert row["compression"] > 1.0  # the prompt is shared by its group
    assert max(r["max_depth"] for r in history) >= 3  # a tool call branched: prompt -> turn -> continuations
    assert max(r["clip_fraction"] for r in history) > 0  # the second update of a batch is off-policy


def test_backends_agree_on_the_first_step(runs):
    a, b = runs["dtree"][0][0], runs["linearized"][0][0]
    assert a["reward"] == b["reward"] and a["linearized_tokens"] == b["linearized_tokens"]  # same rollouts
    for key in ("kl", "clip_fraction", "entropy"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_interrupted_run_keeps_what_it_finished(tmp_path, monkeypatch):
    """Ctrl-C during step 2: the finished step is in <out>.json (written after every
    step), the plot is drawn, and the run exits with 130. The default <out> is under the
    git-ignored ./dtree-results, never the committed examples/results."""
    grpo = load_example()
    assert grpo.DEFAULT_OUT == "dtree-results" and grpo.parse_args([]).out is None
    real, calls = grpo.update_step, [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "update_step", interrupted)
    prefix = str(tmp_path / "run")
    argv = ["--model", "tiny", "--device", "cpu", "--steps", "3", "--prompts", "2", "--group-size", "4",
            "--max-new", "6", "--out", prefix]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    assert exit_info.value.code == 130
    saved = json.load(open(prefix + ".json"))
    assert saved["info"]["interrupted"] is True and [r["step"] for r in saved["history"]] == [0]
    assert os.path.getsize(prefix + ".png") > 10_000
