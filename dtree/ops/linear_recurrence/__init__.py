"""The gated linear recurrences of hybrid models over the packed segments of one call:
:mod:`.interface` (the naive and chunked torch references and the dispatcher),
:mod:`.fla_backend` (flash-linear-attention's chunked kernels, CUDA)."""

from .interface import BACKENDS, l2norm, linear_recurrence, recurrence_naive, recurrence_reference, state_dtype

__all__ = ["BACKENDS", "l2norm", "linear_recurrence", "recurrence_naive", "recurrence_reference", "state_dtype"]
