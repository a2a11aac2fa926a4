"""What :class:`dtree.TreeRuntime` decides before a step walks: the attention and
recurrence backends for the model's placement, the memory plan, the retain budget and the
stacks (KV and, for recurrent layers, states).

Each is a function of the model's state now (device, dtype, training flags, HF
gradient checkpointing), the :class:`~dtree.config.RuntimeConfig` and the step's
forest or schedule, so the runtime reads them at every call, not at construction.
"""

from __future__ import annotations

import numpy as np
import torch

from . import memory_policy
from .memory_probe import CallBytes, measure_call_bytes
from .checkpointing import decoder_layers
from .config import RuntimeConfig
from .models import ModelSpec, TreeModule, unwrap
from .ops import determinism
from .ops.registry import resolve_backend
from .ops.logprobs import OutputHead, fused_head_kernel
from .schedule import Schedule
from .stacks import StepStacks
from .tree import Forest

__all__ = [
    "checkpoint_root", "hf_checkpointing", "measured_call_bytes", "new_stack", "pick_backend", "pick_recurrence",
    "plan_memory", "refine_plan", "retain_budget", "stack_fits", "step_shape",
]

Placement = tuple[torch.device, torch.dtype]


def pick_backend(attention: str, placement: Placement, spec: ModelSpec, deterministic: bool = False) -> str:
    """The stack-attention backend for ``attention`` (a config value), from the registry
    (:func:`dtree.ops.backends.resolve_backend`). ``auto``: the fused Triton kernel where
    it runs (CUDA, Triton installed, 16-bit or float32 weights, head_dim <= 256; in
    deterministic mode only if its backward has a deterministic form), else SDPA. An
    explicit backend that cannot run here raises a ValueError saying why; one that cannot
    run deterministically in deterministic mode raises a RuntimeError, as torch does."""
    device, dtype = placement
    head_dim = max((spec.kv_shape(i)[1] for i in spec.attention_layers), default=spec.head_dim)
    return resolve_backend(
        "stack_attention", attention, device, dtype, head_dim=head_dim, deterministic=deterministic
    )


def pick_recurrence(recurrence: str, placement: Placement, spec: ModelSpec, deterministic: bool = False) -> str | None:
    """The ``linear_recurrence`` backend for a model with recurrent layers (None without):
    ``auto`` takes flash-linear-attention's kernels on CUDA where installed (not in
    deterministic mode), else the float32 reference. An explicit backend that cannot run
    here raises a ValueError. In deterministic mode on CUDA, the state ops' gathers and
    depthwise convolutions are torch ops that sum in a fixed order only under
    ``torch.use_deterministic_algorithms(True)``: without it, a RuntimeError (as torch raises)."""
    if not spec.recurrent_states:
        return None
    device, dtype = placement
    if deterministic and device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        determinism.alert_nondeterministic(
            "recurrent layers on CUDA without torch.use_deterministic_algorithms(True)",
            "their state ops' gathers and depthwise convolutions sum in a fixed order on CUDA only in torch's own "
            "mode: call torch.use_deterministic_algorithms(True)",
        )
    return resolve_backend("linear_recurrence", recurrence, device, dtype, deterministic=deterministic)


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


