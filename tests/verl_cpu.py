"""Running verl's FSDP engine machinery on CPU for the dtree engine's tests.

verl 0.9.1 knows CUDA, NPU and ROCm platforms and, without an accelerator, falls back
to CUDA (``get_device_id()`` then fails). Its platform registry is its plugin point for
other hardware (``verl/plugin/platform``): :func:`use_cpu_platform` registers
:class:`PlatformCPU` there and selects it (gloo collectives, CPU tensors), so verl's real ``FSDPEngine`` (model building, FSDP2
``fully_shard`` on a gloo mesh, optimizer, scheduler) runs here unchanged. This is test
infrastructure, not part of dtree: on GPUs verl's own CUDA platform is used.

Also here: the tiny model saved as a checkpoint verl loads, verl's configs, and the
batch laid out as verl's trainer hands it to ``update_actor`` / ``compute_log_prob``.
"""

from __future__ import annotations

import contextlib
import tempfile

import torch
from tensordict import TensorDict
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.utils.padding import left_right_2_no_padding


class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU (gloo)."""

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: torch.cpu)

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # tensors go .to("cpu"), never to CUDA device 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def use_cpu_platform() -> None:
    """Make verl's platform the CPU (before any verl engine is built)."""
    if "cpu" not in PlatformRegistry.registered_names():
        PlatformRegistry.register(platform="cpu")(PlatformCPU)
    set_platform(PlatformCPU())


def save_model(model) -> str:
    """A directory holding ``model`` as a checkpoint (what verl's model config points at)."""
    path = tempfile.mkdtemp(prefix="dtree_verl_model_")
    model.save_pretrained(path)
    return path


def engine_configs(path: str, **engine):
    """verl's (model, engine, optimizer, checkpoint) configs for an fp32 FSDP2 run on CPU:
    no tokenizer, SDPA attention (no flash-attn here), lr 0 and no clipping (so a
    train_batch leaves the gradients to compare)."""
    model = HFModelConfig(
        path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
        enable_gradient_checkpointing=False, use_remove_padding=True,
    )
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    eng = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", mixed_precision=fp32, use_torch_compile=False, **engine)
    optim = FSDPOptimizerConfig(lr=0.0, weight_decay=0.0, total_training_steps=1, clip_grad=1e9)
    return model, eng, optim, CheckpointConfig()


def actor_batch(batch, temperature: float, *, global_batch_size: int, calculate_entropy: bool) -> TensorDict:
    """``batch`` (tests/verl_reference.ResponseBatch) as verl's trainer hands it to the
    actor: the padded DataProto fields, through verl's own left_right_2_no_padding."""
    input_ids = torch.cat([batch.prompts, batch.responses], dim=1)
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    data = {"input_ids": input_ids, "attention_mask": batch.attention_mask, "position_ids": position_ids,
            "prompts": batch.prompts, "responses": batch.responses, "response_mask": batch.response_mask,
            **batch.fields}
    td = left_right_2_no_padding(TensorDict(data, batch_size=[input_ids.shape[0]]))
    tu.assign_non_tensor(
        td, temperature=temperature, calculate_entropy=calculate_entropy, global_batch_size=global_batch_size,
        use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=input_ids.shape[0],
    )
    return td


def full_grads(module) -> dict[str, torch.Tensor]:
    """name -> the full gradient (FSDP2's sharded DTensor gradients gathered)."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out
