"""dtree.distributed: cost model, partitioning, and exact multi-process training.

The multi-process tests spawn one gloo process group per world size (2 and 3) and
run every scenario in it (spawning is the slow part on a small CPU;
tests/spawn.py); each rank saves what it saw, and the tests below compare
it with single-process dtree and with the HF per-path reference (tests/reference.py).
Failures on every sync strategy: tests/test_distributed_failures.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import math

import numpy as np
import pytest
import torch
from spawn import spawn_gloo

import dtree
from dtree.distributed import (
    CostFeatures,
    CostModel,
    forest_features,
    karmarkar_karp,
    lpt,
    nnls,
    plan_partition,
    sequence_features,
)
from dtree.distributed.balance import makespan
from dtree.distributed.cost_model import NOMINAL_SPEC
from dtree.distributed.partition import split_forest
from dtree.losses import TokenLoss

FP32_TOL = 1e-5


# ---------------------------------------------------------------------- batches
def batch(kind: str = "mixed"):
    """(sequences, fields): deterministic, with shared prefixes, duplicates, a
    sequence that is a prefix of another, masks and PPO fields."""
    if kind == "mixed":
        seqs = [
            [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9, 10, 11], [1, 2, 3, 8, 12], [1, 2],
            [1, 2, 3, 4, 5, 6], [20, 21, 22, 23], [20, 21, 24], [30, 31, 32, 33, 34, 35],
            [40, 41, 42, 43], [40, 41, 44, 45, 46], [40, 47], [50, 51, 52, 53, 54, 55, 56, 57, 58],
        ]
    elif kind == "one_tree":  # a GRPO-like group with a nested branch: must be split to balance
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]
        seqs = [prompt + [13 + i] + [60 + (i * 7 + j) % 30 for j in range(3 + i)] for i in range(5)]
        seqs += [prompt + [13, 70, 71], prompt + [13, 70, 72, 73], prompt[:5]]
    elif kind == "one_path":  # a single sequence: the other ranks get nothing
        seqs = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    else:
        raise ValueError(kind)
    rng = np.random.default_rng(len(seqs))
    fields = {
        "loss_mask": [[0.0] + list(rng.choice([0.0, 1.0, 1.0, 1.0], size=len(s) - 1)) for s in seqs],
        "advantages": [list(rng.uniform(-2, 2, size=len(s))) for s in seqs],
        "old_logprobs": [list(rng.uniform(-5, -4, size=len(s))) for s in seqs],
    }
    return seqs, fields


def forest_of(kind: str) -> dtree.Forest:
    seqs, fields = batch(kind)
    return dtree.Forest.from_sequences(seqs, **fields)


def weighted_forest(kind: str) -> dtree.Forest:
    """``forest_of(kind)`` with no loss token in sequences 1 and 4, so that every rule
    for counting sequences gives a different weight."""
    f = forest_of(kind)
    mask = [np.array(f.field("loss_mask", s)) for s in range(f.num_sequences)]
    for s in (1, 4):
        mask[s][:] = 0.0
    return f.with_fields(loss_mask=mask)


def weight_losses() -> dict[str, TokenLoss]:
    """One loss per reduction and counting rule, for the per-token weight checks."""
    def neg(lp, f):
        return -lp

    out = {red: TokenLoss(neg, reduction=red, scale=0.5) for red in dtree.losses.REDUCTIONS}
    for red in ("sequence_mean", "seq_mean_token_sum"):
        out[f"{red}+empty"] = TokenLoss(neg, reduction=red, count_empty_sequences=True)
    out["token_mean-unmasked"] = TokenLoss(neg, reduction="token_mean", use_loss_mask=False)
    return out


def div_loss(reduction: str = "sum") -> TokenLoss:
    """-logp / den: a zero ``den`` makes that term infinite (a non-finite loss)."""
    return TokenLoss(lambda lp, f: -lp / f["den"], reduction=reduction, required_fields=("den",), name="div")


# ---------------------------------------------------------------------- workers
def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):  # FSDP2: DTensor shard -> full gradient
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def _scenarios(rank: int, world: int) -> dict:
    from hf_models import make_model

    from dtree.distributed import DistributedStepError, DistributedTreeTrainer, distributed_forward_backward

    res: dict = {}

    def trainer_for(model, **kw):
        return DistributedTreeTrainer(model, config=dtree.RuntimeConfig(group_tokens=0), **kw)

    # exactness for every reduction (plain all-reduce sync)
    for red in dtree.losses.REDUCTIONS:
        model = make_model("qwen2", tied=True)
        out = trainer_for(model).step(forest_of("mixed"), dtree.losses.ppo_clip(reduction=red))
        res[f"mixed/{red}"] = dict(grads=_grads(model), loss=out.loss, report=out.partition.as_dict(),
                                   local=out.local is not None, norm=out.normalization)

    # the weight of every (sequence, token) term on its rank, under the all-reduced counts
    from dtree.distributed.trainer import global_normalization

    res["weights"] = {}
    for kind, threshold in (("mixed", None), ("one_tree", 1e-12)):  # whole trees; one tree cut into sequences
        plan = plan_partition(weighted_forest(kind), world, split_threshold=threshold)
        mine = plan.forest(rank)
        for name, loss in weight_losses().items():
            norm = global_normalization(mine, None, loss.use_loss_mask)
            res["weights"][f"{kind}|{name}"] = (
                plan.sequence_ids[rank].tolist(), None if mine is None else loss.weights(mine, norm)
            )

    # a two-pass SequenceLoss (GSPO) divides by the global counts too
    model = make_model("qwen2", tied=True)
    out = trainer_for(model).step(forest_of("mixed"), dtree.losses.gspo(0.2, count_empty_sequences=True))
    res["mixed/gspo"] = dict(grads=_grads(model), loss=out.loss)

    # one tree, forced to be split across ranks: pieces of at most one sequence
    model = make_model("llama")
    tr = trainer_for(model, split_threshold=1e-12)
    plan = tr.plan(forest_of("one_tree"))
    out = tr.step(forest_of("one_tree"), dtree.losses.nll("token_mean"))
    res["split"] = dict(grads=_grads(model), loss=out.loss, report=out.partition.as_dict(),
                        ids=[a.tolist() for a in plan.sequence_ids])

    # a rank with no sequence, through the function API (distributed_forward_backward)
    model = make_model("llama")
    rt = dtree.TreeRuntime(model, group_tokens=0)
    plan = plan_partition(forest_of("one_path"), world, CostModel.from_spec(rt.spec))
    mine = plan.forest(rank)
    out = distributed_forward_backward(rt, mine, dtree.losses.nll("sequence_mean"))
    res["empty"] = dict(grads=_grads(model), loss=out.loss, empty=mine is None, report=plan.report.as_dict())

    if world == 2:
        # determinism: the plans of several calls and cost models, to compare across ranks
        res["plans"] = {
            f"{kind}/{m}/{cm}": [a.tolist() for a in plan_partition(
                forest_of(kind), world, CostModel.token_count() if cm == "tok" else None, method=m).sequence_ids]
            for kind, m, cm in itertools.product(["mixed", "one_tree"], ["auto", "lpt", "kk"], ["tok", "flops"])
        }

        # a non-finite loss on one rank fails every rank; param.grad unchanged
        seqs, _ = batch("mixed")
        den = [[1.0] * len(s) for s in seqs]
        den[0][3] = 0.0  # sequence 0 lives on exactly one rank
        bad = dtree.Forest.from_sequences(seqs, den=den)
        model = make_model("llama")
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        before = _grads(model)
        try:
            trainer_for(model).step(bad, div_loss())
            res["nonfinite"] = dict(raised=None)
        except DistributedStepError as e:
            res["nonfinite"] = dict(raised=str(e), failures=e.failures, same=_same(before, _grads(model)))

        # an out-of-memory error on rank 1 (simulated) fails every rank
        model = make_model("llama")
        tr = trainer_for(model)
        if rank == 1:
            def oom(*a, **k):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
            tr.runtime.forward_backward = oom
        try:
            tr.step(forest_of("mixed"), dtree.losses.nll())
            res["oom"] = dict(raised=None)
        except DistributedStepError as e:
            res["oom"] = dict(raised=str(e), failures=e.failures, grads_none=all(
                p.grad is None for p in model.parameters()))

        # ranks that were given different batches are told so, instead of training wrongly
        try:
            trainer_for(make_model("llama")).step(forest_of("mixed" if rank == 0 else "one_tree"), dtree.losses.nll())
            res["mismatch"] = None
        except RuntimeError as e:
            res["mismatch"] = str(e)

        # DDP: walk under no_sync, one all-reduce at the end
        model = make_model("qwen2", tied=True)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        # packed calls, chunked nodes
        tr = DistributedTreeTrainer(ddp, config=dtree.RuntimeConfig(group_tokens=5, chunk_size=3))
        out = tr.step(forest_of("mixed"), dtree.losses.ppo_clip(reduction="token_mean"))
        res["ddp"] = dict(grads=_grads(model), loss=out.loss, sync=tr.sync.name)

        res["fsdp"] = _fsdp_scenario(make_model, world)
    return res


def _fsdp_scenario(make_model, world: int) -> dict:
    """FSDP2 on gloo: a failed step (non-finite on one rank) leaves nothing behind,
    then two good steps accumulate exactly twice the gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dtree.distributed import DistributedStepError, DistributedTreeTrainer

    try:
        model = make_model("llama")
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    except Exception as e:  # pragma: no cover - depends on the torch build
        return dict(skipped=f"fully_shard on CPU/gloo failed: {type(e).__name__}: {e}")
    tr = DistributedTreeTrainer(model, config=dtree.RuntimeConfig(mode="recompute", group_tokens=7))
    seqs, fields = batch("mixed")
    den = [[1.0] * len(s) for s in seqs]
    den[0][3] = 0.0
    raised = None
    try:
        tr.step(dtree.Forest.from_sequences(seqs, den=den), div_loss())
    except DistributedStepError as e:
        raised = str(e)
    after_fail = _grads(model)
    loss = dtree.losses.ppo_clip(reduction="sequence_mean")
    outs = [tr.step(forest_of("mixed"), loss).loss for _ in range(2)]
    grads = _grads(model)
    # a rank with nothing to do still joins the all-gather and the reduce-scatter
    model.zero_grad(set_to_none=True)
    empty = tr.step(forest_of("one_path"), dtree.losses.nll("sequence_mean"))
    return dict(sync=tr.sync.name, raised=raised, after_fail_none=all(g is None for g in after_fail.values()),
                grads=grads, losses=outs, empty_grads=_grads(model), empty_loss=empty.loss,
                empty_ranks=empty.partition.empty_ranks)