def step_shape(forest: Forest, chunk_size: int, recurrent: bool = False) -> memory_policy.StepShape:
    """The forest's unique tokens, longest path and shared tokens (of trie nodes with
    children) for the memory policy; for a model with recurrent layers (``recurrent``),
    its segments of at most ``chunk_size`` tokens that have children (the most state
    slots a schedule can push)."""
    lengths = forest.sequence_lengths()
    inner = np.diff(forest.child_offsets) > 0
    chunks = np.maximum(1, -(-forest.node_length // chunk_size))
    state_slots = int((chunks - 1).sum() + inner.sum()) if recurrent else 0
    return memory_policy.StepShape(
        forest.num_unique_tokens, int(lengths.max()) if len(lengths) else 0, int(forest.node_length[inner].sum()),
        state_slots,
    )


def checkpoint_root(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose decoder layers dtree checkpoints (None: it cannot: no layer list,
    or HF gradient checkpointing does it already)."""
    if hf_checkpointing(module) or not _can_checkpoint_layers(module):
        return None
    return unwrap(module)


def plan_memory(
    module: torch.nn.Module,
    spec: ModelSpec,
    head: OutputHead,
    config: RuntimeConfig,
    placement: Placement,
    stack: StepStacks | None,
    forest: Forest,
    call_bytes: CallBytes | None = None,
) -> memory_policy.MemoryPlan:
    """The memory policy's plan for a step over ``forest`` (see :mod:`dtree.memory_policy`);
    ``stack``: the stacks the runtime holds now (their bytes are already allocated);
    ``call_bytes``: the model's measured per-token figures (None: HF's eager estimate)."""
    device, dtype = placement
    itemsize = torch.empty((), dtype=dtype).element_size()
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
    shape = step_shape(forest, config.chunk_size, bool(spec.recurrent_states))
    return memory_policy.plan_step(
        spec, itemsize, shape, on_cuda=device.type == "cuda", setting=config.memory, mode=config.mode,
        group_tokens=config.group_tokens, checkpoint_layers=config.checkpoint_layers,
        logprob_chunk=config.logprob_chunk, hf_checkpointing=hf_checkpointing(module),
        can_checkpoint=_can_checkpoint_layers(module), call_bytes=call_bytes, **kw,
    )


def measured_call_bytes(
    module: torch.nn.Module, model: TreeModule, spec: ModelSpec, placement: Placement, attention: str, cache: dict,
    recurrence: str | None = None,
) -> CallBytes | None:
    """The model's per-token call figures (:func:`dtree.memory_probe.measure_call_bytes`),
    measured once per model state (its modules and which of them have a patched
    ``forward``, frozen parameters, HF checkpointing, placement, attention and recurrence
    backends) and kept in ``cache``. None off CUDA (no plan needs them), and under
    ``torch.inference_mode()`` before a first measurement (no graph to measure there)."""
    if placement[0].type != "cuda":
        return None
    key = (
        placement, attention, recurrence, hf_checkpointing(module),
        tuple((type(m).__name__, "forward" in vars(m)) for m in module.modules()),
        tuple(p.requires_grad for p in module.parameters()),
    )
    if key not in cache and not torch.is_inference_mode_enabled():
        cache[key] = measure_call_bytes(model, spec, placement, attention, checkpoint_root(module), recurrence)
    return cache.get(key)


def retain_budget(plan: memory_policy.MemoryPlan, config: RuntimeConfig) -> float:
    """Tokens of groups with children whose graphs may be alive at once: the config's
    ``retain_budget_tokens``, else :func:`dtree.memory_policy.retain_budget`."""
    if config.retain_budget_tokens is not None:
        return float(config.retain_budget_tokens)
    return memory_policy.retain_budget(plan, config.mode)


def refine_plan(
    plan: memory_policy.MemoryPlan, sched: Schedule, config: RuntimeConfig, stack: StepStacks | None,
    state_slots: int = 0,
) -> memory_policy.MemoryPlan:
    """The plan with its peak predicted from ``sched`` (the calls it makes, the path it
    retains, the KV-stack slots it writes and its ``state_slots`` state-stack slots
    (:attr:`dtree.state_plan.StatePlan.capacity`) beyond those of the ``stack`` held)."""
    rows = np.diff(sched.terms.pred_offsets).tolist()
    held, held_states = (stack.capacity, stack.state_slots) if stack is not None else (0, 0)
    grow = 0.0
    if plan.spec is not None:
        grow = max(0, sched.stack_tokens - held) * memory_policy.stack_slot_bytes(plan.spec, plan.itemsize)
        grow += max(0, state_slots - held_states) * memory_policy.state_slot_bytes(plan.spec, plan.itemsize)
    return memory_policy.refine(plan, sched, rows, retain_budget(plan, config), float(grow))


def stack_fits(
    stack: StepStacks | None, spec: ModelSpec, placement: Placement, capacity: int, with_grad: bool,
    state_slots: int = 0,
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
    # for reuse, would make every later training step fail. Gradient slots in the
    # compute dtype (StepStacks).
    with torch.inference_mode(False):
        return StepStacks(spec, max(capacity, 1), state_slots, dtype=dtype, device=device, with_grad=with_grad)
