"""benchmarks/profile_warmup.py and benchmarks/profile_memory.py on CPU (tiny model):
the reports they write, and the pieces that only produce numbers on a GPU (the replay of
an allocator trace to its peak, the parsing of Triton's autotuning messages)."""

from __future__ import annotations

import json

import pytest
import torch

import dtree
from benchmarks import profile_memory, profile_warmup

TINY_TREE = ["--set", "num_trees=1", "--set", "target_unique_tokens=300", "--set", "system_prompt_len=48",
             "--set", "trajectories=2", "--set", "turn_len=4,40", "--set", "turn_len_median=12"]


def test_profile_memory_cpu(tmp_path):
    assert profile_memory.main(["--model", "tiny", "--device", "cpu", *TINY_TREE, "--out", str(tmp_path),
                                "--configs", "dtree:recompute,dtree:recompute+group_tokens=128+logprob_chunk=64"]) == 0
    report = json.loads(next(tmp_path.glob("memory_profile_cpu_tiny.json")).read_text())
    assert report["workload"]["unique_tokens"] >= 300
    small, smaller = report["runs"]
    assert small["step_s"] > 0 and smaller["calls"] > small["calls"]
    assert small["predicted_gib"] == {}  # CPU: no memory plan to compare with


def test_profile_memory_prediction_is_the_memory_policys():
    """The 'predicted' column is the policy's plan by part, plus the weights."""
    from types import SimpleNamespace

    from dtree.plan import memory_policy as mp
    from dtree.presets import build_model

    model = build_model("tiny", dtype=torch.float32, device="cpu")
    spec = dtree.models.adapt(model).dtree_spec()
    plan = mp.plan_step(spec, 2, mp.StepShape(5000, 900), on_cuda=True, available=2**33, fused_head=True)
    runner = SimpleNamespace(memory_plan=plan, _stack=None)
    got = profile_memory.predicted(spec, runner, torch.bfloat16, 1000, None)
    assert got["held at the start (weights, ...)"] == 2000  # nothing allocated at the start: the weights
    assert all(got[k] == v for k, v in plan.parts.items())
    assert got["total"] == pytest.approx(sum(v for k, v in got.items() if k != "total"))
    assert profile_memory.predicted(spec, SimpleNamespace(), torch.bfloat16, 1000, None) == {}


def _entry(action, addr, size, *files):
    return {"action": action, "addr": addr, "size": size, "stream": 0,
            "frames": [{"filename": f, "line": 1, "name": "f"} for f in files]}


def test_replay_peak_and_breakdown():
    """A trace in torch's documented TraceEntry format, starting with 100 bytes in use
    (weights 60 at address 1, an old stack of 40 at address 2)."""
    lm = "/x/site-packages/dtree/ops/logprobs/interface.py"
    layer = "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py"
    bwd = "/x/site-packages/torch/autograd/__init__.py"
    trace = [
        {"action": "segment_alloc", "addr": 1000, "size": 4096, "stream": 0, "frames": []},
        _entry("alloc", 10, 300, layer),  # forward activation
        _entry("alloc", 11, 500, lm, "/x/dtree/losses.py"),  # a logits chunk
        _entry("free_requested", 2, 40),  # the old stack, from before the trace
        _entry("alloc", 12, 200, bwd),  # a gradient (matched by address below)
        _entry("alloc", 13, 50, bwd),  # a backward temporary
        _entry("free_requested", 11, 500, lm),
        _entry("free_completed", 11, 500, lm),
        _entry("alloc", 14, 100, "/x/somewhere.py"),
    ]
    peak = profile_memory.replay_peak(trace, start_allocated=100, start_reserved=2000)
    assert peak["peak_allocated"] == 100 + 300 + 500 - 40 + 200 + 50
    assert sorted(peak["live"]) == [10, 11, 12, 13] and peak["pre_existing_freed"] == {2: 40}
    assert peak["reserved_at_peak"] == 2000 + 4096
    old_stack = {2: ("KV stack: K/V (bfloat16)", 40)}
    cats, top = profile_memory.breakdown(peak, 100, weights=60, grads={12: 200}, stack={}, stack_before=old_stack)
    assert cats["gradients"] == 200 and cats["weights"] == 60
    assert cats["decoder-layer activations (forward)"] == 300
    assert cats["LM head (logits chunks, their gradient, weight-grad accumulator)"] == 500
    assert cats["backward temporaries (activation gradients)"] == 50
    assert cats.get("KV stack: K/V (bfloat16), kept from the previous step", 0) == 0  # freed before the peak
    assert cats["fragmentation (reserved - allocated)"] == 6096 - peak["peak_allocated"]
    assert top[0][0].startswith("LM head") and top[0][2] == 500
    assert sum(v for k, v in cats.items() if not k.startswith("fragmentation")) == peak["peak_allocated"]
    # what the step was doing at the peak: the dtree/transformers frames of the allocation that reached it
    assert profile_memory.peak_moment(trace, peak["event_index"]) == []  # torch/autograd only
    assert peak["event_index"] == 5 and profile_memory.peak_moment(trace, 2) == [
        "dtree/ops/logprobs/interface.py:1 f", "/x/dtree/losses.py:1 f"]


