"""dtree's losses equal TRL's own: ``GRPOTrainer._compute_loss`` from the installed trl,
run unmodified on a padded batch (prompt_ids / completion_ids, as GRPOTrainer holds
rollouts), against dtree on the same batch via ``from_prompt_completion``; every
parameter's gradient, the loss value and the logged clip fractions.

The harness is the smallest object ``_compute_loss`` reads (no GRPOTrainer, no
generation, no dataset): the config values it uses, an ``accelerate.Accelerator`` on
CPU, and the model with TRL's own fused LM head (``add_fused_lm_head``)."""

from __future__ import annotations

import copy
import types
from collections import defaultdict

import pytest
import torch
from hf_models import make_model
from reference import grad_errors
from test_runtime_exact import FP32_TOL

import dtree
from dtree.baselines import LinearizedTrainer
from dtree.losses import aggregation, cispo, gspo, ppo_clip, sapo

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")
accelerate = pytest.importorskip("accelerate")

PAD = 0
PROMPTS = [[3, 17, 42, 8], [3, 17, 42, 8], [3, 17, 42, 8], [3, 17, 42, 8], [9, 4, 4], [9, 4, 4]]
COMPLETIONS = [[5, 9, 11, 2], [5, 9, 23, 7, 1, 2], [6, 2], [5, 9, 11, 2], [12, 13, 14], [12, 15]]
MAX_COMPLETION = 8


def padded_batch(seed: int = 0) -> dict:
    """TRL's layout: left-padded prompts, right-padded completions, per-row advantages."""
    g = torch.Generator().manual_seed(seed)
    p_len, c_len = max(map(len, PROMPTS)), max(map(len, COMPLETIONS))
    prompt_ids = torch.tensor([[PAD] * (p_len - len(p)) + p for p in PROMPTS])
    completion_ids = torch.tensor([c + [PAD] * (c_len - len(c)) for c in COMPLETIONS])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in PROMPTS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for c in COMPLETIONS])
    completion_mask[5] = 0  # a row masked out whole (TRL's mask_truncated_completions)
    real = completion_mask.float()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(len(PROMPTS), generator=g),
        "old_per_token_logps": (torch.rand(real.shape, generator=g) * 2 - 5.6) * real,
        "ref_per_token_logps": (torch.rand(real.shape, generator=g) * 2 - 5.6) * real,
        "num_items_in_batch": completion_mask.sum(),
    }


def trl_compute_loss(model, inputs: dict, *, loss_type: str, beta: float = 0.0, epsilon: float = 0.2,
                     epsilon_high: float | None = None, delta: float | None = None, level: str = "token",
                     bias_correction: bool = True, sapo_temps=(1.0, 1.05)):
    """TRL's GRPOTrainer._compute_loss on ``model`` (patched with TRL's fused head);
    returns (loss, the metrics it logged)."""
    accelerator = accelerate.Accelerator(cpu=True)
    harness = types.SimpleNamespace(
        model=model, loss_type=loss_type, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        importance_sampling_level=level, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION, accelerator=accelerator, state=types.SimpleNamespace(global_step=0),
        args=types.SimpleNamespace(
            delta=delta, use_bias_correction_kl=bias_correction, steps_per_generation=1, report_to=[],
            sapo_temperature_pos=sapo_temps[0], sapo_temperature_neg=sapo_temps[1],
        ),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    harness._get_per_token_logps_and_entropies = types.MethodType(
        trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies, harness
    )
    model.train()
    loss = trl_grpo.GRPOTrainer._compute_loss(harness, model, inputs)
    return loss, {k: v[-1] for k, v in harness._metrics["train"].items()}


def dtree_forest(inputs: dict) -> dtree.Forest:
    return dtree.Forest.from_prompt_completion(
        inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
        advantages=inputs["advantages"], old_logprobs=inputs["old_per_token_logps"],
        ref_logprobs=inputs["ref_per_token_logps"],
    )


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2", tied=True)


def compare(model, dtree_loss, metric_names=(), **trl_kw):
    inputs = padded_batch()
    trl_model, tree_model = copy.deepcopy(model), copy.deepcopy(model)
    trl_utils.add_fused_lm_head(trl_model, outputs=("log_probs", "entropy"))
    trl_loss, trl_metrics = trl_compute_loss(trl_model, inputs, **trl_kw)
    trl_loss.backward()
    forest = dtree_forest(inputs)
    out = dtree.TreeRuntime(tree_model).forward_backward(forest, dtree_loss)
    errs = grad_errors(tree_model, trl_model)
    worst = max(errs, key=errs.get)
    assert errs[worst] < FP32_TOL, f"gradient of {worst} off by {errs[worst]:.2e}"
    assert out.loss == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-7)
    if metric_names:
        # the runtime reports them (both paths), and so does the linearized baseline (one pass)
        reports = [out.metrics]
        if not isinstance(dtree_loss, dtree.losses.SequenceLoss):
            reports.append(LinearizedTrainer(copy.deepcopy(model)).forward_backward(forest, dtree_loss).metrics)
        for ours in reports:
            for name in metric_names:
                assert ours[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-7), name
    return trl_metrics


CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_token_level_loss_types(model, loss_type, beta):
    agg = aggregation(loss_type, max_completion_length=MAX_COMPLETION if loss_type == "dr_grpo" else None)
    loss = ppo_clip(0.2, epsilon_high=0.28, kl_coef=beta, kl_bias_correction=True, log_entropy=True, **agg)
    names = CLIP_METRICS + ("entropy",) + (("kl",) if beta else ())
    got = compare(model, loss, names, loss_type=loss_type, beta=beta, epsilon_high=0.28)
    assert 0 < got["clip_ratio/region_mean"] < 1  # the batch exercises the clip


def test_delta_and_kl_without_bias_correction(model):
    loss = ppo_clip(0.2, delta=1.3, kl_coef=0.1, **aggregation("grpo"))
    compare(model, loss, CLIP_METRICS + ("kl",), loss_type="grpo", beta=0.1, delta=1.3, bias_correction=False)


def test_cispo(model):
    loss = cispo(ratio_max=1.5, kl_coef=0.04, kl_bias_correction=True, **aggregation("cispo"))
    got = compare(model, loss, ("cispo_clip_ratio", "kl"), loss_type="cispo", beta=0.04, epsilon_high=1.5)
    assert 0 < got["cispo_clip_ratio"]


def test_sapo(model):
    compare(model, sapo(1.0, 1.05, **aggregation("sapo")), loss_type="sapo")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_sequence_level_is_gspo(model, loss_type, beta):
    agg = aggregation(loss_type, max_completion_length=MAX_COMPLETION if loss_type == "dr_grpo" else None)
    loss = gspo(0.2, epsilon_high=0.28, kl_coef=beta, kl_bias_correction=True, log_entropy=True, **agg)
    names = CLIP_METRICS + ("entropy",) + (("kl",) if beta else ())
    compare(model, loss, names, loss_type=loss_type, beta=beta, epsilon_high=0.28, level="sequence")
