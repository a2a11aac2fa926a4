"""benchmarks/bench_memory_scaling.py on CPU with the tiny model: both sweeps, each
configuration stopped at its first out-of-memory or step over its cap, the global time
budget, and the reports."""

from __future__ import annotations

import json

from benchmarks.bench_memory_scaling import main

SMALL = ["--model", "tiny", "--device", "cpu", "--branches", "2,3", "--prompt-len", "24", "--answer-len", "6",
         "--tree-sizes", "200,260", "--set-tree", "system_prompt_len=64", "--set-tree", "turn_len=4,24",
         "--set-tree", "turn_len_median=8"]


def _report(out) -> dict:
    (path,) = out.glob("memory_scaling_*.json")
    return json.loads(path.read_text())


def test_sweeps_stop_each_configuration_at_its_limit(tmp_path):
    huge = "dtree:stack_capacity=17592186044416"  # its KV stack cannot be allocated: a real allocator failure
    assert main([*SMALL, "--configs", f"dtree,{huge},tree-mask:whole+ckpt,linearized", "--step-cap", "linearized=0",
                 "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    cells = {(c["sweep"], c["point"], c["config"]): c for c in report["cells"]}
    for sweep, points in (("branches", ("G=2", "G=3")), ("tree", ("200", "260"))):
        for p in points:
            assert cells[(sweep, p, "dtree")]["status"] == "ok"
            assert cells[(sweep, p, "tree-mask:whole+ckpt")]["status"] == "ok"
        first, second = points
        assert cells[(sweep, first, huge)]["status"] == "oom"
        assert cells[(sweep, second, huge)]["status"] == "skipped"
        assert cells[(sweep, second, huge)]["note"] == f"oom at {first}"
        assert cells[(sweep, first, "linearized")]["status"] == "over-cap"  # ran, slower than its 0 s cap
        assert cells[(sweep, second, "linearized")]["status"] == "skipped"
    tree = [c for c in report["cells"] if c["sweep"] == "tree" and c["config"] == "dtree"]
    assert all(c["unique_tokens"] >= c["size"] for c in tree)
    assert tree[1]["unique_tokens"] > tree[0]["unique_tokens"]
    md = next(tmp_path.glob("*.md")).read_text()
    assert "## Branches (GRPO)" in md and "## Tree size (agentic)" in md and "**OOM**" in md
    assert "largest trained" in md and "torch " in md
    assert next(tmp_path.glob("*.png")).stat().st_size > 0


def test_time_budget_skips_cleanly(tmp_path):
    assert main([*SMALL, "--configs", "dtree,linearized", "--time-budget", "0", "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert {c["status"] for c in report["cells"]} == {"skipped"}
    assert all("time budget" in c["note"] for c in report["cells"])
    assert "time budget spent" in next(tmp_path.glob("*.md")).read_text()
