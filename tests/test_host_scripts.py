"""The host-time scripts' analysis on synthetic input: ``benchmarks/host_sampling.py report``
(py-spy's collapsed stacks: only the steady steps counted, phases by the innermost frame) and
``benchmarks/gpu_gaps.py`` (a step's kernels: the gap before the first, busy time, gaps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_gaps import step_gaps

ROOT = Path(__file__).resolve().parents[1]

STACKS = """\
<module> (benchmarks/host_sampling.py:150);main (benchmarks/host_sampling.py:140);run (benchmarks/host_sampling.py:60) 50
<module> (x.py:1);steady_steps (benchmarks/host_sampling.py:48);TreeRuntime.forward_backward (dtree/engine/runtime.py:280);\
StepPlanner.make_plan (dtree/plan/step_plan.py:351);plan_step (dtree/plan/memory_policy.py:200) 10
<module> (x.py:1);steady_steps (benchmarks/host_sampling.py:48);TreeRuntime.forward_backward (dtree/engine/runtime.py:280);\
train_step (dtree/engine/walk.py:313);HFTreeModel.dtree_hidden_states (dtree/models/hf.py:289);Linear.forward \
(torch/nn/modules/linear.py:130) 30
<module> (x.py:1);steady_steps (benchmarks/host_sampling.py:48);TreeRuntime.forward_backward (dtree/engine/runtime.py:280);\
train_step (dtree/engine/walk.py:313);_finish_group (dtree/engine/walk.py:293);_engine_run_backward \
(torch/autograd/graph.py:860) 40
<module> (x.py:1);steady_steps (benchmarks/host_sampling.py:48);TreeRuntime.forward_backward (dtree/engine/runtime.py:280);\
GradStash.__init__ (dtree/engine/grad_guard.py:22) 4
"""


def test_sampling_report_counts_steady_steps_by_phase(tmp_path):
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(STACKS)
    out = tmp_path / "report.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_sampling.py"), "report", str(stacks),
                        "--steps", "2", "--rate", "1000", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "42.0 ms per step" in text  # 84 samples of the steady steps (not the warm-up's 50) over 2 steps
    for phase, ms in (("backward", "20.00"), ("forward", "15.00"), ("plan", "5.00"), ("other", "2.00")):
        assert f"| {phase} | {ms} |" in text
    assert "`GradStash.__init__ (dtree/engine/grad_guard.py)` | 2.00" in text


def test_gpu_gaps_of_one_step():
    kernels = [(0.0, 1.0, "spin_kernel"), (11.0, 20.0, "a"), (20.5, 30.0, "b"), (130.0, 131.0, "c")]
    r = step_gaps(kernels)
    assert r["first_us"] == 10.0 and r["kernels"] == 3
    assert r["busy_us"] == 9.0 + 9.5 + 1.0
    assert [g for g, _, _ in r["gaps"]] == [0.5, 100.0]
    assert r["gaps"][1][1:] == ("b", "c")
