"""benchmarks/simulate_scaleout.py on a small case: it partitions the mixed batch with
every balancer, scores each partition with one yardstick, and says it is a simulation."""

from __future__ import annotations

import json

import pytest

from benchmarks import simulate_scaleout
from dtree.distributed import CostModel


def test_simulation_report(tmp_path):
    out = tmp_path / "sim.md"
    simulate_scaleout.main(["--ranks", "8", "--strong-ranks", "4", "--out", str(out)])
    text = out.read_text()
    assert "a simulation (CPU only, no GPU)" in text and "Nothing here ran on a GPU" in text
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["batch"], r["world"], r["balancer"], r["split"]) for r in rows] == [
        (b, w, bal, split) for b, w in (("strong", 4), ("weak", 8))
        for bal, split in (("fit", True), ("FLOPs", True), ("tokens", True), ("fit", False))
    ]
    for r in rows:
        assert r["step_s"] >= r["ideal_s"] - 1e-9 and r["step_s"] >= r["longest_sequence_s"] - 1e-9
        assert 0 < r["efficiency"] <= 1 + 1e-9 and r["recompute_s"] >= 0
        assert (r["recompute_tokens"] > 0) == (r["recompute_s"] > 0)
    assert rows[4]["trees"] == 2 * rows[0]["trees"]  # the weak batch grows with W (x W/4)
    # scored by one yardstick, the yardstick's own partition is the best of the three (on these cases)
    for b in ("strong", "weak"):
        steps = {r["balancer"]: r["step_s"] for r in rows if r["batch"] == b and r["split"]}
        assert steps["fit"] <= min(steps.values()) + 1e-9


def test_yardstick_from_a_bench_report(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"calibration": {"values": {"tokens": 1e-5, "attention": 1e-9}},
                                  "env": {"gpu": "NVIDIA H200"}, "setup": {"model": "qwen2.5-1.5b"}}))
    cm, source = simulate_scaleout.load_yardstick(str(report))
    assert cm.coefficients["tokens"] == 1e-5 and "H200" in source
    saved = tmp_path / "cm.json"
    CostModel({"tokens": 2e-5}).save(str(saved))
    assert simulate_scaleout.load_yardstick(str(saved))[0].coefficients["tokens"] == 2e-5
    with pytest.raises(ValueError, match="neither a dtree calibrate JSON"):
        (tmp_path / "bad.json").write_text("{}")
        simulate_scaleout.load_yardstick(str(tmp_path / "bad.json"))
