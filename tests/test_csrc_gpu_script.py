"""benchmarks/csrc_gpu.py's interleaved timing on CPU (tiny model): every configuration
is warmed up, then timed in rotating rounds; when the configurations' own memory plans
differ, all three are pinned to the default's and the report says so."""

from __future__ import annotations

import pytest
import torch

import dtree
from benchmarks.csrc_gpu import time_interleaved
from benchmarks.csrc_gpu_report import report
from dtree.losses import ppo_clip
from dtree.presets import build_model
from dtree.workloads import make_workload


def _setup():
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    forest = make_workload("grpo", vocab_size=model.config.vocab_size, num_prompts=1, prompt_len=24, group_size=3,
                           answer_len=8)
    return model, forest, ppo_clip(clip_eps=0.2, reduction="token_mean")


def _result(cost: dict) -> dict:
    env = {"device": "cpu", "torch": torch.__version__, "cuda": None, "triton": None, "transformers": "-"}
    return {"env": env, "model": "tiny", "dtype": "float32", "extension": "not built", "steps": 5, "warmup": 1,
            "forests": {"case1": 48}, "cost": {"case1": cost}}


@pytest.mark.slow  # an earlier session's timing harness: ~12 s of the suite on CI
def test_configurations_that_plan_differently_are_pinned_to_the_default_plan():
    model, forest, loss = _setup()
    # the torch-ops configuration asks for smaller calls: its own plan differs from the default's
    forced = {"ops": dtree.RuntimeConfig(group_tokens=16)}
    out = time_interleaved(model, forest, loss, torch.device("cpu"), steps=5, warmup=1, configs=forced)
    assert out["unpinned_plans"]["ops"]["group_tokens"] == 16
    assert out["unpinned_plans"]["ext"]["group_tokens"] == out["unpinned_plans"]["det"]["group_tokens"] > 16
    assert out["pinned"]["group_tokens"] == out["unpinned_plans"]["ext"]["group_tokens"]
    assert out["pinned"]["mode"] == "retain" and out["pinned"]["retain_budget_tokens"] == forest.num_unique_tokens
    assert out["same_plan"]
    for c in out["configs"].values():
        assert len(c["steps_s"]) == 5 and c["min_s"] <= c["median_s"] <= c["max_s"]
        assert {s["plan"]["group_tokens"] for s in c["steps"]} == {out["pinned"]["group_tokens"]}
    assert set(out["kernels"]["totals"]) == {"ext", "ops", "det"}
    assert out["kernels"]["totals"]["det"]["launches"] > 0
    text = report(_result(out))
    assert "pinned to the default's" in text and "one plan in every timed step" in text
    assert "The extension is not in use" in text


def test_configurations_with_one_plan_are_not_pinned():
    model, forest, loss = _setup()
    out = time_interleaved(model, forest, loss, torch.device("cpu"), steps=5, warmup=1)
    assert out["pinned"] is None and out["same_plan"]
    assert out["configs"]["det"]["backend"] == out["configs"]["ext"]["backend"]
    assert set(out["paired"]) == {"ext_vs_ops", "det_vs_ext"}
    assert "pinned to the default's" not in report(_result(out))