def test_profile_memory_gives_every_method_the_same_layers(tmp_path):
    """``--layers eager``: the baselines and dtree run the model's own layers (dtree without
    its lean layers), and the report says so."""
    assert profile_memory.main(["--model", "tiny", "--device", "cpu", *TINY_TREE, "--out", str(tmp_path),
                                "--layers", "eager", "--configs", "dtree:low"]) == 0
    report = json.loads(next(tmp_path.glob("memory_profile_cpu_tiny.json")).read_text())
    assert report["layers"].startswith("eager")
    assert report["runs"][0]["options"]["lean_layers"] is False
    lean = profile_memory._same_layers(profile_memory.parse_configs("dtree:low,tree-mask"), "auto")
    assert all("lean_layers" not in c.options for c in lean)


def test_autotune_message_parsing():
    # the message of triton/runtime/autotuner.py (TRITON_PRINT_AUTOTUNING=1), as printed by triton 3.x
    key, cfg = ("128", "2", "128", "torch.bfloat16"), "BLOCK_N: 32, num_warps: 8"
    text = "noise\n" + "".join(
        f"Triton autotuning for function {fn},\nwith key as {key},\nfinished after {t:.2f}s,\nbest config selected: {cfg};\n"
        for fn, t in (("_fwd_kernel", 3.25), ("_dkdv_kernel", 11.5))
    )
    found = profile_warmup.AUTOTUNE_RE.findall(text)
    assert [(f, float(s)) for f, _, s in found] == [("_fwd_kernel", 3.25), ("_dkdv_kernel", 11.5)]
    assert found[0][1] == str(key)


def test_profile_warmup_cpu(tmp_path):
    """Each configuration in a fresh child process; per-step breakdown columns present."""
    assert profile_warmup.main(["--model", "tiny", "--device", "cpu", "--configs", "dtree", "--steps", "2",
                                "--no-rerun-first", *TINY_TREE, "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("warmup_cpu_tiny.json")).read_text())
    (run,) = report["runs"]
    assert run["config"] == "dtree" and [s["step"] for s in run["steps"]] == [1, 2]
    for s in run["steps"]:
        assert s["wall_s"] > 0 and s["model_calls"] >= 1 and s["unique_tokens"] >= 300
        assert s["rest_s"] == pytest.approx(s["wall_s"] - s["autotune_s"] - s["triton_compile_outside_autotune_s"]
                                            - s["torch_compile_s"])
    assert run["triton_hooks"] is True  # the hooks install with this Triton (they fire only for real compiles)
    assert "## `dtree`" in next(tmp_path.glob("*.md")).read_text()
