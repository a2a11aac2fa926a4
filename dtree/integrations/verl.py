"""dtree as a verl engine: ``actor_rollout_ref.actor.strategy=dtree``.

Importing this module registers :class:`DTreeEngine` with verl's ``EngineRegistry`` as
backend ``"dtree"`` for ``model_type="language_model"``. Point verl at it with
``actor_rollout_ref.model.external_lib=dtree.integrations.verl`` (verl imports it in
every worker) or ``VERL_USE_EXTERNAL_MODULES=dtree.integrations.verl``.

The engine is verl's FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``):
model building, FSDP2 wrapping, optimizer, scheduler, offload, checkpointing and the
weight export to the rollout are verl's. Only ``forward_backward_batch`` differs: the
rank's whole batch becomes one forest (prompts shared by a GRPO group, multi-turn
prefixes; no micro-batches, dtree's memory policy plans the step) and

* **fast path** (``policy_loss.loss_mode`` in
  :data:`~dtree.integrations.verl_losses.FAST_PATH_LOSS_MODES` under verl's own
  ``ppo_loss``): the loss is dtree's equal of verl's
  (:func:`~dtree.integrations.verl_losses.verl_actor_loss`), one pass;
* **two-pass path** (any other loss, or ``DTREE_VERL_FAST_PATH=0``): verl's own
  ``loss_function`` runs on dtree's per-token log-probs and entropies laid out as verl's
  engine returns them, and one DFS backward is seeded with its gradient
  (:class:`dtree.LogprobLoss`): exact for any loss.

Both divide by verl's global counts (``batch_num_tokens``, ``global_batch_size``); the
gradients are summed over ranks once (:class:`dtree.distributed.FSDPSync`), so each
rank's verl loss, which carries verl's ``* dp_size`` for FSDP's averaging, is divided
by ``dp_size``. Metrics are verl's loss_function's own, on the log-probs dtree computed.
``infer_batch`` (``compute_log_prob``, the reference policy's log-probs) runs through
dtree too.

Settings (environment, read when the engine is built): ``DTREE_VERL_FAST_PATH`` (``1``
default, ``0``: always verl's loss on the two-pass path), ``DTREE_VERL_RUNTIME`` (JSON of
:class:`dtree.RuntimeConfig` fields, e.g. ``{"memory": "low"}``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Any, Callable

import torch

try:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dtree.integrations.verl needs verl 0.9.1 (which needs transformers < 5.11): "
        "pip install 'dtree[verl]'"
    ) from e

from ..config import RuntimeConfig
from ..distributed import distributed_forward_backward
from ..distributed.sync import FSDPSync
from ..engine.runtime import TreeRuntime
from ..losses import LogprobLoss
from .verl_batch import VerlBatch
from .verl_engine_checks import check_batch, check_settings, temperature_of
from .verl_losses import FAST_PATH_LOSS_MODES, verl_actor_loss

__all__ = ["DTreeEngine"]


def _skip_verl_patches(**_: Any) -> None:
    """verl's model patches serve its own attention paths (remove-padding flash-attn
    varlen, Ulysses, the fused-kernel forward); dtree routes attention through its own
    function, so none applies (check_settings refuses the settings that need them)."""


@EngineRegistry.register(model_type="language_model", backend="dtree", device=["cuda", "cpu"])
class DTreeEngine(FSDPEngineWithLMHead):
    """verl's FSDP engine whose forward/backward runs through dtree (module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config) -> None:
        check_settings(model_config, engine_config)
        object.__setattr__(engine_config, "strategy", "fsdp2")  # verl builds, dtree syncs FSDP2
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.fast_path = os.environ.get("DTREE_VERL_FAST_PATH", "1") != "0"
        self.runtime_config = RuntimeConfig(**json.loads(os.environ.get("DTREE_VERL_RUNTIME", "{}")))
        self.runtime: TreeRuntime | None = None
        self.sync: FSDPSync | None = None

    def _build_module(self):
        patch = transformer_impl.apply_monkey_patch
        transformer_impl.apply_monkey_patch = _skip_verl_patches
        try:
            return super()._build_module()
        finally:
            transformer_impl.apply_monkey_patch = patch

    def initialize(self) -> None:
        super().initialize()
        self.runtime = TreeRuntime(self.module, config=self.runtime_config)
        self.sync = FSDPSync(self.module)

    def _autocast(self):
        """verl's forward_step autocasts to FSDP's param dtype unless it is fp32; so does dtree."""
        dtype = getattr(self, "_autocast_dtype", torch.float32)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.runtime.device.type, dtype=dtype)

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None, forward_only=False) -> dict:
        """verl's contract: ``{"model_output": {"log_probs", "entropy"}, "loss": [float],
        "metrics": {name: [value]}}`` for this rank's batch (one entry: no micro-batches)."""
        if self.runtime is None:
            raise RuntimeError("DTreeEngine.initialize() must run before forward_backward_batch")
        check_batch(data)
        tu.assign_non_tensor(data, sp_size=1)
        tokens = data["loss_mask"].sum().to(torch.float64)
        if torch.distributed.is_initialized():
            tokens = tokens.to(self.runtime.device)
            torch.distributed.all_reduce(tokens, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.get_data_parallel_size())
        batch = VerlBatch.from_tensordict(data)
        if forward_only:
            return self._infer(data, batch, loss_function)
        return self._train(data, batch, loss_function)

    def _infer(self, data: TensorDict, batch: VerlBatch, loss_function: Callable | None) -> dict:
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        temperature = temperature_of(data)
        with torch.no_grad(), self.sync.unsharded(), self._autocast():
            if entropy:
                lps, ents = self.runtime.logprobs_and_entropy(batch.forest, temperature=temperature)
            else:
                lps, ents = self.runtime.logprobs(batch.forest, temperature=temperature), None
        output = {"log_probs": batch.nested(lps)}
        if ents is not None:
            output["entropy"] = batch.nested(ents)
        loss, metrics = 1.0, {}  # verl's engine reports 1.0 when there is no loss
        if loss_function is not None:
            with torch.no_grad():
                value, metrics = loss_function(model_output=output, data=data, dp_group=self.get_data_parallel_group())
            loss = float(value)
        return _verl_output(output, loss, metrics)

    def _train(self, data: TensorDict, batch: VerlBatch, loss_function: Callable) -> dict:
        if loss_function is None:
            raise ValueError("train_batch needs a loss_function (verl's ppo_loss or any verl loss)")
        dp = self.get_data_parallel_size()
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        temperature = temperature_of(data)
        fast = self._fast_loss(data, batch, loss_function, entropy, temperature)
        seen: dict = {}

        def verl_loss(lps, forest, ents=None):
            output = {"log_probs": batch.nested(lps)}
            if ents is not None:
                output["entropy"] = batch.nested(ents)
            value, seen["metrics"] = loss_function(model_output=output, data=data, dp_group=self.get_data_parallel_group())
            seen["loss"] = float(value.detach())
            return value / dp  # verl's loss carries * dp_size for FSDP's mean; dtree sums over ranks

        loss, norm = fast if fast is not None else (LogprobLoss(verl_loss, temperature, entropy), None)
        with self._autocast():
            out = distributed_forward_backward(
                self.runtime, batch.forest, loss, group=self.get_data_parallel_group(), sync=self.sync,
                normalization=norm, return_logprobs=fast is not None,
            )
        if fast is not None:  # verl's metrics (and loss value) on the log-probs the step saw
            with torch.no_grad():
                verl_loss(out.local.logprobs, batch.forest, out.local.entropy if entropy else None)
        stats = batch.forest.stats()
        dtree_metrics = {"dtree/fast_path": float(fast is not None), "dtree/compression": stats.compression_ratio}
        return _verl_output({}, seen["loss"], {**seen["metrics"], **dtree_metrics})

    def _fast_loss(self, data, batch: VerlBatch, loss_function, entropy: bool, temperature: float):
        """(dtree's loss, verl's counts) when verl's ``ppo_loss`` maps onto dtree's; else None."""
        if not (self.fast_path and isinstance(loss_function, functools.partial)):
            return None
        config = loss_function.keywords.get("config")
        if loss_function.func is not ppo_loss or config is None or "rollout_is_weights" in data.keys():
            return None
        mode = config.policy_loss.get("loss_mode", "vanilla")
        if mode not in FAST_PATH_LOSS_MODES or (mode == "gspo" and entropy and config.entropy_coeff):
            return None
        return verl_actor_loss(
            config, batch.forest, batch_num_tokens=data["batch_num_tokens"],
            global_batch_size=tu.get_non_tensor_data(data, "global_batch_size", None), dp_size=1,
            response_width=batch.response_width, with_entropy=entropy, temperature=temperature,
        )


def _verl_output(model_output: dict, loss: float, metrics: dict) -> dict:
    """The dict verl's ``postprocess_batch_func`` returns, for one micro-batch."""
    return {"model_output": model_output, "loss": [loss], "metrics": {k: [v] for k, v in metrics.items()}}
