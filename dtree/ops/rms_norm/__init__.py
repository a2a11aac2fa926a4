"""RMSNorm that keeps only its input for backward: :mod:`.interface` (the reference, the
torch path and the autograd function), :mod:`.triton_kernels` (its CUDA kernels)."""

from .interface import RMSNormFunction, rms_norm, rms_norm_reference

__all__ = ["RMSNormFunction", "rms_norm", "rms_norm_reference"]
