"""``dtree bench`` on CPU with the tiny model: fresh forests per step, configurations of
one method side by side, the best configuration of each method, same-forest mode, time
budget and out-of-memory handling, and the reports it writes."""

from __future__ import annotations

import json

import pytest
import torch

from dtree.bench.configs import PRESETS, best_per_method, parse_configs
from dtree.cli import main

TINY_GRPO = ["--set", "num_prompts=1", "--set", "prompt_len=16,32", "--set", "group_size=3", "--set", "answer_len=4,8"]


def _run(tmp_path, *args) -> dict:
    rc = main(["bench", "--model", "tiny", "--device", "cpu", "--out", str(tmp_path), *TINY_GRPO, *args])
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    report["_rc"] = rc
    return report


def test_parse_configs():
    configs = parse_configs("dtree,tree-mask:whole+ckpt,tree-mask:split16k,linearized:ckpt+split4k,dtree:recompute")
    got = {c.label: (c.method, c.options) for c in configs}
    assert got == {
        "dtree": ("dtree", {}),
        "tree-mask:whole+ckpt": ("tree-mask", {"max_tokens_per_batch": None, "checkpoint": True}),
        "tree-mask:split16k": ("tree-mask", {"max_tokens_per_batch": 16384}),
        "linearized:ckpt+split4k": ("linearized", {"checkpoint": True, "max_tokens_per_batch": 4096}),
        "dtree:recompute": ("dtree", {"mode": "recompute"}),
    }
    assert parse_configs("dtree:low")[0].options == {"memory": "low"}
    assert "dtree:low" in PRESETS["gpu"] and PRESETS["gpu"][0] == "dtree"
    assert parse_configs("tree-mask")[0].options == {"max_tokens_per_batch": 32768}  # the method's defaults
    assert [c.label for c in parse_configs("gpu,dtree")] == list(PRESETS["gpu"])  # presets expand, duplicates drop
    assert parse_configs("dtree:group_tokens=4096", {"dtree": {"mode": "recompute"}})[0].options == {
        "mode": "recompute", "group_tokens": 4096,
    }
    for bad, match in [("dtree:ckpt", "recompute"), ("linearized:whole", "tree-mask"), ("tree-mask:recompute", "ckpt"),
                       ("tree-mask:low", "ckpt"),
                       ("foo", "unknown method"), ("tree-mask:splitx", "token count"), ("dtree:bogus", "unknown")]:
        with pytest.raises(ValueError, match=match):
            parse_configs(bad)


def test_best_per_method_skips_what_did_not_fit():
    rows = [
        {"method": "tree-mask", "config": "a", "status": "ok", "step_time_s": 2.0},
        {"method": "tree-mask", "config": "b", "status": "oom", "step_time_s": None},
        {"method": "tree-mask", "config": "c", "status": "ok", "step_time_s": 1.5},
        {"method": "linearized", "config": "d", "status": "error", "step_time_s": None},
    ]
    assert {m: r["config"] for m, r in best_per_method(rows).items()} == {"tree-mask": "c"}


