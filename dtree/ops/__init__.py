"""Kernels of the hot path, each beside its pure-torch reference.

- :mod:`dtree.ops.stack_attention`: attention of packed query segments over the KV stack
  (``reference``, ``sdpa``, and the fused ``triton`` backend), with softcapping, sinks,
  ALiBi and sliding windows; :mod:`dtree.ops.stack_attention.reference` is the dense
  reference every backend is tested against; :func:`seed_from_stack` folds the stack's
  gradient slots of a call back into its own K/V gradients. Its parts:
  :mod:`~dtree.ops.stack_attention.segment_layout` (where each segment reads K/V from),
  :mod:`~dtree.ops.stack_attention.options` (score options, host-side checks) and
  :mod:`~dtree.ops.stack_attention.attention_math` (one segment's attention, float32 math and SDPA).
- :mod:`dtree.ops.stack_ops`: the KV stack's ops (push, gradient seed, zeroing, gather, a
  fixed-order segmented add): the CUDA extension of ``csrc/`` where built, else
  :mod:`~dtree.ops.stack_ops.reference` (the same contract and bits).
- :mod:`dtree.ops.determinism`: deterministic mode (``RuntimeConfig(deterministic=True)`` or
  ``torch.use_deterministic_algorithms(True)``) and where each kernel stands.
- :mod:`dtree.ops.logprobs`: chunked log-probs and entropies through the LM head (:class:`OutputHead`).
- :mod:`dtree.ops.backends`: the registry of every attention op's backends (stack, varlen,
  tree mask): name -> implementation, where each runs, and :func:`resolve_backend`
  (``"auto"`` or a name -> a backend that runs on a device, or a ValueError).
"""

from .logprobs import OutputHead, as_output_head, token_logprobs, token_logprobs_reference
from .stack_attention import (
    AttentionOptions,
    SegmentLayout,
    StackSlots,
    seed_from_stack,
    stack_attention,
    stack_attention_naive,
    stack_attention_reference,
    stack_attention_sdpa,
)
from .registry import resolve_backend

__all__ = [
    "AttentionOptions",
    "OutputHead",
    "SegmentLayout",
    "StackSlots",
    "as_output_head",
    "resolve_backend",
    "seed_from_stack",
    "stack_attention",
    "stack_attention_naive",
    "stack_attention_reference",
    "stack_attention_sdpa",
    "token_logprobs",
    "token_logprobs_reference",
]
