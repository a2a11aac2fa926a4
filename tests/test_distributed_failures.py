"""A rank that fails mid-step, on every gradient sync (plain all-reduce, DDP, FSDP2),
on gloo: the code benchmarks/bench_distributed.py runs on NCCL
(benchmarks/distributed_failures.py).

Two ranks train the tiny ``mixed`` batch (one node per model call, so the failing
walk has accumulated gradients before it fails). For each sync and failure (out of
memory in the walk of the rank with the most work; a non-finite loss at the first
loss token of one sequence of the last rank): a good step, the failing step, a good step. Every rank
must raise the same error naming only the failing rank, keep ``param.grad`` bitwise
as after the first step, and end with exactly twice that gradient.
"""

from __future__ import annotations

import copy

import pytest
from spawn import spawn_gloo

import dtree
from benchmarks.distributed_failures import FAILURES, failure_runs, summarize
from dtree.distributed import SYNCS
from dtree.workloads import make_workload

FP32_TOL = 1e-5


def _failure_scenarios(rank: int, world: int) -> dict:
    from hf_models import VOCAB, make_model

    base = make_model("llama")
    forest = make_workload("mixed", seed=0, vocab_size=VOCAB, tiny=True)
    rows = failure_runs(lambda: copy.deepcopy(base), forest, dtree.losses.ppo_clip(reduction="token_mean"),
                        config=dtree.RuntimeConfig(group_tokens=0))
    return {"rows": rows}


@pytest.fixture(scope="module")
def verdicts():
    ranks = spawn_gloo(_failure_scenarios, 2)
    return summarize([r["rows"] for r in ranks], FP32_TOL)


@pytest.mark.distributed
def test_every_sync_and_failure_ran(verdicts):
    assert {(v["sync"], v["failure"]) for v in verdicts} == {
        (s, f) for s in ("allreduce", "ddp", "fsdp2") for f in FAILURES
    }
    assert SYNCS == ("allreduce", "ddp", "fsdp2")


@pytest.mark.distributed
@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("sync", ["allreduce", "ddp", "fsdp2"])
def test_failure_fails_every_rank_and_restores_gradients(verdicts, sync, failure):
    (v,) = [v for v in verdicts if v["sync"] == sync and v["failure"] == failure]
    assert v["passed"], {k: ok for k, ok in v["checks"].items() if not ok}
    assert f"failed on rank {v['victim']} of 2" in v["message"]
    if failure == "nonfinite":
        assert v["where"] and v["where"] in v["message"]  # the batch's sequence index and the position
    else:
        assert "CPU stand-in" in v["message"]
