"""The host-time scripts' analysis on synthetic input: ``benchmarks/host_sampling.py report``
(py-spy's collapsed stacks: only the steady steps counted, phases by the innermost frame) and
``benchmarks/gpu_gaps.py`` (a step's kernels: the gap before the first, busy time, gaps); and
``benchmarks/op_host_cost.py``, ``benchmarks/queue_depth.py``, ``benchmarks/head_chunk_cost.py`` and
``benchmarks/grad_slots_ab.py`` run on CPU (plumbing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    forward = text.split("in the forward phase")[1]  # only the forward's samples: 30 over 2 steps
    assert "`Linear.forward (torch/nn/modules/linear.py)` | 15.00" in forward
    assert "_engine_run_backward" not in forward and "make_plan" not in forward


def test_gpu_gaps_of_one_step():
    kernels = [(0.0, 1.0, "spin_kernel"), (11.0, 20.0, "a"), (20.5, 30.0, "b"), (130.0, 131.0, "c")]
    r = step_gaps(kernels)
    assert r["first_us"] == 10.0 and r["kernels"] == 3
    assert r["busy_us"] == 9.0 + 9.5 + 1.0
    assert [g for g, _, _ in r["gaps"]] == [0.5, 100.0]
    assert r["gaps"][1][1:] == ("b", "c")


def test_op_host_cost_lists_every_op_on_cpu(tmp_path):
    """``benchmarks/op_host_cost.py``: every case runs and gets a row (CPU: no GPU column)."""
    r = subprocess.run([sys.executable, "benchmarks/op_host_cost.py", "--rows", "8", "--iters", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "op_host_cost.md").read_text()
    for op in ("F.linear(x, W, b)", "q, k, v: one F.linear with bias, split", "autograd: q, k, v three F.linear"):
        assert f"| {op}" in report, report


def test_queue_depth_marks_each_group_on_cpu(tmp_path):
    """``benchmarks/queue_depth.py --smoke``: a mark at each group's forward and backward, in
    step order, and the synchronization section (CPU: none to find)."""
    r = subprocess.run([sys.executable, "benchmarks/queue_depth.py", "--smoke", "--steps", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "queue_depth_agentic64k.md").read_text()
    marks = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ") and "ms" not in line]
    assert marks[0] == "step start" and marks[-1] == "step end (host)", marks
    assert any(m.startswith("forward g") for m in marks) and "backward" in marks, marks
    assert "## synchronizations in one step" in report


def test_host_profile_takes_the_workload_options_on_cpu(tmp_path):
    """``benchmarks/host_profile.py --smoke --workload case1``: the shared setup options parse
    (its parser once lacked them and refused every run) and the report names the workload."""
    r = subprocess.run([sys.executable, "benchmarks/host_profile.py", "--smoke", "--workload", "case1", "--steps", "1",
                        "--top", "5"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "host_profile_case1.md").read_text()
    assert report.startswith("# Host time of a dtree step: case1 (grpo), cpu"), report[:300]


def test_host_speed_times_each_op_and_both_thread_arms_on_cpu(tmp_path):
    """``benchmarks/host_speed.py --smoke``: a row per op with a positive cost, both thread arms
    stepped on every forest, and their paired ratio."""
    r = subprocess.run([sys.executable, "benchmarks/host_speed.py", "--smoke", "--forests", "2", "--rounds", "1"],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "host_speed_case1.md").read_text()
    ops = [line for line in report.splitlines() if line.startswith("| ") and line.count("|") == 3 and "us |" not in line]
    assert len(ops) == 6 and all(float(line.split("|")[2]) > 0 for line in ops), ops
    assert "| 1 intra-op thread |" in report and "intra-op threads (default) |" in report, report
    assert "Paired ratio (one thread / default), median: **" in report


def test_head_chunk_cost_times_every_policy_chunk_on_cpu(tmp_path):
    """``benchmarks/head_chunk_cost.py --smoke``: a row per (rows, chunk) of the policy's chunks
    and the fitted penalties beside the policy's."""
    r = subprocess.run([sys.executable, "benchmarks/head_chunk_cost.py", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "head_chunk_cost_cpu.md").read_text()
    assert all(f"| 256 | {c} |" in report for c in (1024, 2048, 4096)), report
    assert "Fitted penalty" in report and "in the policy now" in report


def test_bench_swiglu_rerun_times_the_chunked_backward_on_cpu(tmp_path):
    """``benchmarks/bench_swiglu_rerun.py --smoke``: the re-run backward in chunks, its weight
    gradient's error against the float64 sum within bf16 rounding (CPU: the float32-add variant only)."""
    r = subprocess.run([sys.executable, "benchmarks/bench_swiglu_rerun.py", "--smoke", "--reps", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path)}, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    row = next(line for line in (tmp_path / "swiglu_rerun.md").read_text().splitlines() if line.startswith("| 300 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "3" and cells[2] == "-", row
    err, scale = (float(x) for x in cells[5].replace("- / ", "").replace(")", "").split(" (of "))
    assert 0 < err < 2**-7 * scale, row  # bf16 dW: one rounding of the float32 sum


@pytest.mark.slow  # an earlier session's A/B script: ~9 s of the suite on CI
def test_grad_slots_ab_runs_each_variant_on_cpu(tmp_path):
    """``benchmarks/grad_slots_ab.py --smoke``: each variant of each memory setting gets a row,
    and the profiled comparison its table."""
    r = subprocess.run([sys.executable, "benchmarks/grad_slots_ab.py", "--smoke", "--rounds", "2", "--memory", "low",
                        "--low-chunk", "--profile"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "grad_slots_ab_agentic64k.md").read_text()
    for variant in ("low: as is", "low: all gradient slots", "low: 1,024-row head chunks"):
        assert f"| {variant} |" in report, report
    assert "the kernels whose time differs most" in report


def test_options_ab_times_every_arm_on_every_forest_on_cpu(tmp_path):
    """``benchmarks/options_ab.py --smoke``: one row per arm, a timed step per round, the first arm's
    paired ratio 1, and the arms' own plans (here: the call size each was given)."""
    r = subprocess.run([sys.executable, "benchmarks/options_ab.py", "--smoke", "--arm", "group_tokens=128",
                        "--arm", "group_tokens=64", "--rounds", "3", "--warmup", "1", "--tag", "t"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("round ") == 4, r.stdout
    rows = [line for line in (tmp_path / "options_ab_agentic64k_t.md").read_text().splitlines()
            if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2, rows
    assert rows[0].split(" | ")[3] == "1.000"
    assert all(len(row.split(" | ")[6].split(", ")) == 3 for row in rows)  # three timed steps each
    assert "group_tokens=128" in rows[0] and "group_tokens=64" in rows[1]
    bad = subprocess.run([sys.executable, "benchmarks/options_ab.py", "--smoke", "--arm", "memory=low"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "give two or more --arm" in bad.stderr


def test_an_arm_that_names_no_blas_library_runs_the_processs_own():
    """``options_ab.enter_arm``: an arm's ``blas`` sets the library for its steps, and the next arm,
    which names none, runs the process's own again (not the last arm's); an arm's runtime options
    leave the process settings out."""
    from benchmarks.options_ab import enter_arm, parse_arm, runtime_options

    arm = parse_arm("memory=low,blas=cublaslt,rerun_chunk_rows=0")
    assert runtime_options(arm) == {"memory": "low", "rerun_chunk_rows": 0}
    if not torch.cuda.is_available():
        enter_arm(arm, torch.device("cpu"))  # no library to set off CUDA
        return
    own = torch.backends.cuda.preferred_blas_library()
    try:
        enter_arm(arm, torch.device("cuda"))
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        enter_arm(parse_arm("memory=low"), torch.device("cuda"))
        assert torch.backends.cuda.preferred_blas_library() == own
    finally:
        torch.backends.cuda.preferred_blas_library(own)


def test_a_head_arm_recomputes_the_logits_and_the_next_arm_keeps_them_again():
    """``options_ab.enter_arm``'s ``head=recompute``: the loss's head op is asked never to keep
    its logits (a one-chunk call's backward then makes its product again), and an arm that names
    no head runs dtree's own op again; a name outside keep/recompute stops the script."""
    from benchmarks.options_ab import enter_arm, parse_arm
    from dtree.losses import token_loss
    from dtree.ops.logprobs import OutputHead

    own = token_loss.token_logprobs
    hidden = torch.randn(6, 8, requires_grad=True)
    head = OutputHead(weight=torch.randn(11, 8, requires_grad=True))
    labels = torch.randint(0, 11, (6,))
    kept = []
    try:
        for arm in ("head=recompute", "memory=low", "head=keep"):
            enter_arm(parse_arm(arm), torch.device("cpu"))
            logp, _ = token_loss.token_logprobs(hidden, head, labels, 8, keep_logits=True)
            kept.append(logp.grad_fn.logits is not None)  # the autograd node is the op's ctx
        assert kept == [False, True, True]
        assert token_loss.token_logprobs is own
        with pytest.raises(SystemExit, match="head=fast"):
            enter_arm(parse_arm("head=fast"), torch.device("cpu"))
    finally:
        token_loss.token_logprobs = own


def test_every_workload_has_a_smoke_form_and_its_size():
    """``benchmarks/host_profile.py``'s workloads: each has a ``--smoke`` form, and the agentic
    trees' full forms hold about the unique tokens their names say."""
    from benchmarks.host_profile import SMOKE, WORKLOADS
    from dtree.workloads import make_workload

    assert set(SMOKE) == set(WORKLOADS)
    for name, (kind, params) in SMOKE.items():
        assert kind == WORKLOADS[name][0]
        assert make_workload(kind, seed=0, vocab_size=1000, **params).num_nodes > 1
    for name, tokens in (("agentic64k", 65536), ("agentic256k", 262144)):
        kind, params = WORKLOADS[name]
        forest = make_workload(kind, seed=0, vocab_size=151936, **params)
        assert abs(forest.num_unique_tokens - tokens) <= 0.1 * tokens, (name, forest.num_unique_tokens)


def test_plan_candidates_lists_the_frontier_above_the_plan_run():
    """``benchmarks/plan_candidates.py``: for a capped plan scored as on CUDA, the candidates listed
    are each faster and leaner-first (every one beats all leaner ones), and the plan run is the
    fastest that fits."""
    import dataclasses

    from benchmarks import plan_candidates as pc
    from benchmarks.host_profile import script_parts
    from dtree.models import adapt
    from dtree.plan import memory_policy, stack_sizes
    from dtree.workloads import make_workload

    model = script_parts(True, "agentic64k", [])[0]
    spec = adapt(model).dtree_spec()
    forest = make_workload("agentic", seed=0, vocab_size=spec.vocab_size, num_trees=1, target_unique_tokens=20000)
    shape = stack_sizes.step_shape(forest, 2048)
    budgets = memory_policy.call_budgets(None, shape.unique_tokens)
    shape = dataclasses.replace(shape, stack_needs=stack_sizes.stack_needs(forest, 2048, budgets, True, True))
    with pc.recorded_scorings() as seen:
        memory_policy.plan_step(spec, 2, shape, on_cuda=True, available=80 * 2**30, expandable_segments=True,
                                setting=0.2, kv_window=True, can_keep_attention=True)
    s = seen[0]
    peaks, costs, chosen = s["peaks"], s["costs"], s["chosen"]
    frontier = pc._frontier(peaks, costs, chosen)
    assert frontier and peaks[chosen] <= s["budget"]
    assert all(peaks[i] > s["budget"] for i in frontier)  # the plan run was the fastest that fits
    assert all(costs[b] < costs[a] and peaks[b] >= peaks[a] for a, b in zip([chosen] + frontier, frontier))
    for i in frontier:  # nothing leaner is as fast
        assert not ((peaks < peaks[i]) & (costs <= costs[i])).any()
    rows = pc._table(s, 5)
    assert rows[2].startswith("| plan |") and "**ran**" in rows[4] and len(rows) == 4 + 1 + min(5, len(frontier))
