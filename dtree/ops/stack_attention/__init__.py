"""Stack attention: attention of packed query segments over the KV stack.

One signature for every backend, ``(q, k, v, slots, options)``, documented once in
:mod:`.options`. The files of the op:

- :mod:`.reference`: the dense reference every backend is tested against.
- :mod:`.interface`: the dispatcher :func:`stack_attention` and :data:`BACKENDS` (name ->
  function, the availability checks, what ``auto`` picks); :func:`prepare_stack_attention`
  does a call's table work ahead of its first layer.
- :mod:`.per_segment`: the ``reference`` (float32 math) and ``sdpa`` backends;
  :mod:`.attention_math`: one segment's attention; :mod:`.seed`: :func:`seed_from_stack`.
- :mod:`.options`: the call's arguments and host-side checks; :mod:`.segment_layout`:
  where each segment reads K/V from.
- the ``triton`` backend: :mod:`.triton_autograd` (entry points, autograd function, design
  notes) over :mod:`.triton_launch` (configs, work tables) and the kernels of
  :mod:`.triton_forward`, :mod:`.triton_backward` and :mod:`.triton_common`.
- the ``flash-attn`` backend: :mod:`.flash4`; its one-call path :mod:`.masked_call` over
  :mod:`.call_mask` with the kernel of :mod:`.flash4_masked_call` (launches replayed by
  :mod:`.flash4_launch_replay`); its region path :mod:`.regions`,
  :mod:`.region_plan`, :mod:`.lse_merge_triton` and :mod:`.flash4_replay`.
"""

from .attention_math import attend_math, attend_sdpa
from .interface import BACKENDS, prepare_stack_attention, stack_attention
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
    "prepare_stack_attention",
    "seed_from_stack",
    "stack_attention",
    "stack_attention_naive",
    "stack_attention_reference",
    "stack_attention_sdpa",
]
