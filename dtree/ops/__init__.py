"""Kernels of the hot path, each beside its pure-torch reference.

- :mod:`dtree.ops.stack_attention`: attention of packed query segments over the KV stack
  (``reference``, ``sdpa``, and the fused ``triton`` backend).
- :mod:`dtree.ops.logprobs`: chunked log-probs and entropies through the LM head (:class:`OutputHead`).
"""

from .logprobs import OutputHead, as_output_head, token_logprobs, token_logprobs_reference
from .stack_attention import SegmentLayout, stack_attention, stack_attention_reference, stack_attention_sdpa

__all__ = [
    "OutputHead",
    "SegmentLayout",
    "as_output_head",
    "stack_attention",
    "stack_attention_reference",
    "stack_attention_sdpa",
    "token_logprobs",
    "token_logprobs_reference",
]
