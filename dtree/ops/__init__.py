"""Kernels of the hot path, each beside its pure-torch reference.

- :mod:`dtree.ops.stack_attention`: attention of packed query segments over the KV stack
  (``reference``, ``sdpa``, and the fused ``triton`` backend).
- :mod:`dtree.ops.logprobs`: chunked log-probs and entropy from hidden states.
"""

from .logprobs import token_entropy, token_logprobs, token_logprobs_reference
from .stack_attention import SegmentLayout, stack_attention, stack_attention_reference, stack_attention_sdpa

__all__ = [
    "SegmentLayout",
    "stack_attention",
    "stack_attention_reference",
    "stack_attention_sdpa",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_reference",
]
