"""benchmarks/hybrid_gpu.py in SMOKE mode (CPU, tiny models): every part runs (the kernel
check with the chunked backend, the bf16 model checks against HF per path, the
benchmark of dtree against linearized with tree-mask reported not applicable) and the
reports are written; wheels given on the command line land on ``sys.path``."""

from __future__ import annotations

import json
import sys
import zipfile

from benchmarks.hybrid_gpu import load_wheels, main


def test_smoke_run_checks_and_reports(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hybrid_gpu.json", "hybrid_gpu.md"]
    results = json.loads((tmp_path / "hybrid_gpu.json").read_text())
    assert {(r["kernel"], r["tensor"]) for r in results["kernels"]} >= {("gdn", "dinitial"), ("ssd", "final")}
    assert {(r["model"], r["setting"]) for r in results["models"]} == {
        (m, s) for m in ("qwen3.5", "nemotron_h") for s in ("default", "calls", "recompute")
    }
    assert all(r["ok"] for r in results["kernels"] + results["models"])
    assert results["backend"] == "chunked"
    assert {r["recurrence"] for r in results["models"]} == {"chunked"}
    assert all(r["worst_err"] >= 0 and r["worst_hf_bf16_err"] >= 0 and r["worst_hf_bf16_err_reordered"] >= 0
               and r["worst_bf16_rounding"] >= 0
               for r in results["models"])
    assert results["packing"]["packed_ms"] > 0 and results["packing"]["per_segment_ms"] > 0
    runs = results["benchmark"]["runs"]
    assert {(r["workload"], r["method"]) for r in runs} == {
        (w, m) for w in ("agentic", "grpo") for m in ("dtree", "linearized")
    }
    assert all(r["status"] == "ok" and r["step_time_s"] > 0 for r in runs)
    # dtree runs the chosen backend; linearized its auto (on CPU the reference, on CUDA the same as dtree)
    assert {r["method"]: r["recurrence"] for r in runs} == {"dtree": "chunked", "linearized": "reference"}
    for r in runs:
        if r["method"] == "dtree":
            assert r["speedup"] > 0 and r["flop_compression"] > 1
    assert results["benchmark"]["params"] > 0 and results["benchmark"]["flops_per_token"] > 0
    assert results["benchmark"]["tree_mask"].startswith("not applicable: ")
    report = (tmp_path / "hybrid_gpu.md").read_text()
    assert "## 3. Benchmark" in report and "FAIL" not in report and "Mask-based methods: not applicable" in report
    assert "checks pass" in capsys.readouterr().out


def test_wheels_are_put_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    wheel = tmp_path / "dtree_probe_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("dtree_probe_pkg/__init__.py", "VALUE = 7\n")
    (found,) = load_wheels(str(tmp_path))
    assert found["wheel"] == wheel.name and found["MB"] >= 0
    import dtree_probe_pkg

    assert dtree_probe_pkg.VALUE == 7
    sys.modules.pop("dtree_probe_pkg")
    assert load_wheels(str(tmp_path / "missing")) == []
