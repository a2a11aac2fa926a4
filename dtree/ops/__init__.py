"""Kernels of the hot path, one package per op, each with its pure-torch reference beside
the fused files (``reference.py`` or a ``*_reference`` function), its entry points in
``interface.py`` and exported by the package:

- :mod:`dtree.ops.stack_attention`: attention of packed query segments over the KV stack,
  one signature ``(q, k, v, slots, options)`` for every backend (``reference``, ``sdpa``,
  the fused ``triton`` kernel, ``flash-attn``), with softcapping, sinks, ALiBi and sliding
  windows; :func:`seed_from_stack` folds the stack's gradient slots of a call back into its
  own K/V gradients.
- :mod:`dtree.ops.stack_ops`: the KV stack's ops (push, gradient seed, zeroing, gather, a
  fixed-order segmented add): the CUDA extension of ``csrc/`` where built, Triton where it
  runs, else the pure-torch path with the same contract and bits.
- :mod:`dtree.ops.logprobs`: chunked log-probs and entropies through the LM head
  (:class:`OutputHead`), fused in Triton on CUDA.
- :mod:`dtree.ops.rms_norm`, :mod:`dtree.ops.swiglu`: the lean layers' RMSNorm and SwiGLU;
  :mod:`dtree.ops.weight_grads`: their projections' weight gradients added into ``param.grad``
  inside the matmul during a step.
- :mod:`dtree.ops.linear_recurrence` (torch and flash-linear-attention) and
  :mod:`dtree.ops.short_conv`: the recurrent layers of hybrid models, over the states of
  :mod:`dtree.ops.segment_states`.
- :mod:`dtree.ops.determinism`: deterministic mode (``RuntimeConfig(deterministic=True)`` or
  ``torch.use_deterministic_algorithms(True)``) and where each kernel stands.
- :mod:`dtree.ops.backends`: how an op registers its backends (:class:`~dtree.ops.backends.Backends`:
  a dict name -> function, the availability checks, what ``auto`` picks);
  :func:`dtree.ops.registry.resolve_backend` picks one by op name.

The baselines' kernels (varlen and tree-mask attention) live in :mod:`dtree.baselines.kernels`.
"""

from .logprobs import OutputHead, as_output_head, token_logprobs, token_logprobs_reference
from .registry import resolve_backend
from .stack_attention import (
    AttentionOptions,
    SegmentLayout,
    StackSlots,
    seed_from_stack,
    stack_attention_naive,
    stack_attention_reference,
    stack_attention_sdpa,
)

__all__ = [
    "AttentionOptions",
    "OutputHead",
    "SegmentLayout",
    "StackSlots",
    "as_output_head",
    "resolve_backend",
    "seed_from_stack",
    "stack_attention_naive",
    "stack_attention_reference",
    "stack_attention_sdpa",
    "token_logprobs",
    "token_logprobs_reference",
]
