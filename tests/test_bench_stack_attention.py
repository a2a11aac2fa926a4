"""benchmarks/bench_stack_attention.py runs: the agentic layout and its option cases
(window 4x the path, softcap, sinks) at tiny sizes on the CPU under the Triton
interpreter; its report holds every implementation's agreement with the float32
reference, the deterministic kernel's bitwise repeat, and the windowed kernel's
agreement with SDPA over the in-window keys."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_run_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_stack_attention.py", "--smoke", "--layouts", "agentic",
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "stack_attention_cpu_smoke.md").read_text()
    for case in ("## agentic", "window:", "softcap:", "sinks:"):
        assert case in text, text
    assert "default backward (`DEFAULT_BACKWARD`) is `" in text, text
    for impl in ("triton fused", "triton split", "triton det", "regions (torch)"):
        row = re.search(rf"^\| {re.escape(impl)} \|(.*)$", text, re.M).group(1).split("|")
        errors, bitwise = row[-3], row[-2].strip()
        assert max(float(e) for e in errors.split("/")) < 1e-5, text
        assert bitwise == "yes", text
    diff = float(re.search(r"in-window keys\| of the forward outputs: window ([0-9.]+e[+-][0-9]+)", text).group(1))
    assert diff < 1e-5, text
