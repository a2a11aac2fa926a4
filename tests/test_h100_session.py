"""benchmarks/h100_session.sh in SMOKE mode (CPU, tiny model, small shapes): parts run
under their limits, append to summary.md and end in one results.tgz."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "h100_session.sh")


def _run(tmp_path, *parts, timeout=600):
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run(["bash", SCRIPT, *parts], env=env, capture_output=True, text=True, timeout=timeout)


def test_session_parts_bundle_their_reports(tmp_path):
    r = _run(tmp_path, "env", "nope")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["results.tgz", "session.log", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## env: rc=0" in summary and "torch " in summary
    assert "## nope: rc=1" in summary and "unknown part nope" in r.stdout  # a failed part is reported, the rest run
    with tarfile.open(tmp_path / "results.tgz") as tar:
        names = tar.getnames()
    assert "results/env/env.txt" in names


@pytest.mark.slow
def test_every_part_in_smoke_mode(tmp_path):
    parts = ["bench-case1", "bench-agentic64k", "bench-agentic", "bench-grpo", "warmup", "memory", "memscale", "issue11"]
    r = _run(tmp_path, *parts, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for p in parts:
        assert f"## {p}: rc=0" in summary, p


@pytest.mark.slow
def test_issue17_parts_in_smoke_mode(tmp_path):
    """The two device commands of issue 17 (i17a, i17b) run their parts on CPU."""
    r = _run(tmp_path, "i17a", "i17b", timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for p in ("i17-tests", "i17-64k", "i17-case1", "i17-7b", "i17-between", "i17-128k", "i17-256k", "i17-calls"):
        assert f"## {p}: rc=0" in summary, p
    assert "the same for every method: dtree lean layers" in summary and "free_after_step=True" in summary
