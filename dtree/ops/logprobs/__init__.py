"""Chunked token log-probs and entropies through the LM head.

:mod:`.interface`: :class:`OutputHead`, :func:`token_logprobs` (torch chunks, or the fused
Triton head of :mod:`.triton_kernels` on CUDA) and :func:`token_logprobs_reference`.
"""

from .interface import (
    IMPLS,
    OutputHead,
    as_output_head,
    compute_dtype,
    fused_head_kernel,
    token_logprobs,
    token_logprobs_reference,
)

__all__ = [
    "IMPLS",
    "OutputHead",
    "as_output_head",
    "compute_dtype",
    "fused_head_kernel",
    "token_logprobs",
    "token_logprobs_reference",
]
