"""Stack attention: attention of packed query segments over the KV stack.

One signature for every backend, ``(q, k, v, slots, options)``, documented once in
:mod:`.options`. Files, one op: :mod:`.reference` (the dense reference every backend is
tested against), :mod:`.interface` (the dispatcher and :data:`BACKENDS`, name ->
function), :mod:`.per_segment` (the ``reference`` and ``sdpa`` backends), :mod:`.seed`
(:func:`seed_from_stack`), :mod:`.options` (the call's arguments, host-side checks), :mod:`.segment_layout` (where each segment reads K/V from), :mod:`.attention_math`
(one segment's attention: float32 math and SDPA), the fused ``triton`` backend
(:mod:`.triton_launch` over the kernels of :mod:`.triton_forward` and :mod:`.triton_backward`) and the ``flash-attn`` backend (:mod:`.flash4` over
:mod:`.regions`, :mod:`.region_plan`, :mod:`.lse_merge_triton`, :mod:`.flash4_replay`).
"""

from .attention_math import attend_math, attend_sdpa
from .interface import BACKENDS, stack_attention
from .options import PLAIN, AttentionOptions, StackSlots, check_packed_qkv, check_stack_attention
from .per_segment import stack_attention_reference, stack_attention_sdpa
from .reference import stack_attention_naive
from .seed import seed_from_stack
from .segment_layout import SegmentLayout

__all__ = [
    "BACKENDS",
    "PLAIN",
    "AttentionOptions",
    "SegmentLayout",
    "StackSlots",
    "attend_math",
    "attend_sdpa",
    "check_packed_qkv",
    "check_stack_attention",
    "seed_from_stack",
    "stack_attention",
    "stack_attention_naive",
    "stack_attention_reference",
    "stack_attention_sdpa",
]
