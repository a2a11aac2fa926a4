"""SwiGLU's ``silu(gate) * up`` and down projection with lean activations:
:mod:`.interface` (the references, the torch path, the autograd functions),
:mod:`.triton_kernels` (its CUDA kernels); :mod:`.rerun_mlp`, the whole MLP of a checkpointed
layer's re-run, its gate and up computed per row chunk in backward."""

from .interface import (
    SiluMulFunction,
    SwiGLUDownFunction,
    silu_mul,
    silu_mul_reference,
    swiglu_down,
    swiglu_down_reference,
)
from .rerun_mlp import RerunMLPFunction, rerun_mlp, rerun_mlp_reference

__all__ = [
    "RerunMLPFunction",
    "SiluMulFunction",
    "SwiGLUDownFunction",
    "rerun_mlp",
    "rerun_mlp_reference",
    "silu_mul",
    "silu_mul_reference",
    "swiglu_down",
    "swiglu_down_reference",
]
