"""What the dtree verl engine refuses, each with the setting to change: checked when the
engine is built (verl's model and engine configs) and on every batch (the TensorDict's
flags). Imports no verl: configs and batches are read by attribute and key."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_batch", "check_settings", "temperature_of"]


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if hasattr(obj, "get"):
        try:
            return obj.get(name, default)
        except TypeError:
            pass
    return getattr(obj, name, default)


def check_settings(model_config: Any, engine_config: Any) -> None:
    """ValueError naming the verl setting to change, for what the dtree engine cannot run."""
    refusals = [
        (_get(engine_config, "ulysses_sequence_parallel_size", 1) > 1,
         "ulysses_sequence_parallel_size > 1: Ulysses splits every sequence over ranks, while dtree's walk keeps "
         "each root-to-leaf path on one rank (dtree splits trees between ranks instead); set "
         "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"),
        (_get(model_config, "use_fused_kernels", False),
         "use_fused_kernels: verl's fused kernels replace the model's forward to return log-probs; dtree computes "
         "its own (a fused LM-head op on CUDA); set actor_rollout_ref.model.use_fused_kernels=False"),
        (_get(model_config, "lora_rank", 0) > 0,
         "LoRA (lora_rank > 0) is not supported by the dtree verl engine yet (dtree's own PEFT support is; the "
         "engine's FSDP2 sync over a PEFT model is untested); set actor_rollout_ref.model.lora_rank=0"),
        (_get(model_config, "enable_activation_offload", False),
         "enable_activation_offload: verl's activation offload hooks assume its own forward order; set "
         "actor_rollout_ref.model.enable_activation_offload=False (dtree's memory policy bounds activations)"),
        (_get(_get(model_config, "tiled_mlp"), "enabled", False),
         "tiled_mlp: verl's TiledMLP patch is not applied under dtree; set actor_rollout_ref.model.tiled_mlp.enabled=False"),
        (_get(_get(model_config, "mtp"), "enable", False),
         "mtp.enable: multi-token-prediction layers are not trained by dtree; set actor_rollout_ref.model.mtp.enable=False"),
        (_get(_get(engine_config, "qat"), "enable", False),
         "qat.enable: quantization-aware training is not supported by the dtree engine"),
        (_get(engine_config, "fsdp_size", -1) not in (-1, None) and torch.distributed.is_initialized()
         and 0 < _get(engine_config, "fsdp_size", -1) < torch.distributed.get_world_size(),
         "fsdp_size smaller than the world size (HSDP): dtree's FSDP2 gradient sync shards over all ranks; set "
         "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"),
        (_get(model_config, "model_type", "language_model") != "language_model",
         f"model_type={_get(model_config, 'model_type')!r}: the dtree engine trains causal LMs (language_model)"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(f"the dtree verl engine does not support {message}")


def check_batch(data: Any) -> None:
    """ValueError for a batch flag the dtree engine cannot honor exactly."""
    from verl.utils import tensordict_utils as tu  # only reached from the engine, with verl installed
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    def flag(key: str, default: Any = None) -> Any:
        return tu.get_non_tensor_data(data=data, key=key, default=default)

    pad_mode = flag("pad_mode", DatasetPadMode.NO_PADDING)
    refusals = [
        (pad_mode != DatasetPadMode.NO_PADDING, f"pad_mode={pad_mode}: only verl's NO_PADDING layout is read"),
        ("multi_modal_inputs" in data.keys(), "multi_modal_inputs: the dtree engine trains text-only models"),
        (flag("distillation_use_topk", False), "top-k distillation (distillation_use_topk)"),
        (flag("calculate_sum_pi_squared", False),
         "calculate_sum_pi_squared (the optimal-token baseline's sum of squared probabilities)"),
        (flag("enable_routing_replay", False), "MoE routing replay (router_replay.mode)"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(f"the dtree verl engine does not support {message}")


def temperature_of(data: Any) -> float:
    """The batch's one sampling temperature (a per-sample tensor must hold one value)."""
    from verl.utils import tensordict_utils as tu

    t = tu.get_non_tensor_data(data=data, key="temperature", default=None)
    if t is None and "temperature" in data.keys():
        t = data["temperature"]
    if t is None:
        return 1.0
    if isinstance(t, torch.Tensor):
        values = torch.unique(t.detach().float().cpu())
        if values.numel() != 1:
            raise ValueError(
                f"per-sample temperatures {values.tolist()[:4]}...: the dtree engine computes one temperature per "
                "batch; use one rollout temperature"
            )
        return float(values[0])
    return float(t)
