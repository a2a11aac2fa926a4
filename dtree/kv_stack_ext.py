"""The KV stack's bookkeeping ops, compiled (``dtree/csrc/``) with pure-torch references.

Three ops, each handling K and V in one call (one kernel launch on CUDA):

* :func:`push`: write rows ``k, v`` [T, kv_heads, head_dim] into one layer of the
  stack, row ``t`` to slot ``start + slots[t]`` (or ``start + t``);
* :func:`accumulate`: add ``dk, dv`` [n, kv_heads, head_dim] into one layer's float32
  gradient slots; slots may repeat and every repeat is added (atomics on CUDA);
* :func:`zero_grad`: zero the gradient slots ``[lo, hi)`` of every layer.

Each has a reference beside it (``push_reference``, ...) with the same signature.
The compiled ops are ``torch.ops.dtree.kv_push``, ``kv_accumulate`` and
``kv_zero_grad``; they mutate their buffer arguments (declared in the schema) and
have fake kernels, so ``torch.compile`` traces through them.

Build. On first use (not at ``import dtree``) the extension is compiled with
``torch.utils.cpp_extension.load`` (ninja) into a cache directory, the CUDA kernels
only when torch has CUDA, a GPU is visible and nvcc is found; later processes reuse
the build. When it is missing or fails to build, the references run instead, with
one warning (:class:`FallbackWarning`). Environment:

* ``DTREE_NO_EXT=1``: do not build; use the references.
* ``DTREE_EXT=require``: raise (naming the fix) instead of falling back.
* ``DTREE_EXT_DIR``: cache directory (default ``<tempdir>/dtree_ext``).
* ``DTREE_EXT_VERBOSE=1``: show the compiler's output.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "FallbackWarning",
    "accumulate",
    "accumulate_reference",
    "load",
    "push",
    "push_reference",
    "status",
    "zero_grad",
    "zero_grad_reference",
]

_TRUE = ("1", "true", "yes", "on")
_FIX = (
    "install a C++ compiler (g++) and ninja (`pip install ninja`), plus, for CUDA tensors, the CUDA toolkit "
    "matching torch.version.cuda (nvcc, with CUDA_HOME set), and unset DTREE_NO_EXT; or unset DTREE_EXT to use "
    "the pure-torch fallback"
)


class FallbackWarning(RuntimeWarning):
    """The compiled KV-stack ops are unavailable; the pure-torch references run."""


@dataclass
class _State:
    tried: bool = False
    loaded: bool = False  # ops registered, with CPU (and meta) kernels
    cuda: bool = False  # CUDA kernels registered too
    reason: str = ""  # why not loaded, or why no CUDA kernels
    log: str = ""  # the build error in full
    build_dir: str = ""
    seconds: float = 0.0
    warned: bool = False
    route: dict = field(default_factory=dict)  # device type -> use the compiled ops


_state = _State()
_lock = threading.Lock()
_fakes_registered = False


# ----------------------------------------------------------------------------- checks


def _check_pair(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dim() != 4:
        raise RuntimeError(f"{what}: expected [layers, capacity, kv_heads, head_dim], got {tuple(a.shape)}")
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise RuntimeError(
            f"{what}: K and V buffers differ ({tuple(a.shape)} {a.dtype} {a.device} vs "
            f"{tuple(b.shape)} {b.dtype} {b.device})"
        )


def _check_rows(stack, layer, a, b, start, index, what: str) -> None:
    """The checks of csrc/kv_stack.h, for the references and the fake kernels
    (plain raises: dynamo traces them, and they guard symbolic sizes)."""
    if not 0 <= layer < stack.shape[0]:
        raise RuntimeError(f"{what}: layer {layer} out of range [0, {stack.shape[0]})")
    if a.dim() != 3 or a.shape[1:] != stack.shape[2:]:
        raise RuntimeError(
            f"{what}: expected rows of shape [n, {stack.shape[2]}, {stack.shape[3]}], got {tuple(a.shape)}"
        )
    if a.shape != b.shape:
        raise RuntimeError(f"{what}: K rows {tuple(a.shape)} and V rows {tuple(b.shape)} differ in shape")
    n, capacity = a.shape[0], stack.shape[1]
    if index is None:
        if not (0 <= start and start + n <= capacity):
            raise RuntimeError(f"{what}: slots [{start}, {start + n}) out of range for capacity {capacity}")
    else:
        if index.dim() != 1 or index.shape[0] != n:
            raise RuntimeError(f"{what}: index must be [{n}], got {tuple(index.shape)}")
        if index.dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"{what}: index must be int32 or int64, got {index.dtype}")


def _check_zero(grad, lo, hi) -> None:
    if not 0 <= lo <= hi <= grad.shape[1]:
        raise RuntimeError(f"kv_zero_grad: slots [{lo}, {hi}) out of range for capacity {grad.shape[1]}")


# ----------------------------------------------------------------------------- references


def push_reference(
    stack_k: torch.Tensor,
    stack_v: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int = 0,
    slots: torch.Tensor | None = None,
) -> None:
    """Pure-torch :func:`push`: ``index_copy_`` (or a slice copy) per buffer."""
    _check_pair(stack_k, stack_v, "kv_push")
    _check_rows(stack_k, layer, k, v, start, slots, "kv_push")
    if slots is None:
        stack_k[layer, start : start + k.shape[0]].copy_(k)
        stack_v[layer, start : start + v.shape[0]].copy_(v)
    else:
        idx = slots.long() + start
        stack_k[layer].index_copy_(0, idx, k.to(stack_k.dtype))
        stack_v[layer].index_copy_(0, idx, v.to(stack_v.dtype))


def accumulate_reference(
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
    layer: int,
    dk: torch.Tensor,
    dv: torch.Tensor,
    start: int = 0,
    index: torch.Tensor | None = None,
) -> None:
    """Pure-torch :func:`accumulate`: ``index_add_`` (or a slice ``add_``) per buffer."""
    _check_pair(grad_k, grad_v, "kv_accumulate")
    _check_rows(grad_k, layer, dk, dv, start, index, "kv_accumulate")
    if index is None:
        grad_k[layer, start : start + dk.shape[0]].add_(dk.to(grad_k.dtype))
        grad_v[layer, start : start + dv.shape[0]].add_(dv.to(grad_v.dtype))
    else:
        idx = index + start if start else index
        grad_k[layer].index_add_(0, idx, dk.to(grad_k.dtype))
        grad_v[layer].index_add_(0, idx, dv.to(grad_v.dtype))


def zero_grad_reference(grad_k: torch.Tensor, grad_v: torch.Tensor, lo: int, hi: int) -> None:
    """Pure-torch :func:`zero_grad`."""
    _check_pair(grad_k, grad_v, "kv_zero_grad")
    _check_zero(grad_k, lo, hi)
    grad_k[:, lo:hi].zero_()
    grad_v[:, lo:hi].zero_()


# ----------------------------------------------------------------------------- public ops


def push(
    stack_k: torch.Tensor,
    stack_v: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int = 0,
    slots: torch.Tensor | None = None,
) -> None:
    """Write K/V rows into one layer of the stack.

    Args:
        stack_k, stack_v: [layers, capacity, kv_heads, head_dim] contiguous buffers.
        layer: the layer to write.
        k, v: [T, kv_heads, head_dim], any strides (e.g. a transposed view); any
            dtype (converted to the stack's).
        start: slot of row 0 (or the offset added to ``slots``).
        slots: int32/int64 [T] distinct slots, or None for ``start + arange(T)``.
    """
    if _use_ext(stack_k):
        torch.ops.dtree.kv_push.default(stack_k, stack_v, layer, k, v, start, slots)
    else:
        push_reference(stack_k, stack_v, layer, k, v, start, slots)


def accumulate(
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
    layer: int,
    dk: torch.Tensor,
    dv: torch.Tensor,
    start: int = 0,
    index: torch.Tensor | None = None,
) -> None:
    """Add dK/dV rows into one layer's gradient slots.

    Args:
        grad_k, grad_v: [layers, capacity, kv_heads, head_dim] contiguous float32
            buffers (other dtypes run the reference).
        layer: the layer to add into.
        dk, dv: [n, kv_heads, head_dim] any float dtype, any strides.
        start: slot of row 0 (or the offset added to ``index``).
        index: int32/int64 [n] slots, repeats allowed (each is added), or None for
            ``start + arange(n)``.
    """
    if grad_k.dtype == torch.float32 and _use_ext(grad_k):
        torch.ops.dtree.kv_accumulate.default(grad_k, grad_v, layer, dk, dv, start, index)
    else:
        accumulate_reference(grad_k, grad_v, layer, dk, dv, start, index)


def zero_grad(grad_k: torch.Tensor, grad_v: torch.Tensor, lo: int, hi: int) -> None:
    """Zero the gradient slots ``[lo, hi)`` of every layer of both
    [layers, capacity, kv_heads, head_dim] contiguous buffers."""
    if _use_ext(grad_k):
        torch.ops.dtree.kv_zero_grad.default(grad_k, grad_v, lo, hi)
    else:
        zero_grad_reference(grad_k, grad_v, lo, hi)


# ----------------------------------------------------------------------------- loading


def _use_ext(t: torch.Tensor) -> bool:
    # one dict lookup per call once the device type has been seen
    use = _state.route.get(t.device.type)
    return _decide(t.device.type) if use is None else use


def _required() -> bool:
    mode = os.environ.get("DTREE_EXT", "auto").strip().lower()
    if mode not in ("", "auto", "require"):
        raise ValueError(f"DTREE_EXT must be 'auto' or 'require', got {mode!r}")
    return mode == "require"


@torch.compiler.disable  # runs once per device type; may compile C++, which dynamo must not trace
def _decide(device_type: str) -> bool:
    require = _required()
    loaded = load(require)
    if device_type in ("cpu", "meta"):
        use, why = loaded, _state.reason
    elif device_type == "cuda":
        use, why = _state.cuda, _state.reason
    else:
        use, why = False, f"no kernels for {device_type} tensors"
    if not use:
        if require:
            raise _unavailable(why)
        if not _state.warned:
            _state.warned = True
            warnings.warn(
                f"dtree: KV-stack extension unavailable ({why.splitlines()[0]}); using the pure-torch fallback "
                "(DTREE_EXT=require makes this an error)",
                FallbackWarning,
                stacklevel=2,
            )
    _state.route[device_type] = use
    return use


def load(require: bool | None = None) -> bool:
    """Build (or reuse the cached build of) the extension and register its ops, once
    per process. Returns whether the ops are available (CPU kernels at least; see
    :func:`status` for CUDA). The ops call it on first use; call it before
    ``torch.compile(..., fullgraph=True)``, which cannot trace a build.

    Args:
        require: raise a RuntimeError naming the fix when the extension is
            unavailable. None reads ``DTREE_EXT=require`` from the environment.
    """
    if require is None:
        require = _required()
    if not _state.tried:
        with _lock:
            if not _state.tried:
                t0 = time.perf_counter()
                _build()
                _state.tried, _state.seconds = True, time.perf_counter() - t0
                # devices served by the extension need no decision (and no graph break
                # under torch.compile) on their first op
                if _state.loaded:
                    _state.route.update(cpu=True, meta=True, **({"cuda": True} if _state.cuda else {}))
    if require and not _state.loaded:
        raise _unavailable(_state.reason)
    return _state.loaded


def _unavailable(why: str) -> RuntimeError:
    return RuntimeError(
        f"dtree: the KV-stack extension was required (DTREE_EXT=require or load(require=True)) but is unavailable: "
        f"{why}. To fix: {_FIX}.\n{_state.log}".rstrip()
    )


def status() -> dict:
    """What :func:`load` found: ``loaded``, ``cuda``, ``reason`` (why not, or why no
    CUDA kernels), ``build_dir`` and ``seconds`` (the load, build included)."""
    return {k: getattr(_state, k) for k in ("loaded", "cuda", "reason", "build_dir", "seconds")}


def _source_dir() -> Path | None:
    # shipped as package data (dtree/csrc), so installed and in-repo runs find them alike
    d = Path(__file__).resolve().parent / "csrc"
    return d if (d / "kv_stack.cpp").is_file() else None


def _build_dir(src: Path, variant: str) -> Path:
    # one directory per torch build, Python, source tree and variant: a build.ninja
    # per directory, a library built against one torch does not load in another, and
    # two checkouts sharing a directory would rebuild each other's library
    root = Path(os.environ.get("DTREE_EXT_DIR") or Path(tempfile.gettempdir()) / "dtree_ext")
    where = hashlib.sha1(str(src).encode()).hexdigest()[:8]
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{where}-{variant}"
    return root / tag.replace("+", "_")


def _build() -> None:
    if os.environ.get("DTREE_NO_EXT", "").strip().lower() in _TRUE:
        _state.reason = "DTREE_NO_EXT is set"
        return
    src = _source_dir()
    if src is None:
        _state.reason = "C++ sources (dtree/csrc/kv_stack.cpp) not found in the dtree package"
        return
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _state.reason = "no C++ compiler found (install g++, or set CXX)"
        return
    if not cpp_extension.is_ninja_available():
        _state.reason = "ninja not found (pip install ninja)"
        return
    cuda_home = cpp_extension.CUDA_HOME
    with_cuda = bool(
        torch.version.cuda and torch.cuda.is_available() and cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists()
    )
    variant = "cuda" if with_cuda else "cpu"
    sources = [src / "kv_stack.cpp"] + ([src / "kv_stack_cuda.cu"] if with_cuda else [])
    build_dir = _build_dir(src, variant)
    build_dir.mkdir(parents=True, exist_ok=True)
    _state.build_dir = str(build_dir)
    try:
        cpp_extension.load(
            name=f"dtree_kv_stack_{variant}",
            sources=[str(s) for s in sources],
            # -O3: GCC vectorizes the accumulate loops only from -O3 (3.5x faster on
            # CPU, measured); the build takes about as long as at -O2
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("DTREE_EXT_VERBOSE", "").strip().lower() in _TRUE,
        )
    except Exception as e:  # a failed build falls back (or raises in load(require=True))
        _state.reason = f"build failed in {build_dir}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        _state.log = str(e)
        return
    _register_fakes()
    _state.loaded, _state.cuda = True, with_cuda
    if torch.cuda.is_available() and not with_cuda:
        _state.reason = "built without CUDA kernels (nvcc not found; set CUDA_HOME)"


def _register_fakes() -> None:
    """Fake (meta) kernels: shape checks only, since the ops return nothing and
    mutate buffers whose metadata does not change."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("dtree::kv_push")
    def _(stack_k, stack_v, layer, k, v, start=0, slots=None):
        _check_pair(stack_k, stack_v, "kv_push")
        _check_rows(stack_k, layer, k, v, start, slots, "kv_push")

    @torch.library.register_fake("dtree::kv_accumulate")
    def _(grad_k, grad_v, layer, dk, dv, start=0, index=None):
        _check_pair(grad_k, grad_v, "kv_accumulate")
        if grad_k.dtype != torch.float32:
            raise RuntimeError(f"kv_accumulate: gradient buffers must be float32, got {grad_k.dtype}")
        _check_rows(grad_k, layer, dk, dv, start, index, "kv_accumulate")

    @torch.library.register_fake("dtree::kv_zero_grad")
    def _(grad_k, grad_v, lo, hi):
        _check_pair(grad_k, grad_v, "kv_zero_grad")
        _check_zero(grad_k, lo, hi)

    _fakes_registered = True
