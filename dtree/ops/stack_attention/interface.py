"""Attention of packed query segments over the KV stack.

One model call runs several query segments packed along the token axis (varlen).
Segment ``i`` holds rows ``[q_offsets[i], q_offsets[i+1])``; its keys are

* its ancestors' K/V, read from the stack at ``prefix_ranges[i]`` with no mask, then
* its own K/V (the call's ``k, v`` rows of the segment), read causally.

That is, query row ``r`` of a segment with ``P`` prefix keys sees prefix keys
``0 .. P-1`` and own keys ``0 .. r``: lower-right-aligned causal attention over
``P + len`` keys, the same as that token sees in its linearized path. The prefix
ranges hold the whole root-to-segment path, root first, so a key's index in
``[prefix ; own]`` is its depth (position) and the query's is ``P + r``.

Options, per call (HF passes them per layer, so layers that alternate sliding and
full attention pass different values): ``softcap`` (Gemma2), ``sinks`` (GPT-OSS),
``alibi_slopes`` (Bloom, MPT, Falcon), ``window`` (sliding window); their math is in
:mod:`dtree.ops.stack_attention.reference`. Values may be narrower than keys (MLA):
q, k ``[T, H, Dk]``, v ``[T, Hkv, Dv]``, output ``[T, Hq, Dv]``.

Gradients: ``dq``, the own ``dk, dv`` and ``dsinks`` flow back through autograd; the
prefix ``dk, dv`` are *added into the stack's gradient buffers* (they belong to
ancestor segments whose backward has not run yet). That includes ancestors in the
same call (``SegmentLayout.call_slots``), which the backends read through the stack
like any prefix. :func:`seed_from_stack` folds the stack's gradient slots of a call
back into its own ``dk, dv``: the runtime passes every call's ``k, v`` through it
before the attention, so the descendants' and the in-call contributions enter the
backward where K/V are consumed, whatever graph computed them.

Backends, all with one signature, ``(q, k, v, slots, options)`` (shapes and arguments
in :mod:`dtree.ops.stack_attention.options`):

* ``reference``: pure torch, float32 math, one segment at a time.
* ``sdpa``: ``F.scaled_dot_product_attention`` per segment with a lower-right causal
  mask over (prefix gathered from the stack + own K/V); windows, ALiBi and sinks
  become an additive mask, softcapping runs the ``reference`` math (SDPA has no hook
  for a score transform). Any device.
* ``triton``: one fused kernel for all segments, reading the stack in place
  (:mod:`dtree.ops.stack_attention.triton_autograd`, CUDA only).
* ``flash-attn``: flash-attn-4 (CUDA sm90+, installed). A call whose tree the two tables of
  :mod:`dtree.ops.stack_attention.call_mask` express runs as one masked attention over the
  stack (:mod:`dtree.ops.stack_attention.flash4_masked_call`); other calls, and deterministic ones,
  run varlen kernels over the call's regions merged by log-sum-exp
  (:mod:`dtree.ops.stack_attention.regions`, :mod:`dtree.ops.stack_attention.flash4`).
  Calls with options run the ``triton`` kernel.

They are registered in :data:`BACKENDS` (name -> function), whose ``resolve`` picks one
for a device (``auto``: ``flash-attn`` on CUDA where it runs, else ``triton``, else ``sdpa``).

Every backend is tested against :func:`dtree.ops.stack_attention.reference.stack_attention_naive`.
With a window, the reference and sdpa backends gather only the in-window part of
each segment's prefix.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import determinism
from ..backends import Backends, Target
from .options import PLAIN, AttentionOptions, StackSlots
from .per_segment import stack_attention_reference, stack_attention_sdpa
from .segment_layout import SegmentLayout

__all__ = [
    "BACKENDS",
    "OWN_GRADS_IN_CALL",
    "OWN_KV_IN_STACK",
    "PREFERS_FLASH_ATTN",
    "leaf_slots_take_grads",
    "prepare_stack_attention",
    "stack_attention",
    "stack_attention_flash4",
    "stack_attention_triton",
    "triton_unavailable",
]

# Whether "auto" stack attention on CUDA tries the flash-attn backend (Hopper or newer,
# flash-attn-4 installed, 16-bit) before Triton. With each call as one masked flash-attn-4
# attention (masked_call), the 64k agentic step ran 1.842 s against Triton's 2.194 s and GRPO
# case 1 0.161 s against ~0.2 s on an H100 (benchmarks/results/h100/session_i); the region
# path alone had not been >= 5% faster on every case (session H), so this was False before.
PREFERS_FLASH_ATTN = True

# Backends that read a call's own K/V from its stack slots (the flash-attn backend's one-call
# path, dtree.ops.stack_attention.masked_call, which writes them there): the plan sizes the
# stack for every call's slots, leaf calls included (dtree.plan.stack_sizes.stack_slots).
OWN_KV_IN_STACK = frozenset({"flash-attn"})

# Backends whose call returns the gradients of its own K/V whole, its in-call descendants'
# terms included (the flash-attn backend's one-call path, masked_call): no leaf call's slots
# ever collect gradients, so the stack's gradient slots stop at the groups with children
# (dtree.plan.stack_sizes.grad_slots). A call that takes another path inside the backend grows
# them (KVStack.grad_slots_through) and stays exact.
OWN_GRADS_IN_CALL = frozenset({"flash-attn"})


def leaf_slots_take_grads(backend: str, deterministic: bool | None = False) -> bool:
    """Whether a leaf call's stack slots may collect gradients under ``backend`` (its
    in-call descendants' dK/dV of its in-call ancestors): True but for a backend of
    :data:`OWN_GRADS_IN_CALL` on its one-call path (not deterministic, whose backward runs the
    region path; not ``DTREE_FLASH_REGIONS=1``)."""
    if backend not in OWN_GRADS_IN_CALL or determinism.requested(deterministic):
        return True
    from .flash4 import ONE_CALL_PATH

    return not ONE_CALL_PATH


def stack_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions = PLAIN
) -> torch.Tensor:
    """The ``triton`` backend (:func:`dtree.ops.stack_attention.triton_autograd.stack_attention_triton`),
    imported at the call: Triton is only imported where it is asked for."""
    from .triton_autograd import stack_attention_triton as fused

    return fused(q, k, v, slots, options)


def stack_attention_flash4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions = PLAIN
) -> torch.Tensor:
    """The ``flash-attn`` backend (:func:`dtree.ops.stack_attention.flash4.stack_attention_flash4`),
    imported at the call: flash-attn-4 is only imported where it is asked for."""
    from .flash4 import stack_attention_flash4 as regions

    return regions(q, k, v, slots, options)


def triton_unavailable(target: Target) -> str | None:
    """Why the ``triton`` backend cannot run on ``target`` (None: it runs): Triton
    missing, not a CUDA device of compute capability >= 8.0 (and no interpreter), a
    dtype or head dim the kernels do not take."""
    try:
        from . import triton_autograd as sat

        sat.require_triton(target.device)
    except (ImportError, RuntimeError) as e:
        return f"cannot run here: {e}"
    if target.dtype is not None and target.dtype not in sat.DTYPES:
        return f"runs {sat.DTYPES}, this model is {target.dtype}; use attention='sdpa'"
    if target.head_dim is not None and target.head_dim > sat.MAX_HEAD_DIM:
        return f"supports head dims up to {sat.MAX_HEAD_DIM}, this model has {target.head_dim}; use attention='sdpa'"
    return None


def flash4_unavailable(target: Target) -> str | None:
    """Why the ``flash-attn`` backend cannot run on ``target`` (None: it runs)."""
    from .flash4 import flash4_unavailable as why_not

    return why_not(target)


BACKENDS = Backends(
    "attention",
    {
        "reference": stack_attention_reference,
        "sdpa": stack_attention_sdpa,
        "triton": stack_attention_triton,
        "flash-attn": stack_attention_flash4,
    },
    {"cuda": ("flash-attn",) * PREFERS_FLASH_ATTN + ("triton", "sdpa"), "other": ("sdpa",)},
    unavailable={"triton": triton_unavailable, "flash-attn": flash4_unavailable},
)


def stack_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: StackSlots,
    options: AttentionOptions = PLAIN,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Attention of the packed segments over the stack by backend name (see the module
    docstring; ``BACKENDS.resolve`` picks one for a device); shapes and arguments in
    :mod:`dtree.ops.stack_attention.options`. Gradients of in-call ancestors stay in the
    stack's slots (see :func:`dtree.ops.stack_attention.seed_from_stack`).

    ``options.deterministic`` (or ``torch.use_deterministic_algorithms(True)``): the
    backend runs its deterministic backward; a backend registered without one
    (``BACKENDS.nondeterministic``) raises the way torch does
    (:func:`dtree.ops.determinism.alert_nondeterministic`)."""
    attend = BACKENDS.function(backend)
    deterministic = determinism.requested(options.deterministic)
    if deterministic and backend in BACKENDS.nondeterministic:
        why = BACKENDS.nondeterministic[backend](Target(q.device, q.dtype))
        if why is not None:
            determinism.alert_nondeterministic(
                f"the {backend!r} stack attention backward (it {why})",
                "use attention='auto' (which then picks a deterministic backend) or attention='sdpa'",
            )
    if options.deterministic is not deterministic:
        options = replace(options, deterministic=deterministic)
    return attend(q, k, v, slots, options)


def prepare_stack_attention(
    layout: SegmentLayout, backend: str, device: torch.device, deterministic: bool = False
) -> None:
    """Do a call's host-side table work now (``backend``'s tables for ``layout``, cached on it),
    so that its first layer launches at once: the walk calls it for the next call while the
    GPU still runs the current one's kernels (when the queue has drained, a call's first layer
    otherwise left the GPU idle for the tables' build and upload: 1-8 ms per call on the 64k
    agentic tree). A backend without such work does nothing."""
    if backend == "flash-attn":
        from .flash4 import prepare_flash4_call

        prepare_flash4_call(layout, device, determinism.requested(deterministic))