def test_fresh_forests_and_configurations(tmp_path):
    report = _run(tmp_path, "--steps", "3",
                  "--configs", "dtree,dtree:recompute,tree-mask:whole+ckpt,tree-mask:split16,linearized:ckpt")
    assert report["_rc"] == 0 and report["protocol"] == "fresh-forests"
    seeds = [f["seed"] for f in report["workload"]["forests"]]
    assert seeds == [0, 1, 2]
    assert len({f["unique_tokens"] for f in report["workload"]["forests"]}) > 1  # a fresh forest each step
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == ["dtree", "dtree:recompute", "tree-mask:whole+ckpt", "tree-mask:split16", "linearized:ckpt"]
    for r in rows.values():
        assert r["status"] == "ok" and len(r["step_times_s"]) == 3
        assert r["first_step_s"] == r["step_times_s"][0] and r["second_step_s"] == r["step_times_s"][1]
        assert r["steady_steps"] == [2] and r["step_time_s"] == r["steady_max_s"] == r["step_times_s"][2]
        assert r["tokens_per_s"] == pytest.approx(report["workload"]["forests"][2]["unique_tokens"] / r["step_time_s"])
    assert rows["tree-mask:split16"]["metrics"]["split_trees"] == 1
    assert rows["tree-mask:whole+ckpt"]["metrics"]["checkpoint"] is True
    # every configuration trains the same forests: the same losses, step by step
    assert report["loss_agreement"] < 1e-5
    assert rows["linearized:ckpt"]["speedup_vs_linearized"] == pytest.approx(1.0)
    assert set(report["best"]) == {"dtree", "tree-mask", "linearized"}
    assert {v["method"] for v in report["vs_best"]} == {"dtree", "tree-mask", "linearized"}
    assert all(v["dtree"] == "dtree" for v in report["vs_best"])  # dtree's default is the reference
    md = next(tmp_path.glob("*.md")).read_text()
    assert "## Best configuration of each method" in md and "## Step times (s)" in md
    assert "torch " in md and "num_prompts" in md and "hidden 128" in md
    assert next(tmp_path.glob("*.png")).stat().st_size > 0


def test_same_forest_mode(tmp_path):
    report = _run(tmp_path, "--same-forest", "--warmup", "0", "--repeats", "2", "--methods", "dtree,tree-mask")
    assert report["protocol"] == "same-forest" and len(report["workload"]["forests"]) == 1
    assert [len(r["step_times_s"]) for r in report["results"]] == [2, 2]
    assert report["loss_agreement"] < 1e-5
    assert "median of 2 steps after 0 warm-up" in next(tmp_path.glob("*.md")).read_text()


def test_accumulate_keeps_the_gradients_after_the_first_step(tmp_path, monkeypatch):
    """--accumulate: gradients cleared before a configuration's first step only; the baselines
    accumulate in place (grad_guard=False), dtree keeps its default unless a configuration sets it."""
    from dtree.bench import measure

    starts = []
    step = measure.timed_step

    def recording(runner, forest, loss, model, device, **kw):
        starts.append(kw.get("zero_grad", True) or next(model.parameters()).grad is None)
        return step(runner, forest, loss, model, device, **kw)

    monkeypatch.setattr(measure, "timed_step", recording)
    report = _run(tmp_path, "--steps", "3", "--accumulate", "--configs", "dtree,dtree:grad_guard=False,tree-mask")
    assert report["_rc"] == 0 and report["accumulate"] is True
    assert starts == [True, False, False] * 3  # cleared (or empty) at each configuration's first step only
    rows = {r["config"]: r for r in report["results"]}
    assert rows["tree-mask"]["options"]["grad_guard"] is False and "grad_guard" not in rows["dtree"]["options"]
    assert rows["dtree:grad_guard=False"]["options"]["grad_guard"] is False
    assert report["loss_agreement"] < 1e-5
    assert "gradients accumulated" in next(tmp_path.glob("*.md")).read_text()


def test_out_of_memory_and_time_budget(tmp_path):
    """A configuration whose allocation fails is reported as oom and the next one still
    runs; with no time left, configurations are reported as skipped."""
    report = _run(tmp_path, "--steps", "2", "--configs", "dtree:stack_capacity=17592186044416,tree-mask")
    oom, ok = report["results"]
    assert oom["status"] == "oom" and "step 1" in oom["error"] and oom["step_times_s"] == []
    assert ok["status"] == "ok" and len(ok["step_times_s"]) == 2
    report = _run(tmp_path, "--steps", "2", "--time-budget", "0", "--configs", "dtree,tree-mask")
    assert report["_rc"] == 1
    assert [r["status"] for r in report["results"]] == ["skipped", "skipped"]
    assert "time budget" in report["results"][0]["note"]