def _same(a: dict, b: dict) -> bool:
    return all((a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and torch.equal(a[k], b[k]))
               for k in a)


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = spawn_gloo(_scenarios, world)
    return _RESULTS[world]


@pytest.fixture(params=[2, 3], ids=lambda w: f"world{w}")
def ranks(request):
    """What every rank saw, for 2 and 3 ranks (one spawn per world size per session)."""
    return _results(request.param)


@pytest.fixture
def ranks2():
    """The 2-rank run, which also covers failures, determinism, DDP and FSDP2."""
    return _results(2)


# ---------------------------------------------------------------------- references
@contextlib.contextmanager
def one_thread():
    """Tiny matmuls run far faster on one thread than on two contending ones (50x
    measured on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@functools.lru_cache(maxsize=None)
def reference(kind: str, loss_kind: str, reduction: str, arch: str, tied: bool):
    """(dtree single-process model, HF per-path model, dtree loss, HF loss); cached."""
    with one_thread():
        return _reference(kind, loss_kind, reduction, arch, tied)


def _reference(kind, loss_kind, reduction, arch, tied):
    from hf_models import make_model
    from reference import linearized_step

    seqs, fields = batch(kind)
    base = make_model(arch, tied)
    tree_model, hf_model = copy.deepcopy(base), copy.deepcopy(base)
    loss = dtree.losses.ppo_clip(reduction=reduction) if loss_kind == "ppo" else dtree.losses.nll(reduction)
    forest = dtree.Forest.from_sequences(seqs, **fields)
    out = dtree.TreeRuntime(tree_model, group_tokens=0).forward_backward(forest, loss)
    if loss_kind == "ppo":
        hf_loss, _ = linearized_step(hf_model, seqs, fields, "ppo", reduction, clip_eps=0.2)
    else:
        hf_loss, _ = linearized_step(hf_model, seqs, {"loss_mask": fields["loss_mask"]}, "nll", reduction)
    return tree_model, hf_model, out.loss, hf_loss


def assert_grads_match(grads: dict, ref_model, tol: float = FP32_TOL, scale: float = 1.0) -> None:
    worst, where = 0.0, None
    for name, r in ref_model.named_parameters():
        g = grads[name]
        if r.grad is None:
            assert g is None or float(g.abs().max()) == 0.0, name
            continue
        assert g is not None, f"no gradient for {name}"
        err = float((g - scale * r.grad).norm() / max(float((scale * r.grad).norm()), 1e-12))
        if err > worst:
            worst, where = err, name
    assert worst < tol, f"gradient of {where} off by {worst:.2e}"


# ---------------------------------------------------------------------- multi-process tests
@pytest.mark.distributed
@pytest.mark.parametrize("reduction", dtree.losses.REDUCTIONS)
def test_summed_gradients_are_exact(ranks, reduction):
    tree_model, hf_model, tree_loss, hf_loss = reference("mixed", "ppo", reduction, "qwen2", True)
    for r, res in enumerate(ranks):
        got = res[f"mixed/{reduction}"]
        assert_grads_match(got["grads"], tree_model)
        assert_grads_match(got["grads"], hf_model)
        assert abs(got["loss"] - tree_loss) <= FP32_TOL * max(1.0, abs(tree_loss)), (r, got["loss"], tree_loss)
        assert abs(got["loss"] - hf_loss) <= FP32_TOL * max(1.0, abs(hf_loss))
    # the global counts are the single-process ones
    norm = dtree.losses.local_normalization(forest_of("mixed"))
    assert ranks[0][f"mixed/{reduction}"]["norm"] == norm or reduction == "sum"


@pytest.mark.distributed
def test_global_normalization_gives_every_term_its_single_process_weight(ranks):
    """Token by token, not through a sum: each rank's weights under the all-reduced
    counts equal the single-process weights of the same (sequence, token), and every
    sequence is weighted on exactly one rank."""
    losses = weight_losses()
    assert len(ranks[0]["weights"]) == 2 * len(losses)
    for key in ranks[0]["weights"]:
        kind, name = key.split("|")
        forest = weighted_forest(kind)
        want = losses[name].weights(forest)
        assert np.count_nonzero(want) > 0
        owned = []
        for r, res in enumerate(ranks):
            ids, got = res["weights"][key]
            if got is None:
                assert ids == [], (key, r)
                continue
            lengths = forest.sequence_lengths()[ids]
            assert len(got) == lengths.sum()
            for s, piece in zip(ids, np.split(got, np.cumsum(lengths)[:-1])):
                np.testing.assert_allclose(piece, want[forest.seq_offsets[s] : forest.seq_offsets[s + 1]],
                                           rtol=1e-14, atol=0, err_msg=f"{key}, rank {r}, sequence {s}")
            owned += ids
        assert sorted(owned) == list(range(forest.num_sequences)), key
    assert len(ranks[0]["weights"]["one_tree|sum"][0]) < forest_of("one_tree").num_sequences  # the tree was cut


@pytest.mark.distributed
def test_sequence_loss_uses_global_counts(ranks):
    from hf_models import make_model

    model = make_model("qwen2", tied=True)
    with one_thread():
        want = dtree.TreeRuntime(model, group_tokens=0).forward_backward(
            forest_of("mixed"), dtree.losses.gspo(0.2, count_empty_sequences=True)
        )
    for res in ranks:
        assert_grads_match(res["mixed/gspo"]["grads"], model)
        assert abs(res["mixed/gspo"]["loss"] - want.loss) <= FP32_TOL * max(1.0, abs(want.loss))


@pytest.mark.distributed
def test_tree_split_across_ranks(ranks):
    tree_model, hf_model, tree_loss, _ = reference("one_tree", "nll", "token_mean", "llama", False)
    world = len(ranks)
    for res in ranks:
        got = res["split"]
        assert got["report"]["split_trees"] == [0], got["report"]
        assert got["report"]["recomputed_tokens"] > 0
        assert sum(len(ids) > 0 for ids in got["ids"]) == world  # every rank got a piece
        assert sorted(i for ids in got["ids"] for i in ids) == list(range(forest_of("one_tree").num_sequences))
        assert_grads_match(got["grads"], tree_model)
        assert_grads_match(got["grads"], hf_model)
        assert abs(got["loss"] - tree_loss) <= FP32_TOL * max(1.0, abs(tree_loss))


@pytest.mark.distributed
def test_rank_with_no_sequences(ranks):
    tree_model, hf_model, tree_loss, _ = reference("one_path", "nll", "sequence_mean", "llama", False)
    assert sum(res["empty"]["empty"] for res in ranks) == len(ranks) - 1
    assert ranks[0]["empty"]["report"]["empty_ranks"] == list(range(1, len(ranks)))
    for res in ranks:
        assert_grads_match(res["empty"]["grads"], tree_model)
        assert_grads_match(res["empty"]["grads"], hf_model)
        assert abs(res["empty"]["loss"] - tree_loss) <= FP32_TOL * max(1.0, abs(tree_loss))


@pytest.mark.distributed
def test_assignment_is_deterministic(ranks2):
    """Same plan on every rank (each spawned process has its own hash seed), across
    calls, and in this process."""
    world = len(ranks2)
    for key, ids in ranks2[0]["plans"].items():
        kind, method, cm = key.split("/")
        here = plan_partition(forest_of(kind), world, CostModel.token_count() if cm == "tok" else None, method=method)
        again = plan_partition(forest_of(kind), world, CostModel.token_count() if cm == "tok" else None, method=method)
        assert [a.tolist() for a in here.sequence_ids] == ids == [a.tolist() for a in again.sequence_ids], key
        assert here.digest() == again.digest()
        for res in ranks2[1:]:
            assert res["plans"][key] == ids, key


@pytest.mark.distributed
def test_non_finite_loss_fails_every_rank(ranks2):
    from hf_models import make_model

    # the rank that owns sequence 0 (where the bad term is) must be the one named
    spec = dtree.TreeRuntime(make_model("llama"), group_tokens=0).spec
    plan = plan_partition(forest_of("mixed"), 2, CostModel.from_spec(spec))
    owner = next(r for r in range(2) if 0 in plan.sequence_ids[r])
    for res in ranks2:
        got = res["nonfinite"]
        assert got["raised"] is not None
        assert list(got["failures"]) == [owner]
        assert f"failed on rank {owner} of 2: ValueError: loss is not finite" in got["raised"]
        assert "sequence 0, position 3" in got["raised"]  # the batch's sequence index, not the rank-local one
        assert got["same"], "param.grad changed although the step failed"


@pytest.mark.distributed
def test_out_of_memory_fails_every_rank(ranks2):
    for res in ranks2:
        assert res["oom"]["raised"] is not None
        assert list(res["oom"]["failures"]) == [1]
        assert "OutOfMemoryError" in res["oom"]["raised"] and "simulated" in res["oom"]["raised"]
        assert res["oom"]["grads_none"]


@pytest.mark.distributed
def test_different_batches_are_detected(ranks2):
    for res in ranks2:
        assert res["mismatch"] is not None and "different partitions" in res["mismatch"]


@pytest.mark.distributed
def test_ddp(ranks2):
    tree_model, hf_model, tree_loss, _ = reference("mixed", "ppo", "token_mean", "qwen2", True)
    for res in ranks2:
        assert res["ddp"]["sync"] == "ddp"
        assert_grads_match(res["ddp"]["grads"], tree_model)
        assert_grads_match(res["ddp"]["grads"], hf_model)
        assert abs(res["ddp"]["loss"] - tree_loss) <= FP32_TOL * max(1.0, abs(tree_loss))


@pytest.mark.distributed
def test_fsdp2(ranks2):
    if "skipped" in ranks2[0]["fsdp"]:
        pytest.skip(ranks2[0]["fsdp"]["skipped"])
    tree_model, hf_model, tree_loss, _ = reference("mixed", "ppo", "sequence_mean", "llama", False)
    for res in ranks2:
        got = res["fsdp"]
        assert got["sync"] == "fsdp2"
        assert got["raised"] is not None and "not finite" in got["raised"]
        assert got["after_fail_none"], "a failed FSDP step left gradients behind"
        assert_grads_match(got["grads"], tree_model, scale=2.0)  # two steps accumulated
        assert_grads_match(got["grads"], hf_model, scale=2.0)
        for value in got["losses"]:
            assert abs(value - tree_loss) <= FP32_TOL * max(1.0, abs(tree_loss))
    tree_model, hf_model, tree_loss, _ = reference("one_path", "nll", "sequence_mean", "llama", False)
    for res in ranks2:
        got = res["fsdp"]
        assert got["empty_ranks"] == [1]
        assert_grads_match(got["empty_grads"], tree_model)
        assert_grads_match(got["empty_grads"], hf_model)
        assert abs(got["empty_loss"] - tree_loss) <= FP32_TOL * max(1.0, abs(tree_loss))


# ---------------------------------------------------------------------- single-process unit tests
def test_single_process_trainer_matches_runtime():
    """Without torch.distributed the trainer is the runtime plus a grad guard."""
    from hf_models import make_model

    from dtree.distributed import DistributedStepError, DistributedTreeTrainer

    with one_thread():
        _single_process_trainer(make_model, DistributedStepError, DistributedTreeTrainer)


def _single_process_trainer(make_model, DistributedStepError, DistributedTreeTrainer):
    model = make_model("llama")
    ref = copy.deepcopy(model)
    trainer = DistributedTreeTrainer(model, config=dtree.RuntimeConfig(group_tokens=0))
    out = trainer.step(forest_of("mixed"), dtree.losses.nll("token_mean"))
    want = dtree.TreeRuntime(ref, group_tokens=0).forward_backward(forest_of("mixed"), dtree.losses.nll("token_mean"))
    assert abs(out.loss - want.loss) < 1e-6 and out.partition.world_size == 1
    assert_grads_match(_grads(model), ref, tol=1e-6)
    seqs, _ = batch("mixed")
    den = [[1.0] * len(s) for s in seqs]
    den[4][1] = 0.0
    before = _grads(model)
    want_error = r"rank 0 of 1: ValueError: loss is not finite .* sequence 4, position 1"
    with pytest.raises(DistributedStepError, match=want_error):
        trainer = DistributedTreeTrainer(model, config=dtree.RuntimeConfig(group_tokens=0))
        trainer.step(dtree.Forest.from_sequences(seqs, den=den), div_loss())
    assert _same(before, _grads(model))


def test_nnls_known_solution():
    # unconstrained optimum has a negative coefficient; NNLS clamps it and refits the rest
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([2.0, -1.0, 1.0])
    x, res = nnls(a, b)
    assert np.allclose(x, [1.5, 0.0]) and math.isclose(res, math.sqrt(0.25 + 1 + 0.25))
    # exact non-negative solution is recovered
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, size=(20, 5))
    truth = np.array([0.0, 2.0, 0.5, 0.0, 3.0])
    x, res = nnls(a, a @ truth)
    assert np.allclose(x, truth, atol=1e-9) and res < 1e-9
    # optimality (KKT) on random problems: x >= 0, gradient <= 0 where x = 0, ~0 where x > 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        a, b = rng.normal(size=(15, 6)), rng.normal(size=15)
        x, _ = nnls(a, b)
        w = a.T @ (b - a @ x)
        assert np.all(x >= 0)
        assert np.all(w[x == 0] <= 1e-9) and np.allclose(w[x > 0], 0, atol=1e-9)


def _brute_force(costs, bins):
    best = math.inf
    for assign in itertools.product(range(bins), repeat=len(costs)):
        loads = [0.0] * bins
        for c, b in zip(costs, assign):
            loads[b] += c
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_lpt_and_kk_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    bins = int(rng.integers(2, 4))
    costs = [float(c) for c in rng.integers(1, 30, size=int(rng.integers(1, 8)))]
    opt = _brute_force(costs, bins)
    for fn in (lpt, karmarkar_karp):
        out = fn(costs, bins)
        assert len(out) == bins and sorted(i for b in out for i in b) == list(range(len(costs)))
        got = makespan(costs, out)
        assert got >= opt - 1e-9
        assert got <= (4 / 3 - 1 / (3 * bins)) * opt + 1e-9 or fn is karmarkar_karp
        if len(costs) <= bins + 1:  # with at most one pair to share a bin, both are optimal
            assert math.isclose(got, opt)


def test_balancers_known_cases():
    # optimum 15 = {8, 7} {6, 5, 4}; neither heuristic finds it, differencing gets closer:
    costs = [8, 7, 6, 5, 4]
    assert makespan(costs, lpt(costs, 2)) == 17  # {8, 5, 4} {7, 6}
    assert makespan(costs, karmarkar_karp(costs, 2)) == 16  # 8-7, 6-5 -> {4, 1, 1} -> 3 -> 2: (30 + 2) / 2
    assert lpt([], 3) == [[], [], []] and karmarkar_karp([], 3) == [[], [], []]
    assert karmarkar_karp([1.0, 1.0, 1.0], 3) == [[0], [1], [2]]  # ties by index


def test_cost_features_and_subset():
    forest = forest_of("mixed")
    f = forest_features(forest)
    assert f == CostFeatures(fixed=1, nodes=forest.num_nodes, tokens=forest.num_unique_tokens,
                             attention=float((forest.positions + 1).sum()))
    # attention = sum over nodes of prefix x length + causal part
    pre = forest.positions[forest.node_start]
    n = forest.node_length
    assert f.attention == float((pre * n + n * (n + 1) // 2).sum())
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = sorted(rng.choice(forest.num_sequences, size=int(rng.integers(1, forest.num_sequences)), replace=False))
        assert sequence_features(forest, ids) == forest_features(forest.subset(ids)), ids
    assert forest_features(None) == CostFeatures()


def test_cost_model_defaults_fit_and_json(tmp_path):
    cm = CostModel.from_spec(NOMINAL_SPEC)
    forest = forest_of("mixed")
    assert cm.cost(forest) > 0 and cm.cost(None) == 0.0
    # FLOP terms come from the spec's helpers
    c = cm.coefficients
    assert math.isclose(c["tokens"] / c["attention"],
                        NOMINAL_SPEC.forward_flops_per_token() / NOMINAL_SPEC.forward_attention_flops_per_key())
    # fit recovers known coefficients from exact times
    truth = CostModel({"fixed": 1e-3, "nodes": 2e-4, "tokens": 3e-6, "attention": 0.0})
    work = [(5, 100, 4e3), (50, 900, 5e4), (12, 2e4, 1e7), (3, 40, 900), (80, 5e3, 3e5)]
    rows = [CostFeatures(1, n, t, a) for n, t, a in work]
    fitted, report = CostModel.fit(rows, [truth.cost(r) for r in rows])
    for k, v in truth.coefficients.items():
        assert math.isclose(fitted.coefficients[k], v, rel_tol=1e-6, abs_tol=1e-12), (k, fitted.coefficients)
    assert report.r2 > 0.999999 and report.max_abs_rel_error < 1e-6
    path = tmp_path / "cm.json"
    fitted.save(str(path))
    again = CostModel.load(str(path))
    assert again.coefficients == fitted.coefficients
    assert json.loads(path.read_text())["format"] == "dtree-cost-model"
    with pytest.raises(ValueError, match="finite and >= 0"):
        CostModel({"tokens": -1.0})
    with pytest.raises(ValueError, match="unknown cost features"):
        CostModel({"flops": 1.0})


@pytest.mark.parametrize("kind", ["mixed", "one_tree", "one_path"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("method", ["auto", "lpt", "kk"])
def test_partition_covers_every_sequence_once(kind, world, method):
    forest = forest_of(kind)
    cm = CostModel.default()
    for plan in (plan_partition(forest, world, cm, method=method),
                 plan_partition(forest, world, cm, method=method, split_threshold=cm.cost(forest) / 7),
                 plan_partition(forest, world, cm, method=method, split=False)):
        ids = np.concatenate(plan.sequence_ids)
        assert sorted(ids.tolist()) == list(range(forest.num_sequences))
        rep = plan.report
        assert len(rep.rank_costs) == world
        for r in range(world):
            part = plan.forest(r)
            assert (part is None) == (len(plan.sequence_ids[r]) == 0)
            assert math.isclose(rep.rank_costs[r], cm.cost(part), rel_tol=1e-12)
            # whole sequences with their fields: the rank's forest is exactly the subset
            if part is not None:
                for i, s in enumerate(plan.sequence_ids[r]):
                    assert np.array_equal(part.sequence(i), forest.sequence(s))
                    for name in forest.fields:
                        assert np.array_equal(part.field(name, i), forest.field(name, s))
        assert rep.imbalance >= 1.0 - 1e-12
        assert rep.recomputed_tokens == sum(rep.rank_unique_tokens) - forest.num_unique_tokens >= 0


def test_split_pieces_respect_threshold_and_paths():
    forest = forest_of("one_tree")
    cm = CostModel.token_count()
    pieces = split_forest(forest, cm, threshold=12)
    assert len(pieces) > 1
    assert sorted(np.concatenate([p.sequences for p in pieces]).tolist()) == list(range(forest.num_sequences))
    for p in pieces:
        # exact features of the piece's own forest; a single path may exceed the threshold
        assert p.features.as_tuple()[1:] == forest_features(forest.subset(p.sequences)).as_tuple()[1:]
        assert p.cost <= 12 or len(p.sequences) == 1 or forest.subset(p.sequences).num_nodes == 1


def test_partition_balances_better_than_whole_trees():
    forest = forest_of("one_tree")
    cm = CostModel.default()
    whole = plan_partition(forest, 2, cm, split=False).report
    split = plan_partition(forest, 2, cm).report
    assert whole.empty_ranks == [1] and split.empty_ranks == []
    assert split.max_cost < whole.max_cost and split.split_trees == [0]


def test_calibrate_recovers_known_coefficients(tmp_path):
    """calibrate() on the built-in synthetic shapes, timed by a known cost model: the fit
    recovers its coefficients (the shapes make all four identifiable) and saves them."""
    from hf_models import make_model

    from dtree.bench.calibrate import calibrate

    truth = CostModel({"fixed": 2e-3, "nodes": 5e-5, "tokens": 4e-6, "attention": 3e-9})
    timed = []

    def timer(runtime, forest, repeats, warmup):
        timed.append((forest.num_unique_tokens, repeats, warmup))
        return truth.cost(forest)

    path = tmp_path / "cm.json"
    config = dtree.RuntimeConfig(group_tokens=256)
    cm, report = calibrate(make_model("llama"), config, repeats=2, out_path=str(path), warmup=0,
                           budget_tokens=512, log=None, timer=timer)
    assert len(timed) == 8 and {(r, w) for _, r, w in timed} == {(2, 0)}  # 4 shapes x 2 sizes
    for name, value in truth.coefficients.items():
        assert math.isclose(cm.coefficients[name], value, rel_tol=1e-6), (name, cm.coefficients)
    assert report.r2 > 0.999999 and report.max_abs_rel_error < 1e-6 and report.num_samples == 8
    loaded = CostModel.load(str(path))
    assert loaded.coefficients == cm.coefficients
    # every runtime option the coefficients hold for, defaults included
    assert loaded.meta["runtime"] == config.as_dict() and loaded.meta["runtime"]["group_tokens"] == 256
    assert loaded.meta["repeats"] == 2


def test_calibrate_times_real_steps_and_the_cli_writes_a_loadable_model(tmp_path, capsys):
    """The default timer runs real steps; ``dtree calibrate`` writes a cost model that loads,
    records the runtime settings it was measured with, and predicts a positive cost."""
    from hf_models import make_model

    from dtree.bench.calibrate import calibrate, synthetic_forest
    from dtree.cli import main

    forests = [synthetic_forest(kind, 256, seed=1, vocab_size=97) for kind in ("wide", "long", "deep", "grpo")]
    wide, long = forests[0], forests[1]  # the shapes stress different terms
    assert wide.num_nodes / wide.num_unique_tokens > long.num_nodes / long.num_unique_tokens
    lines = []
    with one_thread():
        cm, report = calibrate(make_model("llama"), dtree.RuntimeConfig(group_tokens=256), forests, repeats=1,
                               warmup=0, log=lines.append)
    assert report.num_samples == 4 and any("R^2" in line for line in lines)
    assert all(v >= 0 and math.isfinite(v) for v in cm.coefficients.values()) and cm.cost(wide) > 0

    path = tmp_path / "cli.json"
    with one_thread():
        rc = main(["calibrate", "--model", "tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                   "--budget-tokens", "64", "--group-tokens", "0", "--mode", "recompute", "--out", str(path)])
    assert rc == 0 and f"saved {path}" in capsys.readouterr().out
    loaded = CostModel.load(str(path))
    want = dtree.RuntimeConfig(mode="recompute", group_tokens=0, chunk_size=2048, attention="auto")
    assert loaded.meta["runtime"] == want.as_dict()
    assert loaded.meta["device"] == "cpu" and loaded.meta["repeats"] == 1
    assert all(v >= 0 and math.isfinite(v) for v in loaded.coefficients.values())
    assert loaded.cost(synthetic_forest("wide", 64, vocab_size=97)) > 0
