"""The dtree verl engine (dtree.integrations.verl) against verl's own loss on HF run per
row: after one ``train_batch`` (verl's ``BaseEngine.train_batch``: zero_grad, the
engine's forward/backward, verl's optimizer step at lr 0), every parameter's gradient
equals that of verl's ``ppo_loss`` (imported) applied to HF log-probs computed row by
row; CPU, float32, 1e-5 relative. Every loss_agg_mode, policy loss and KL type, on
the fast path (dtree's losses) and the two-pass path (verl's loss_function on dtree's
log-probs); one process and 2 gloo ranks (FSDP2 over gloo).

verl's FSDP engine runs on the CPU through tests/verl_cpu.py (a CPU platform in verl's
platform registry); the batch is laid out by verl's own left_right_2_no_padding, as
verl's trainer hands it to update_actor. Needs verl (CI's oldest-transformers stage)."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", reason="needs verl 0.9.1: pip install 'dtree[verl]' (transformers < 5.11)")

import verl_cpu  # noqa: E402
from hf_models import make_model  # noqa: E402
from rl_reference import path_logprobs_entropy  # noqa: E402
from spawn import free_port, init_gloo, run_ranks  # noqa: E402
from test_losses_verl import KL_TYPES, PROMPT_LENS, SEQS, per_token_fields  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402
from verl_reference import VerlSettings, response_batch, response_values, verl_loss  # noqa: E402

import dtree.integrations.verl  # noqa: E402,F401  (registers backend "dtree")

verl_cpu.use_cpu_platform()  # before verl's engines are built (in spawned ranks: at this module's import)

TEMPERATURE = 0.8
TOL = 1e-5
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KL = dict(use_kl_loss=True, kl_loss_coef=0.05)
CASES = {
    **{f"vanilla-{agg}": VerlSettings(loss_agg_mode=agg, clip_ratio_c=1.5, **KL) for agg in AGG_MODES},
    **{f"{mode}-kl-entropy": VerlSettings(loss_mode=mode, kl_loss_type="k3+", entropy_coeff=0.01, **KL)
       for mode in ("vanilla", "cispo", "sapo", "gpg", "geo_mean")},
    "sapo-seq-mean-token-sum-norm": VerlSettings(loss_mode="sapo", loss_agg_mode="seq-mean-token-sum-norm",
                                                 entropy_coeff=0.02, **KL),
    "gspo-seq-mean-token-mean": VerlSettings(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean",
                                             clip_ratio_low=0.05, clip_ratio_high=0.08, **KL),
    "gspo-entropy-bonus": VerlSettings(loss_mode="gspo", entropy_coeff=0.01),
    **{f"kl-{kl}": VerlSettings(kl_loss_type=kl, **KL) for kl in KL_TYPES},
}


def _fields(name: str) -> dict:
    return per_token_fields(seed=4, per_token_advantages=name.startswith("gspo"))


def _loss_function(st: VerlSettings, rows: int):
    return functools.partial(ppo_loss, config=st.actor_config(rows))


def _train(engine, st: VerlSettings, name: str, rows: list[int], fast: bool) -> tuple[dict, dict]:
    """One train_batch on ``rows`` (this rank's share); (full gradients, metrics)."""
    fields = _fields(name)
    batch = response_batch([SEQS[i] for i in rows], [PROMPT_LENS[i] for i in rows],
                           {k: [v[i] for i in rows] for k, v in fields.items()})
    td = verl_cpu.actor_batch(batch, TEMPERATURE, global_batch_size=len(SEQS), calculate_entropy=bool(st.entropy_coeff))
    engine.fast_path = fast  # read by the dtree engine only
    with engine.train_mode(zero_grad_on_exit=False):
        out = engine.train_batch(td, _loss_function(st, len(SEQS)))
    return verl_cpu.full_grads(engine.module), out["metrics"]


_REFERENCE: dict[str, dict] = {}


def reference_grads(path: str, name: str) -> dict[str, torch.Tensor]:
    """verl's ppo_loss on HF log-probs computed per row, over the whole batch (every row,
    one process: the gradient a data-parallel step must equal)."""
    if name not in _REFERENCE:
        st, fields = CASES[name], _fields(name)
        model = make_model("qwen2", tied=False).__class__.from_pretrained(path, attn_implementation="sdpa")
        batch = response_batch(SEQS, PROMPT_LENS, fields)
        lps, ents = zip(*(path_logprobs_entropy(model, s, TEMPERATURE) for s in SEQS))
        verl_loss(st, batch, list(lps), list(ents) if st.entropy_coeff else None).backward()
        _REFERENCE[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return _REFERENCE[name]


def assert_grads_equal(got: dict, want: dict, what: str) -> None:
    errs = {n: float((got[n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in want.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] < TOL, f"{what}: gradient of {worst} off by {errs[worst]:.2e}"


def build_engine(path: str, **engine):
    configs = verl_cpu.engine_configs(path, **engine)
    eng = EngineRegistry.new("language_model", "dtree", model_config=configs[0], engine_config=configs[1],
                             optimizer_config=configs[2], checkpoint_config=configs[3])
    eng.initialize()
    return eng


@pytest.fixture(scope="module")
def model_path():
    return verl_cpu.save_model(make_model("qwen2", tied=False))


@pytest.fixture(scope="module")
def engine(model_path):
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    init_gloo(0, 1, free_port())
    try:
        yield build_engine(model_path)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "two_pass"])
@pytest.mark.parametrize("name", list(CASES))
def test_train_batch_equals_verls_loss_on_hf(engine, model_path, name, fast):
    grads, metrics = _train(engine, CASES[name], name, list(range(len(SEQS))), fast)
    assert_grads_equal(grads, reference_grads(model_path, name), name)
    st = CASES[name]
    native = st.loss_mode in ("vanilla", "cispo", "sapo", "gspo") and not (st.loss_mode == "gspo" and st.entropy_coeff)
    assert metrics["dtree/fast_path"] == [float(fast and native)]
    assert "actor/pg_loss" in metrics and "grad_norm" in metrics  # verl's own metrics, in verl's format
    assert metrics["dtree/compression"][0] > 1.0


@pytest.mark.parametrize("name", ["vanilla-seq-mean-token-mean", "sapo-kl-entropy", "gspo-seq-mean-token-mean"])
def test_dtree_engine_equals_verls_own_fsdp_engine(engine, model_path, monkeypatch, name):
    """The same batch through verl's own FSDP engine (remove-padding, its micro-batch
    loop) and through dtree's: the same gradients. verl 0.9.1's model patch imports
    TRL's AutoModelForCausalLMWithValueHead, which TRL 1.x (dtree[test]) no longer has;
    for this model under SDPA the patch only swaps flash-attn's varlen function, so it is
    skipped here."""
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.setattr(transformer_impl, "apply_monkey_patch", lambda **kw: None)
    configs = verl_cpu.engine_configs(model_path)
    verl_engine = transformer_impl.FSDPEngineWithLMHead(*configs)
    verl_engine.initialize()
    verl_grads, _ = _train(verl_engine, CASES[name], name, list(range(len(SEQS))), fast=True)
    assert_grads_equal(verl_grads, reference_grads(model_path, name), f"verl's engine, {name}")
    for fast in (True, False):
        grads, _ = _train(engine, CASES[name], name, list(range(len(SEQS))), fast)
        assert_grads_equal(grads, verl_grads, f"dtree engine vs verl's engine, {name}, fast={fast}")


def test_readme_recipe_selects_the_dtree_engine():
    """The README's Hydra overrides, composed with verl's own ppo_trainer.yaml: the actor
    and the reference policy resolve to the dtree engine."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from dtree.integrations.verl import DTreeEngine

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path=unused",
            "actor_rollout_ref.model.external_lib=dtree.integrations.verl", "actor_rollout_ref.actor.strategy=dtree",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=16",
        ])
    assert cfg.actor_rollout_ref.ref.strategy == "dtree"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert EngineRegistry.get_engine_cls("language_model", actor.engine.strategy) is DTreeEngine


def test_infer_batch_is_compute_log_prob(engine, model_path):
    """compute_log_prob / ref log-probs: verl's layout of HF's per-row log-probs and entropies."""
    fields = _fields("infer")
    batch = response_batch(SEQS, PROMPT_LENS, fields)
    td = verl_cpu.actor_batch(batch, TEMPERATURE, global_batch_size=len(SEQS), calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(td)
    model = make_model("qwen2", tied=False).__class__.from_pretrained(model_path, attn_implementation="sdpa")
    with torch.no_grad():
        lps, ents = zip(*(path_logprobs_entropy(model, s, TEMPERATURE) for s in SEQS))
    mask = batch.response_mask.bool() | (batch.responses != 0)
    for key, rows in (("log_probs", lps), ("entropy", ents)):
        got = no_padding_2_padding(out["model_output"][key], td)
        want = response_values(list(rows), batch)
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert out["loss"] == [1.0] and out["metrics"] == {}


def test_refusals_name_the_setting(engine, model_path):
    for engine_kw, match in ((dict(ulysses_sequence_parallel_size=2), "ulysses"),):
        with pytest.raises(ValueError, match=match):
            build_engine(model_path, **engine_kw)
    from dtree.integrations.verl_engine_checks import check_settings

    for model_kw, match in ((dict(use_fused_kernels=True), "use_fused_kernels"), (dict(lora_rank=8), "LoRA"),
                            (dict(model_type="value_model"), "language_model")):
        with pytest.raises(ValueError, match=match):
            check_settings(SimpleNamespace(**model_kw), verl_cpu.engine_configs(model_path)[1])
    batch = response_batch(SEQS, PROMPT_LENS, _fields("refusal"))
    st = CASES["vanilla-token-mean"]
    before = {n: None if p.grad is None else p.grad.clone() for n, p in engine.module.named_parameters()}
    td = verl_cpu.actor_batch(batch, TEMPERATURE, global_batch_size=len(SEQS), calculate_entropy=False)
    td["position_ids"] = torch.nested.as_nested_tensor([p + 3 for p in td["position_ids"].unbind()], layout=torch.jagged)
    with pytest.raises(ValueError, match="position_ids of row 0"):
        engine.forward_backward_batch(td, _loss_function(st, len(SEQS)))
    td = verl_cpu.actor_batch(batch, TEMPERATURE, global_batch_size=len(SEQS), calculate_entropy=False)
    verl_cpu.tu.assign_non_tensor(td, temperature=torch.tensor([0.7, 0.8] * 4))
    with pytest.raises(ValueError, match="per-sample temperatures"):
        engine.forward_backward_batch(td, _loss_function(st, len(SEQS)))
    td = verl_cpu.actor_batch(batch, TEMPERATURE, global_batch_size=len(SEQS), calculate_entropy=False)
    td["attention_mask"][3, batch.prompts.shape[1] :] = 0
    with pytest.raises(ValueError, match="row 3 has 0 response tokens"):
        engine.forward_backward_batch(td, _loss_function(st, len(SEQS)))
    after = {n: None if p.grad is None else p.grad.clone() for n, p in engine.module.named_parameters()}
    assert all((before[n] is None and after[n] is None) or torch.equal(before[n], after[n]) for n in before)


# ---------------------------------------------------------------------- 2 gloo ranks
RANK_ROWS = [[0, 2, 5, 6], [1, 3, 4, 7]]  # each rank's share (a GRPO group split over ranks)
DISTRIBUTED_CASES = ["vanilla-seq-mean-token-mean", "sapo-kl-entropy", "gspo-seq-mean-token-mean", "geo_mean-kl-entropy",
                     "vanilla-token-mean"]


def _rank_worker(rank: int, world: int, path: str) -> dict:
    engine = build_engine(path)
    res = {}
    for name in DISTRIBUTED_CASES:
        for fast in (True, False):
            grads, metrics = _train(engine, CASES[name], name, RANK_ROWS[rank], fast)
            res[(name, fast)] = (grads, metrics["dtree/fast_path"])
    return res


@pytest.mark.distributed
def test_two_gloo_ranks_equal_one_process_of_hf(model_path):
    ranks = run_ranks(_rank_worker, 2, (model_path,), timeout_s=400, prefix="dtree_verl2_")
    for name in DISTRIBUTED_CASES:
        want = reference_grads(model_path, name)
        native = CASES[name].loss_mode != "geo_mean"
        for fast in (True, False):
            for r in range(2):
                grads, used_fast = ranks[r][(name, fast)]
                assert used_fast == [float(fast and native)]
                assert_grads_equal(grads, want, f"{name}, fast={fast}, rank {r}")


def test_h100_script_smoke(tmp_path):
    """benchmarks/verl_engine_h100.py with SMOKE=1: both engines, both workloads, the
    agreement rule and the reports, on the CPU with the tiny model (its own process: it
    builds its own process group)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "verl_engine_h100.py"), "--steps", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "verl_engine_cpu_tiny.json").read_text())
    assert set(report["rows"]) == {"grpo", "agentic"}
    for workload, rows in report["rows"].items():
        assert [r["setting"] for r in rows][1:] == [
            "dtree (fast path)", "dtree (two-pass: verl's loss)", "verl: rmpad + flash + dyn-bsz, ckpt on",
            "verl: rmpad + flash + dyn-bsz, ckpt off"]
        assert all("error" not in r and r["seconds"] > 0 for r in rows), rows
        assert report["agreement"][workload]["passed"]
    assert report["stats"]["agentic"]["compression_ratio"] > 1.5
    assert "PrefixGrouper" in (tmp_path / "verl_engine_cpu_tiny.md").read_text()
