"""The torchrun commands of the README and of the GPU benchmark, run on CPU (gloo):

* the two-node command, as two torchrun agents of 2 processes each on this host
  (c10d rendezvous on localhost: 4 ranks over 2 "nodes"), training the tiny mixed
  batch with FSDP2; its first loss must be the single-process loss;
* ``benchmarks/bench_distributed.py --smoke`` on 3 processes (rank counts 3 and 2, so
  the 2-rank runs use a subgroup): every configuration, exact gradients, the failure runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_NODES = ("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 "
             "--rdzv-id dtree-run examples/train_distributed.py")
TIMEOUT_S = 240


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _readme_commands() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.sub(r"\s+", " ", text.replace("\\\n", " "))


@pytest.mark.distributed
def test_two_node_command_from_the_readme(tmp_path):
    assert TWO_NODES in _readme_commands()
    args = TWO_NODES.split()[1:]
    args[args.index("--nproc-per-node") + 1] = "2"
    args[args.index("--rdzv-endpoint") + 1] = f"127.0.0.1:{free_port()}"
    args[args.index("--rdzv-id") + 1] = f"dtree-test-{os.getpid()}"
    cmd = _torchrun(args + ["--model", "tiny", "--tiny", "--workload", "mixed", "--steps", "2", "--sync", "fsdp2"])
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in nodes]
    finally:
        for p in nodes:  # only the agents this test started
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    out = "\n".join((tmp_path / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], out[-3000:]
    assert "4 rank(s), tiny on cpu, sync=fsdp2" in out
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 2
    assert losses[0] == pytest.approx(_single_process_loss(), rel=1e-5)


def _single_process_loss() -> float:
    """The example's first step on one process: same model, batch and loss."""
    import dtree
    from dtree.presets import build_model
    from dtree.workloads import make_workload

    model = build_model("tiny", seed=0)
    rt = dtree.TreeRuntime(model, config=dtree.RuntimeConfig(group_tokens=8192))
    forest = make_workload("mixed", seed=0, vocab_size=rt.spec.vocab_size, tiny=True)
    return rt.forward_backward(forest, dtree.losses.ppo_clip(reduction="token_mean")).loss


@pytest.mark.slow  # three ranks of the distributed bench: ~23 s of the suite on CI
@pytest.mark.distributed
def test_bench_distributed_smoke(tmp_path):
    cmd = _torchrun(["--nproc-per-node", "3", "benchmarks/bench_distributed.py", "--smoke", "--ranks", "3,2",
                     "--out-dir", str(tmp_path)])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (path,) = tmp_path.glob("distributed_mixed_tiny_3xcpu.json")
    result = json.loads(path.read_text())
    runs = result["runs"]
    assert [(x["world"], x["balancer"], x["split"], x["sync"]) for x in runs][:8] == [
        (3, "calibrated", True, "allreduce"), (3, "flops", True, "allreduce"), (3, "tokens", True, "allreduce"),
        (3, "calibrated", False, "allreduce"), (3, "flops", False, "allreduce"), (3, "tokens", False, "allreduce"),
        (3, "calibrated", True, "ddp"), (3, "calibrated", True, "fsdp2"),
    ]
    assert {x["world"] for x in runs} == {3, 2} and len(runs) == 16
    for x in runs:
        assert x["status"] == "ok", x
        assert x["grad_error"] < 1e-5 and x["loss_rel_diff"] < 1e-5, x  # fp32: exact to rounding
        assert len(x["rank_walk_s"]) == x["world"] and x["efficiency"] > 0
    assert [k["kind"] for k in result["batch"]["kinds"]] == ["grpo", "agentic", "search"]
    assert len(result["failures"]) == 6 and all(v["passed"] for v in result["failures"]), result["failures"]
    md = path.with_suffix(".md").read_text()
    assert "## One rank fails" in md and "## Scaling" in md and "| 2 | tokens | off | allreduce |" in md


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_session_smoke(tmp_path):
    """``SMOKE=1 bash benchmarks/distributed_session.sh x4``: the GPU session's command on CPU, 4 processes."""
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "distributed_session.sh"), "x4"], env=env,
                       capture_output=True, text=True, timeout=2 * TIMEOUT_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "distributed_mixed_tiny_4xcpu.json", "distributed_mixed_tiny_4xcpu.md", "distributed_x4.log"]
    result = json.loads((tmp_path / "distributed_mixed_tiny_4xcpu.json").read_text())
    assert {x["world"] for x in result["runs"]} == {4, 2} and all(v["passed"] for v in result["failures"])
