"""The KV stack (:mod:`.kv_stack`: KVStack, the K/V of the current root-to-node path with
gradient buffers) and its ops (push, gradient seed, zeroing, gather, a fixed-order segmented add).

:mod:`.interface` dispatches each op to the CUDA extension of ``csrc/`` where it is built
(and loads it), else to the Triton kernels (:mod:`.triton_kernels`) where they run, else to
:mod:`.reference`, the pure-torch path with the same contract and bits.
"""

from .interface import (
    BUILD_COMMAND,
    SlotRows,
    extension_disabled,
    extension_error,
    gather_slots,
    note_missing_extension,
    push_kv,
    seed_grad,
    segment_add,
    uses_extension,
    zero_slots,
)

__all__ = [
    "BUILD_COMMAND",
    "SlotRows",
    "extension_disabled",
    "extension_error",
    "gather_slots",
    "note_missing_extension",
    "push_kv",
    "seed_grad",
    "segment_add",
    "uses_extension",
    "zero_slots",
]
