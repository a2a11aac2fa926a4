"""TreeGRPOTrainer under accelerate's mixed precision: ``bf16=True`` over a float32 model
(GRPOConfig's default on CPU) goes through dtree, under the same bf16 autocast TRL's own
path runs in, and is as accurate as GRPOTrainer there (the flash-attention rule).

The reference is GRPOTrainer in float32 (no autocast). TRL's own bf16 run is off from it
by its bf16 rounding; the tree trainer's bf16 run may be off by at most 3 times that, per
parameter and per logged metric, plus a small absolute floor. Every step logs that it
went through dtree (``dtree/active``) and the forest's compression."""

from __future__ import annotations

import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from test_trl_trainer import config, save_tiny_model, train  # noqa: E402

import dtree  # noqa: E402
from dtree.integrations.trl import TreeGRPOTrainer  # noqa: E402

GRAD_RULE, FLOOR = 3.0, 1e-3  # dtree's error <= 3x TRL's own bf16 error + 1e-3 of the update


@pytest.fixture(scope="module")
def model_dir():
    return save_tiny_model()


def _errors(after: dict, ref: dict, before: dict) -> dict[str, tuple[float, float]]:
    """name -> (||after - ref||, ||ref - before||): the error and the update's size."""
    return {n: ((after[n] - ref[n]).norm().item(), (ref[n] - before[n]).norm().item()) for n in ref}


@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence")])
def test_bf16_autocast_over_fp32_goes_through_dtree(model_dir, loss_type, level):
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, optim="sgd", learning_rate=0.5)
    ref, ref_after, before = train(trl.GRPOTrainer, model_dir, config(bf16=False, **cfg))
    trl16, trl16_after, _ = train(trl.GRPOTrainer, model_dir, config(bf16=True, **cfg))
    assert trl16.accelerator.mixed_precision == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback
        warnings.filterwarnings("ignore", message=".*(rollout_func|experimental|deprecated).*")
        tree, tree_after, _ = train(TreeGRPOTrainer, model_dir, config(bf16=True, **cfg))
    assert all(p.dtype == torch.float32 for p in tree.model.parameters())

    trl_err, tree_err = _errors(trl16_after, ref_after, before), _errors(tree_after, ref_after, before)
    assert sum(e > 0 for e, _ in trl_err.values()) >= 4, "bf16 changed nothing: the rule would be empty"
    for name, (err, update) in tree_err.items():
        allowed = GRAD_RULE * trl_err[name][0] + FLOOR * update
        assert err <= allowed, f"{name}: dtree bf16 off by {err:.3e}, TRL's bf16 by {trl_err[name][0]:.3e}"
    # and it did run in bf16, as asked (not silently in float32: that error would be ~1e-5 of TRL's)
    assert sum(e for e, _ in tree_err.values()) > 0.25 * sum(e for e, _ in trl_err.values())

    logs = [h for h in tree.state.log_history if "loss" in h and "train_runtime" not in h]
    refs = [h for h in ref.state.log_history if "loss" in h and "train_runtime" not in h]
    trls = [h for h in trl16.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == len(refs) == len(trls) == 3
    for g, w, t in zip(logs, refs, trls):
        assert g["dtree/active"] == 1.0 and g["dtree/compression"] > 1.0  # the prompt is shared by its group
        for k in ("loss", "entropy", "kl", "clip_ratio/region_mean"):
            assert abs(g[k] - w[k]) <= GRAD_RULE * abs(t[k] - w[k]) + 1e-3 * max(1.0, abs(w[k])), (k, g[k], w[k], t[k])


def test_fallback_is_logged(model_dir):
    """A step on GRPOTrainer's own path logs dtree/active = 0 (and no compression)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree, _, _ = train(TreeGRPOTrainer, model_dir, config(loss_type="grpo", top_entropy_quantile=0.5, max_steps=1))
    logs = [h for h in tree.state.log_history if "loss" in h and "train_runtime" not in h]
    assert logs and all(h["dtree/active"] == 0.0 and "dtree/compression" not in h for h in logs)


def test_bf16_over_other_dtypes_still_falls_back(model_dir):
    datasets = pytest.importorskip("datasets")
    from test_trl_trainer import PROMPTS, TOKENIZER, Rollout, reward

    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = TreeGRPOTrainer(model=model_dir, reward_funcs=reward, args=config(bf16=True), train_dataset=ds,
                                  processing_class=TOKENIZER, rollout_func=Rollout())
    assert trainer._fallback_reason(trainer.model, training=True, inputs={}) is None
    trainer.model.to(torch.float64)
    reason = trainer._fallback_reason(trainer.model, training=True, inputs={})
    assert "bf16 autocast over a torch.float64 model" in reason
    assert dtree  # the package the trainer wraps
