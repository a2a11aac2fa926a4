"""``TreeGRPOTrainer``: TRL's ``GRPOTrainer`` with the loss and the log-probs computed by dtree.

A drop-in subclass (same constructor, same ``GRPOConfig``; trl >= 1.16, < 2)::

    from dtree.integrations.trl import TreeGRPOTrainer
    trainer = TreeGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.train()

What goes through dtree (each micro-batch's rows become a forest, so a GRPO group's
prompt is computed once and multi-turn rollouts that share more than the prompt
become deeper trees):

- the training loss and its backward (:meth:`compute_loss`): TRL's ``loss_type``,
  ``importance_sampling_level``, ``epsilon``/``epsilon_high``/``delta``, ``beta`` with
  ``use_bias_correction_kl``, ``temperature``, a static ``entropy_coef``, the loss
  mask ``completion_mask * tool_mask``, and TRL's normalization of each loss type over
  gradient accumulation (``Normalization`` of the generation batch for ``dapo`` and
  ``cispo``; per micro-batch counts divided by the accumulation steps otherwise);
- the old and reference log-probs (:meth:`_get_per_token_logps_and_entropies` under
  no grad): the policy, ``ref_model``, and a PEFT model with its adapter disabled (or
  switched to ``ref``), all read at the call.

The mapping of TRL's loss settings to dtree losses is :mod:`dtree.integrations.trl_losses`.

TRL keeps everything else: generation, rewards and advantages, the optimizer and
scheduler, gradient accumulation, gradient clipping, logging (the same metric names:
``entropy``, ``kl``, ``clip_ratio/*``, ``cispo_clip_ratio``, ``policy_loss``,
``entropy_coef``), callbacks and checkpoints. With DDP, the gradients are averaged over
ranks on the step's last micro-batch, as DDP does (dtree's backward does not go
through DDP's forward, so DDP's own reducer never runs).

What falls back to ``GRPOTrainer``'s own path, with a one-time warning naming the
feature: vision/multimodal inputs, the entropy-quantile mask (``top_entropy_quantile <
1``), the off-policy sequence mask, vLLM importance-sampling correction, ``vespo``,
sequence-level ``cispo``/``sapo``, the adaptive entropy controller, an entropy bonus
at sequence level, MoE load-balancing losses, fp16 (GradScaler), bf16 autocast over a
model that is neither float32 nor bfloat16, FSDP/DeepSpeed and other non-DDP
parallelism, attention dropout, and models dtree cannot run. A configuration is
either mapped exactly or falls back: never a silently different result. The
evaluation loss (no gradient) is TRL's own. Every training step logs, among TRL's
metrics, ``dtree/active`` (1: the loss and its backward went through dtree, 0: the
fallback; a mean over the step's micro-batches) and ``dtree/compression`` (linearized
over unique tokens of the micro-batch forests).

Numerics: mixed precision through accelerate (``bf16=True`` over a float32 model,
GRPOConfig's default on CPU) runs dtree under the same bf16 autocast accelerate puts
around the model's forward (matmuls in bf16, the KV stack, its float32 gradient slots,
log-probs and losses in float32); a bf16 model runs plain bf16; otherwise dtree
computes in the model's dtype without autocast. RoPE positions start at 0 on every row
where HF's left-padded rows start later: equal up to rounding. With dropout active, dtree
draws its own masks (one per unique token), so results match in distribution, not bit
for bit; without dropout, dtree's calls leave the global RNG untouched, so TRL's
shuffles are the ones ``GRPOTrainer`` would draw.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

from ..device import rng
from ..engine.runtime import StepOutput, TreeRuntime
from ..losses import TokenLoss
from .padded import from_padded, from_prompt_completion, to_padded, to_padded_completion
from .trl_losses import (
    CLIP_METRIC_TYPES,
    GLOBAL_COUNTS,
    SEQUENCE_LOSS_TYPES,
    TOKEN_LOSS_TYPES,
    grpo_trainer_loss,
    on_policy,
    with_entropy_bonus,
)

try:
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - the error names the fix
    raise ImportError("dtree.integrations.trl needs TRL: pip install 'dtree[trl]' (trl>=1.16,<2)") from e

__all__ = ["TreeGRPOTrainer", "MULTIMODAL_INPUTS"]

# inputs GRPOTrainer passes to the model besides ids and mask (vision-language models)
MULTIMODAL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class TreeGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose training loss, backward and old/reference log-probs
    run through :class:`dtree.TreeRuntime` (see the module docstring).

    Args:
        *args, **kwargs: exactly ``GRPOTrainer``'s.
        dtree_options: :class:`~dtree.TreeRuntime` options (``mode``, ``group_tokens``,
            ``chunk_size``, ``attention``, ``logprob_chunk``, ``memory``, ...: the keywords of
            :class:`~dtree.RuntimeConfig`). With
            ``gradient_checkpointing=True`` in the config, the default mode is
            ``"recompute"`` (dtree's own activation saving; HF's checkpointing is
            switched off around dtree's calls and back on after). With vLLM colocated
            (``use_vllm=True, vllm_mode="colocate"``) the default ``free_after_step`` is
            True: the allocator's cache goes back to the device after every dtree call,
            so vLLM can wake up into it.
    """

    def __init__(self, *args: Any, dtree_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dtree_options = dict(dtree_options or {})
        if self.args.gradient_checkpointing:
            self.dtree_options.setdefault("mode", "recompute")
        if getattr(self, "use_vllm", False) and getattr(self.args, "vllm_mode", None) == "colocate":
            # vLLM in this process wakes up between steps and asks the driver for memory
            # the allocator's cache would hold: hand it back after every dtree call
            self.dtree_options.setdefault("free_after_step", True)
        self._dtree_runtimes: dict[int, tuple[torch.nn.Module, TreeRuntime]] = {}
        self._dtree_warned: set[str] = set()

    # ------------------------------------------------------------------ the training loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not (self.model.training and torch.is_grad_enabled()):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        module = self.accelerator.unwrap_model(model)
        reason = self._fallback_reason(module, training=True, inputs=inputs)
        if reason is not None:
            self._warn_fallback(reason, "loss")
            self._metrics["train"]["dtree/active"].append(0.0)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self._dtree_compute_loss(module, model, inputs)

    def _dtree_compute_loss(self, module: torch.nn.Module, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        forest = from_prompt_completion(
            inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], completion_mask,
            loss_mask=mask, advantages=inputs["advantages"], old_logprobs=old, ref_logprobs=ref,
        )
        accumulation = self.current_gradient_accumulation_steps
        loss, norm = grpo_trainer_loss(self, forest, inputs, accumulation)
        if old is None:  # TRL: old = this pass's log-probs, detached (ratio 1, the surrogate's gradient)
            loss = on_policy(loss)
        bonus = self._entropy_bonus_enabled
        if bonus:
            loss, forest = with_entropy_bonus(loss, forest, norm, self.entropy_coef, accumulation)
        runtime = self._runtime(module)
        with self._dtree_context(module):
            if isinstance(loss, TokenLoss):
                out = runtime.forward_backward(forest, loss, normalization=norm, return_logprobs=True)
            else:
                out = runtime.forward_backward(forest, loss, return_logprobs=True)
        if self.accelerator.sync_gradients and self.accelerator.num_processes > 1:
            _average_gradients_over_ranks(module)
        self._log_loss_metrics(inputs, mask, out, accumulation, bonus)
        # every step says whether its loss went through dtree, and how much the tree saved
        self._metrics["train"]["dtree/active"].append(1.0)
        self._metrics["train"]["dtree/compression"].append(forest.num_linearized_tokens / forest.num_unique_tokens)
        return torch.tensor(out.loss, dtype=torch.float32, device=self.accelerator.device, requires_grad=True)

    # ------------------------------------------------------------------ old and reference log-probs
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        def trl_path():
            return super(TreeGRPOTrainer, self)._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal,
            )

        if torch.is_grad_enabled():  # GRPOTrainer's own training loss (a fallback)
            return trl_path()
        module = self.accelerator.unwrap_model(model)
        reason = self._fallback_reason(module, training=False, inputs=multimodal, aux_loss=compute_aux_loss)
        if reason is not None:
            self._warn_fallback(reason, "log-probs")
            return trl_path()
        forest = from_padded(input_ids, attention_mask)
        runtime = self._runtime(module)
        with self._dtree_context(module):
            if compute_entropy:
                lps, ents = runtime.logprobs_and_entropy(forest, temperature=self.temperature)
            else:
                lps, ents = runtime.logprobs(forest, temperature=self.temperature), None
        # TRL scores the last logits_to_keep columns (the completion) and puts 0 at padding
        logps = to_padded(lps, attention_mask)[:, -logits_to_keep:]
        entropies = to_padded(ents, attention_mask)[:, -logits_to_keep:] if compute_entropy else None
        return logps, entropies, None

    # ------------------------------------------------------------------ what cannot go through the tree
    def _fallback_reason(
        self, module: torch.nn.Module, *, training: bool, inputs: dict | None = None, aux_loss: bool = False
    ) -> str | None:
        """The feature that keeps this call on GRPOTrainer's own path, or None."""
        args = self.args
        if inputs and any(inputs.get(k) is not None for k in MULTIMODAL_INPUTS):
            return "vision/multimodal inputs"
        if aux_loss or (training and getattr(self, "aux_loss_enabled", False)):
            return "the MoE load-balancing loss (router_aux_loss_coef)"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "DeepSpeed/FSDP"
        if self.accelerator.num_processes > 1 and not isinstance(
            self.model_wrapped, torch.nn.parallel.DistributedDataParallel
        ):
            return f"distributed type {self.accelerator.distributed_type} (only DDP is mapped)"
        precision = self.accelerator.mixed_precision
        if precision == "fp16":
            return "fp16 mixed precision (GradScaler)"
        if precision == "bf16" and _dtype(module) not in (torch.float32, torch.bfloat16):
            return f"bf16 autocast over a {_dtype(module)} model"
        if training:
            if self.loss_type not in TOKEN_LOSS_TYPES:
                return f"loss_type={self.loss_type!r}"
            if self.importance_sampling_level == "sequence" and self.loss_type not in SEQUENCE_LOSS_TYPES:
                return f"importance_sampling_level='sequence' with loss_type={self.loss_type!r}"
            if getattr(self, "top_entropy_quantile", 1.0) < 1.0:
                return "the entropy-quantile mask (top_entropy_quantile < 1)"
            if getattr(self, "off_policy_mask_threshold", None) is not None:
                return "the off-policy sequence mask (off_policy_mask_threshold)"
            if self.use_vllm and getattr(self, "vllm_importance_sampling_correction", False):
                return "vLLM importance-sampling correction"
            if getattr(self, "use_adaptive_entropy", False):
                return "the adaptive entropy controller (use_adaptive_entropy)"
            if self._entropy_bonus_enabled and self.importance_sampling_level == "sequence":
                return "an entropy bonus with importance_sampling_level='sequence'"
            if getattr(args, "use_liger_loss", False):
                return "Liger's fused GRPO loss"
        for m in module.modules():
            p = getattr(m, "attention_dropout", 0.0)
            if m.training and isinstance(p, (int, float)) and p > 0:
                return f"attention dropout ({type(m).__name__}.attention_dropout={p})"
        try:
            self._runtime(module)
        except (TypeError, ValueError) as e:
            return f"this model ({e})"
        return None

    def _warn_fallback(self, reason: str, what: str) -> None:
        key = f"{what}: {reason}"
        if key in self._dtree_warned:
            return
        self._dtree_warned.add(key)
        warnings.warn(
            f"TreeGRPOTrainer: {reason} cannot go through dtree; the {what} use GRPOTrainer's own path "
            "(this warning is shown once)",
            UserWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ plumbing
    def _runtime(self, module: torch.nn.Module) -> TreeRuntime:
        """One runtime per model (policy, reference), kept for the trainer's life; it
        reads the model's state (adapters, device, dtype) at every call."""
        entry = self._dtree_runtimes.get(id(module))
        if entry is None or entry[0] is not module:
            entry = (module, TreeRuntime(module, **self.dtree_options))
            self._dtree_runtimes[id(module)] = entry
        return entry[1]

    def _autocast_bf16(self, module: torch.nn.Module) -> bool:
        """Whether accelerate runs this model under bf16 autocast (``bf16=True`` over float32
        weights: GRPOConfig's default on CPU): dtree then runs under the same autocast."""
        return self.accelerator.mixed_precision == "bf16" and _dtype(module) == torch.float32

    @contextlib.contextmanager
    def _dtree_context(self, module: torch.nn.Module) -> Iterator[None]:
        """Around a dtree call: the autocast accelerate applies to the model's forward
        (bf16 over float32 weights), else none (dtree runs in the model's dtype); HF
        gradient checkpointing off (dtree's recompute mode replaces it); and, when nothing
        in the model draws random numbers, the global RNG left as it was (dtree draws one
        seed per model call; TRL's row shuffles must not see those draws)."""
        device_type = self.accelerator.device.type
        autocast = self._autocast_bf16(module)
        checkpointed = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
        draws = _draws_random_numbers(module)
        device = self.accelerator.device
        saved = None if draws else rng.capture(device)
        try:
            for m in checkpointed:
                m.gradient_checkpointing = False
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                yield
        finally:
            for m in checkpointed:
                m.gradient_checkpointing = True
            if saved is not None:
                rng.restore(saved, device)

    def _log_loss_metrics(self, inputs: dict, mask: torch.Tensor, out: StepOutput, accumulation: int, bonus: bool) -> None:
        """The metrics ``GRPOTrainer._compute_loss`` logs, from the log-probs and
        entropies the loss saw, with TRL's formulas and cross-rank reductions."""
        metrics = self._metrics["train"]
        completion_mask = inputs["completion_mask"]
        mask = mask.float()
        on = mask > 0
        logps = to_padded_completion(out.logprobs, completion_mask)
        entropies = to_padded_completion(out.entropy, completion_mask)
        old = inputs.get("old_per_token_logps")
        old = logps if old is None else old
        # masked-out columns carry 0 or padding values: keep them out of exp()
        log_ratio = torch.where(on, logps - old, 0.0)
        sequence_level = self.importance_sampling_level == "sequence"
        if sequence_level:
            coef_1 = torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        else:
            coef_1 = torch.exp(log_ratio)

        def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        def global_masked_mean(x: torch.Tensor) -> float:
            if x.shape[1] == 1:
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if bonus:
            entropy_loss = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
            policy = out.loss + self.entropy_coef * float(entropy_loss)
            if self.loss_type not in GLOBAL_COUNTS:
                policy *= accumulation  # TRL logs the micro-batch's loss before dividing by the accumulation
            policy_loss = torch.tensor(policy, device=mask.device)
            metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            d = torch.where(on, ref - logps, 0.0)
            kl = torch.exp(d) - d - 1
            if self.args.use_bias_correction_kl:
                kl = kl * coef_1
            metrics["kl"].append(global_masked_mean(kl))
        metrics["entropy"].append(global_masked_mean(entropies))
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        if self.loss_type in CLIP_METRIC_TYPES:
            if self.args.delta is not None:
                coef_1 = torch.clamp(coef_1, max=self.args.delta)
            low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
            high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
            metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
            metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
            metrics["clip_ratio/low_min"].append(_nanmin(self.accelerator.gather(masked_seq_mean(low))))
            metrics["clip_ratio/high_max"].append(_nanmax(self.accelerator.gather(masked_seq_mean(high))))
        elif self.loss_type == "cispo":
            clipped = ((coef_1 > self.epsilon_high) & (advantages > 0)).float()
            metrics["cispo_clip_ratio"].append(global_masked_mean(clipped))


def _average_gradients_over_ranks(module: torch.nn.Module) -> None:
    """What DDP does on the last micro-batch of a step: every trainable parameter's
    accumulated gradient, averaged over ranks (zeros where a rank has none)."""
    import torch.distributed as dist

    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size()
    for dtype in sorted({p.grad.dtype for p in params}, key=str):
        grads = [p.grad for p in params if p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _draws_random_numbers(module: torch.nn.Module) -> bool:
    """Whether a forward in the current mode draws random numbers (dropout)."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in module.modules())


def _dtype(module: torch.nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _nanmin(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.min()) if x.numel() else float("nan")


def _nanmax(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.max()) if x.numel() else float("nan")