def test_expandable_segments_for_the_bench_process(monkeypatch):
    """On a GPU the bench runs its process with expandable segments (every method alike),
    set before CUDA initializes; an existing allocator config is kept and extended."""
    import torch

    from dtree.bench.measure import use_expandable_segments
    from dtree.plan.memory_policy import expandable_segments

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert use_expandable_segments() == "max_split_size_mb:512,expandable_segments:True"
    assert expandable_segments()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert use_expandable_segments() == "expandable_segments:False"  # the user's choice stands
    assert not expandable_segments()


def test_report_shows_allocated_and_reserved_peaks(tmp_path):
    report = _run(tmp_path, "--steps", "3", "--configs", "dtree,dtree:low")
    assert report["_rc"] == 0
    md = next(tmp_path.glob("*.md")).read_text()
    assert "peak alloc (GiB)" in md and "peak reserved (GiB)" in md and "CUDA allocator" in md
    low = next(r for r in report["results"] if r["config"] == "dtree:low")
    assert low["metrics"]["memory_plan"]["checkpoint_layers"] == 4  # the tiny preset's layers, all checkpointed


def test_wording_and_of_ideal():
    """dtree's default against each best configuration is said in words ("1.59x
    slower", never "0.63x faster"); of ideal applies to the tree methods only, and a
    value above 100% is explained in a line of its own."""
    from dtree.bench.report import faster_or_slower, finish_report

    assert faster_or_slower(1.0 / 0.63) == "1.59x faster" and faster_or_slower(0.63) == "1.59x slower"
    ideal = 2.0

    def row(method, config, t):
        return {"method": method, "config": config, "status": "ok", "step_time_s": t, "ideal_speedup": ideal,
                "options": {} if config == method else {"x": 1}, "peak_mem_gib": None}

    report = {"protocol": "same-forest", "results": [row("linearized", "linearized", 3.2), row("dtree", "dtree", 1.59),
                                                     row("tree-mask", "tree-mask", 1.0)]}
    finish_report(report)
    rows = {r["config"]: r for r in report["results"]}
    assert rows["linearized"]["fraction_of_ideal"] is None  # the compression bounds the tree methods only
    assert rows["tree-mask"]["fraction_of_ideal"] == pytest.approx(1.6)
    lines = "\n".join(report["summary_lines"])
    assert "dtree vs the best tree-mask (tree-mask): 1.59x slower" in lines and "0.63x" not in lines
    assert "tree-mask reached 160% of the ideal speedup" in lines and "1.60x as fast as the best linearized" in lines


def test_steady_steps_leave_out_a_recompiled_step_on_both_sides():
    """A steady step over OUTLIER_FACTOR x the median of steps 3..N (session AB: the mask's
    FlexAttention recompiled on the sixth of eight forests, 12.1 s against ~2.7 s) is left out of
    that configuration's steady figures, and the speedup counts only the steps both kept; the
    report names it. Two steady steps are too few to call one an outlier."""
    from dtree.bench.measure import MethodResult, StepForest, _summarize_steps
    from dtree.bench.steady import outlier_note, steady_ratio, steady_split
    from dtree.workloads import make_workload

    mask_times = [22.0, 13.873, 2.584, 2.734, 2.713, 12.112, 2.661, 2.675]
    low_times = [22.598, 2.608, 2.297, 2.237, 2.375, 2.163, 2.116, 2.109]
    assert steady_split(mask_times) == ([2, 3, 4, 6, 7], [5])
    assert steady_split(low_times) == ([2, 3, 4, 5, 6, 7], [])
    assert steady_split([9.0, 5.0, 1.0, 3.0]) == ([2, 3], [])  # too few steady steps to judge
    forests = [StepForest(i, make_workload("grpo", seed=i, vocab_size=64, num_prompts=1, prompt_len=8, group_size=2,
                                           answer_len=4), 1.0, 2.0) for i in range(len(mask_times))]
    rows = {}
    for name, times in (("mask", mask_times), ("low", low_times)):
        r = MethodResult(method=name, status="ok", step_times_s=times, step_losses=[0.0] * len(times),
                         step_calls=[1] * len(times), step_peak_mem_gib=[1.0] * len(times))
        _summarize_steps(r, forests, None)
        rows[name] = r.as_dict()
    mask = rows["mask"]
    assert mask["steady_outliers"] == [5] and mask["steady_max_s"] == 2.734
    assert mask["step_time_s"] == pytest.approx(sum(mask_times[i] for i in (2, 3, 4, 6, 7)) / 5)
    kept = (2, 3, 4, 6, 7)  # the low side's sixth step goes too: the same forests on both sides
    want = sum(mask_times[i] for i in kept) / sum(low_times[i] for i in kept)
    assert steady_ratio(mask, rows["low"]) == pytest.approx(want) and 1.19 < want < 1.21
    (note,) = [line for line in outlier_note(list(rows.values())) if line]
    assert "`mask`: step 6 (12.112 s)" in note and "`low`" not in note


