"""SwiGLU's ``silu(gate) * up`` and down projection with lean activations:
:mod:`.interface` (the references, the torch path, the autograd functions),
:mod:`.triton_kernels` (its CUDA kernels)."""

from .interface import SiluMulFunction, SwiGLUDownFunction, silu_mul, silu_mul_reference, swiglu_down, swiglu_down_reference

__all__ = [
    "SiluMulFunction",
    "SwiGLUDownFunction",
    "silu_mul",
    "silu_mul_reference",
    "swiglu_down",
    "swiglu_down_reference",
]
