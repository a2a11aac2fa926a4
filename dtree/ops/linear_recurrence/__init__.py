"""The gated linear recurrences of hybrid models over the packed segments of one call:
:mod:`.reference` (the naive and the chunked torch references), :mod:`.interface` (the
dispatcher and :data:`BACKENDS`), :mod:`.fla_backend` (flash-linear-attention's chunked
kernels, CUDA)."""

from .interface import BACKENDS, linear_recurrence
from .reference import l2norm, recurrence_naive, recurrence_reference, state_dtype

__all__ = ["BACKENDS", "l2norm", "linear_recurrence", "recurrence_naive", "recurrence_reference", "state_dtype"]
