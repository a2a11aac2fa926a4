"""dtree's build: the package's metadata is pyproject.toml's; this file adds the KV-stack
CUDA extension (csrc/ -> dtree._stack_ops_cuda) where it can be built.

    pip install --no-build-isolation .     # with a CUDA torch installed and nvcc on CUDA_HOME: builds it
    DTREE_SKIP_CUDA_BUILD=1 pip install .  # never builds it
    pip install -e .                       # (CI, scripts/run.sh) pip's isolated build env has no torch: skips it

The extension is optional: without it dtree runs the same ops as torch ops
(dtree/ops/stack_ops/reference.py). Importing dtree never compiles anything. Environment:

    DTREE_SKIP_CUDA_BUILD=1   skip the extension
    DTREE_CUDA_ARCHS="80;90"  compute capabilities to compile for (default: sm_80 and sm_90,
                              plus PTX of the last one, which newer GPUs JIT-compile)
    MAX_JOBS                  parallel compile jobs (ninja), as for any torch extension
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

EXTENSION = "dtree._stack_ops_cuda"
SOURCES = ["csrc/stack_ops.cpp", "csrc/stack_ops_cuda.cu"]
DEFAULT_ARCHS = "80;90"
_TRUE = ("1", "true", "yes", "on")


def cuda_build_plan(environ=os.environ) -> tuple[bool, str]:
    """Whether to build the CUDA extension here, and why (or why not)."""
    if environ.get("DTREE_SKIP_CUDA_BUILD", "").strip().lower() in _TRUE:
        return False, "DTREE_SKIP_CUDA_BUILD is set"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return False, (
            "torch is not importable in the build environment (pip's build isolation hides the installed one); "
            "to build it: pip install --no-build-isolation ."
        )
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    if nvcc is None or not os.path.exists(nvcc):
        return False, f"no nvcc found (CUDA_HOME={CUDA_HOME}); set CUDA_HOME to a CUDA {torch.version.cuda} toolkit"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {nvcc}"


def gencode_flags(archs: str) -> list[str]:
    """nvcc flags for ``archs`` ("80;90"): SASS for each, PTX for the last."""
    caps = [a.strip().replace(".", "") for a in archs.replace(",", ";").split(";") if a.strip()]
    if not caps or not all(c.isdigit() for c in caps):
        raise ValueError(f"DTREE_CUDA_ARCHS must list compute capabilities like '80;90', got {archs!r}")
    flags = [f"-gencode=arch=compute_{c},code=sm_{c}" for c in caps]
    return flags + [f"-gencode=arch=compute_{caps[-1]},code=compute_{caps[-1]}"]


def extension_kwargs(environ=os.environ) -> dict:
    """``setup()`` keywords for the extension: empty when it is not built."""
    build, reason = cuda_build_plan(environ)
    if not build:
        print(f"dtree: not building the KV-stack CUDA extension: {reason}", file=sys.stderr)
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    print(f"dtree: building the KV-stack CUDA extension with {reason}", file=sys.stderr)
    nvcc = ["-O3", "-std=c++17", *gencode_flags(environ.get("DTREE_CUDA_ARCHS", DEFAULT_ARCHS))]
    ext = CUDAExtension(EXTENSION, SOURCES, extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


if __name__ == "__main__":
    setup(**extension_kwargs())
