"""What :class:`dtree.TreeRuntime` decides before a step walks: the attention backend for
the model's placement, the memory plan, the retain budget and the KV stack.

Each is a function of the model's state now (device, dtype, training flags, HF
gradient checkpointing), the :class:`~dtree.config.RuntimeConfig` and the step's
forest or schedule, so the runtime reads them at every call, not at construction.
"""

from __future__ import annotations

import torch

from . import memory_policy
from .checkpointing import decoder_layers
from .config import RuntimeConfig
from .kv_stack import KVStack
from .models import ModelSpec, unwrap
from .ops.backends import resolve_backend
from .ops.logprobs import OutputHead, compute_dtype, fused_head_kernel
from .schedule import Schedule
from .tree import Forest

__all__ = ["pick_backend", "hf_checkpointing", "plan_memory", "retain_budget", "stack_fits", "new_stack"]

Placement = tuple[torch.device, torch.dtype]


def pick_backend(attention: str, placement: Placement, spec: ModelSpec, deterministic: bool = False) -> str:
    """The stack-attention backend for ``attention`` (a config value), from the registry
    (:func:`dtree.ops.backends.resolve_backend`). ``auto``: the fused Triton kernel where
    it runs (CUDA, Triton installed, 16-bit or float32 weights, head_dim <= 256; in
    deterministic mode only if its backward has a deterministic form), else SDPA. An
    explicit backend that cannot run here raises a ValueError saying why; one that cannot
    run deterministically in deterministic mode raises a RuntimeError, as torch does."""
    device, dtype = placement
    return resolve_backend(
        "stack_attention", attention, device, dtype, head_dim=spec.head_dim, deterministic=deterministic
    )


def hf_checkpointing(module: torch.nn.Module) -> bool:
    """Whether HF gradient checkpointing is on for some module in training mode (it
    then checkpoints the layers itself and dtree adds no checkpoint)."""
    return any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in module.modules())


def _can_checkpoint_layers(module: torch.nn.Module) -> bool:
    try:
        decoder_layers(unwrap(module))
    except ValueError:
        return False
    return True


def plan_memory(
    module: torch.nn.Module,
    spec: ModelSpec,
    head: OutputHead,
    config: RuntimeConfig,
    placement: Placement,
    stack: KVStack | None,
    forest: Forest,
) -> memory_policy.MemoryPlan:
    """The memory policy's plan for a step over ``forest`` (see :mod:`dtree.memory_policy`);
    ``stack``: the KV stack the runtime holds now (its bytes are already allocated)."""
    device, dtype = placement
    itemsize = torch.empty((), dtype=dtype).element_size()
    lengths = forest.sequence_lengths()
    shape = memory_policy.StepShape(forest.num_unique_tokens, int(lengths.max()) if len(lengths) else 0)
    checkpoint = config.checkpoint_layers
    if checkpoint is None and not _can_checkpoint_layers(module):
        checkpoint = False
    kw = {}
    if device.type == "cuda":
        available, allocated = memory_policy.available_bytes(device)
        kw = dict(
            available=available,
            allocated=allocated,
            expandable_segments=memory_policy.expandable_segments(),
            stack_held=float(stack.nbytes()) if stack is not None and stack.device == device else 0.0,
            missing_grads=memory_policy.missing_grad_bytes(module.parameters()),
            fused_head=fused_head_kernel(head, dtype, device),
        )
    return memory_policy.plan_step(
        spec, itemsize, shape, on_cuda=device.type == "cuda", setting=config.memory,
        group_tokens=config.group_tokens, checkpoint_layers=checkpoint,
        logprob_chunk=config.logprob_chunk, hf_checkpointing=hf_checkpointing(module), **kw,
    )


def retain_budget(plan: memory_policy.MemoryPlan, spec: ModelSpec, config: RuntimeConfig, sched: Schedule) -> float:
    """Tokens of groups with children whose graphs may be alive at once: the config's
    ``retain_budget_tokens``, else :func:`dtree.memory_policy.retain_budget`."""
    if config.retain_budget_tokens is not None:
        return float(config.retain_budget_tokens)
    nonleaf = [p.num_tokens for p in sched.groups if not p.is_leaf]
    return memory_policy.retain_budget(
        plan, spec, config.mode, unique_tokens=int(sched.row_offsets[-1]), num_groups=sched.num_groups,
        nonleaf_tokens=int(sum(nonleaf)), nonleaf_groups=len(nonleaf),
    )


def _stack_shape(spec: ModelSpec, capacity: int) -> tuple[int, int, int, int]:
    return spec.num_layers, max(capacity, 1), spec.num_kv_heads, spec.head_dim


def stack_fits(stack: KVStack | None, spec: ModelSpec, placement: Placement, capacity: int, with_grad: bool) -> bool:
    """Whether ``stack`` serves a step needing ``capacity`` slots (shape, dtype, device,
    gradient buffers)."""
    device, dtype = placement
    return stack is not None and stack.fits(*_stack_shape(spec, capacity), dtype, device, with_grad, spec.v_head_dim)


def new_stack(spec: ModelSpec, placement: Placement, capacity: int, with_grad: bool) -> KVStack:
    """A KV stack of ``capacity`` slots for the model (free the old one first)."""
    device, dtype = placement
    # Normal tensors even under torch.inference_mode(): an inference-mode stack, kept
    # for reuse, would make every later training step fail. Gradient slots in the
    # compute dtype: float32 sums for 16-bit and float32 models, float64 for float64
    # ones (a float32 sum would cap a float64 model at float32 accuracy).
    with torch.inference_mode(False):
        return KVStack(
            *_stack_shape(spec, capacity), v_head_dim=spec.v_head_dim, dtype=dtype, device=device,
            grad_dtype=compute_dtype(dtype), with_grad=with_grad,
        )
