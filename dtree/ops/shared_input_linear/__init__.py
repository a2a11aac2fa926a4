"""Several linear projections of one input as one autograd op: :mod:`.interface` (the
reference, the torch path and the autograd function), :mod:`.triton_kernels` (the bias
gradients' column sums in one CUDA kernel)."""

from .interface import SharedInputLinearFunction, shared_input_linear, shared_input_linear_reference

__all__ = ["SharedInputLinearFunction", "shared_input_linear", "shared_input_linear_reference"]
