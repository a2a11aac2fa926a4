"""What :class:`dtree.TreeRuntime` decides before a step walks: the attention and
recurrence backends for the model's placement, the memory plan, the retain budget and the
stacks (KV and, for recurrent layers, states).

Each is a function of the model's state now (device, dtype, training flags, HF
gradient checkpointing), the :class:`~dtree.config.RuntimeConfig` and the step's
forest or schedule, so the runtime reads them at every call, not at construction.
"""

from __future__ import annotations

import torch

from . import memory_policy
from .checkpointing import decoder_layers
from .config import RuntimeConfig
from .models import ModelSpec, unwrap
from .ops.backends import resolve_backend
from .ops.logprobs import OutputHead, fused_head_kernel
from .schedule import Schedule
from .stacks import StepStacks
from .tree import Forest

__all__ = [
    "pick_backend", "pick_recurrence", "hf_checkpointing", "plan_memory", "retain_budget", "stack_fits", "new_stack",
]

Placement = tuple[torch.device, torch.dtype]


def pick_backend(attention: str, placement: Placement, spec: ModelSpec) -> str:
    """The stack-attention backend for ``attention`` (a config value), from the registry
    (:func:`dtree.ops.backends.resolve_backend`). ``auto``: the fused Triton kernel where
    it runs (CUDA, Triton installed, 16-bit or float32 weights, head_dim <= 256), else
    SDPA. An explicit backend that cannot run here raises a ValueError saying why."""
    device, dtype = placement
    head_dim = max((spec.kv_shape(i)[1] for i in spec.attention_layers), default=spec.head_dim)
    return resolve_backend("stack_attention", attention, device, dtype, head_dim=head_dim)


def pick_recurrence(recurrence: str, placement: Placement, spec: ModelSpec) -> str | None:
    """The ``linear_recurrence`` backend for a model with recurrent layers (None without):
    ``auto`` takes flash-linear-attention's kernels on CUDA where installed, else the
    float32 reference. An explicit backend that cannot run here raises a ValueError."""
    if not spec.recurrent_states:
        return None
    device, dtype = placement
    return resolve_backend("linear_recurrence", recurrence, device, dtype)


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
    stack: StepStacks | None,
    forest: Forest,
) -> memory_policy.MemoryPlan:
    """The memory policy's plan for a step over ``forest`` (see :mod:`dtree.memory_policy`);
    ``stack``: the stacks the runtime holds now (their bytes are already allocated)."""
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


def stack_fits(
    stack: StepStacks | None, spec: ModelSpec, placement: Placement, capacity: int, with_grad: bool, state_slots: int = 0
) -> bool:
    """Whether ``stack`` serves a step needing ``capacity`` KV slots and ``state_slots``
    state slots (shapes, dtype, device, gradient buffers)."""
    device, dtype = placement
    return stack is not None and stack.fits(spec, max(capacity, 1), state_slots, dtype, device, with_grad)


def new_stack(
    spec: ModelSpec, placement: Placement, capacity: int, with_grad: bool, state_slots: int = 0
) -> StepStacks:
    """The KV stacks (and state stack) of ``capacity`` tokens (``state_slots`` states) for
    the model (free the old ones first)."""
    device, dtype = placement
    # Normal tensors even under torch.inference_mode(): an inference-mode stack, kept
    # for reuse, would make every later training step fail.
    with torch.inference_mode(False):
        return StepStacks(spec, max(capacity, 1), state_slots, dtype=dtype, device=device, with_grad=with_grad)
