"""Rotary position embeddings of q and k in one kernel each way: :mod:`.interface`
(the reference, the torch path, the autograd function), :mod:`.triton_kernels` (its
CUDA kernel)."""

from .interface import RotaryFunction, rotary, rotary_reference

__all__ = ["RotaryFunction", "rotary", "rotary_reference"]
