"""benchmarks/kernel_session.sh in SMOKE mode (CPU: the CPU tests of the new code, the
tiny model, the interpreter): every part runs under its limit and reports its exit
code, an unknown part is reported and the rest still run, and without flash-attn-4
the step drops its flash-attn configuration and says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernel_session.sh")


def _run(tmp_path, *parts, timeout=600):
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", SCRIPT, *parts], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r, (tmp_path / "session.log").read_text()


@pytest.mark.slow  # an earlier session's script: ~14 s of the suite on CI
def test_env_tests_step_parts(tmp_path):
    r, log = _run(tmp_path, "env", "tests", "step", "nope")
    for part in ("env", "tests", "step"):
        assert f"=== {part} rc=0" in log, log[-3000:]
    assert "DEFAULT_BACKWARD" in log and "unknown part nope" in r.stdout
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError:
        assert "flash-attn-4 absent" in log and "flash-attn configuration is skipped" in log
    assert any(name.endswith("_kernel.md") for name in os.listdir(tmp_path))


@pytest.mark.slow
def test_bench_part(tmp_path):
    pytest.importorskip("triton")
    _, log = _run(tmp_path, "bench")
    assert "=== bench-32x8 rc=0" in log and "=== bench-12x2 rc=0" in log
    text = (tmp_path / "stack_attention_cpu_smoke_12x2.md").read_text()
    for impl in ("triton fused", "triton split", "triton det"):
        assert f"| {impl} |" in text