def test_default_output_is_git_ignored():
    """dtree bench (and examples/grpo.py) write to ./dtree-results by default, which the
    checkout's .gitignore lists: a default run never overwrites committed reports."""
    import os
    import subprocess

    from dtree.bench.runner import DEFAULT_OUT
    from dtree.cli import build_parser

    assert build_parser().parse_args(["bench"]).out == DEFAULT_OUT == "dtree-results"
    root = os.path.join(os.path.dirname(__file__), "..")
    if not os.path.exists(os.path.join(root, ".git")):
        pytest.skip("not a git checkout")
    for path in ("dtree-results/cpu_tiny_grpo.json", "examples/dtree-results/grpo_tiny_dtree.json"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=root)
        assert r.returncode == 0, f"{path} is not git-ignored"




def test_every_method_runs_the_same_layers_and_the_report_says_which(tmp_path):
    """``--layers auto`` (default) gives the model dtree's lean layers once, before any
    method, and its rotary kernel for the run (the tiny preset is a Qwen2); ``eager``
    keeps HF's; the report names them."""
    from dtree.bench.layers import apply_layers
    from dtree.presets import build_model

    from transformers.models.qwen2 import modeling_qwen2

    original = modeling_qwen2.apply_rotary_pos_emb
    report = _run(tmp_path, "--steps", "2", "--configs", "dtree,tree-mask,linearized")
    assert report["_rc"] == 0 and report["layers"].startswith("dtree lean layers (qwen2): RMSNorm x9, SwiGLU MLP x4")
    assert "rotary: dtree's kernel (transformers.models.qwen2.modeling_qwen2" in report["layers"]
    assert modeling_qwen2.apply_rotary_pos_emb is original  # HF's again after the run
    assert "the same for every method: dtree lean layers" in next(tmp_path.glob("*.md")).read_text()
    assert len({round(r["loss"], 4) for r in report["results"]}) == 1  # one model, the same layers
    eager = _run(tmp_path / "eager", "--steps", "2", "--configs", "dtree", "--layers", "eager")
    assert eager["layers"].startswith("eager")
    assert eager["configs"][0]["options"] == {"lean_layers": False}  # dtree runs them too, not its lean default
    with pytest.raises(ValueError, match="a CUDA device is needed"):
        apply_layers(build_model("tiny"), "liger", torch.device("cpu"))
    with pytest.raises(ValueError, match="must be one of"):
        apply_layers(build_model("tiny"), "fast", torch.device("cpu"))


def test_mixed_workload(tmp_path):
    """``--workload mixed``: the three shapes in one batch, at the CPU size."""
    rc = main(["bench", "--model", "tiny", "--device", "cpu", "--out", str(tmp_path), "--workload", "mixed",
               "--methods", "dtree", "--steps", "1"])
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    assert rc == 0 and report["workload"]["name"] == "mixed (cpu size)"
    assert report["workload"]["forests"][0]["trees"] == 3  # one tree of each kind
    assert report["workload"]["params"]["search_args"]["depth"] == 4
