"""The bandwidth-bound elementwise kernels move 16-byte vectors, as compiled for an H100.

Triton vectorizes a masked load only when it can prove the mask constant over a
vector's elements: a tail mask ``offs < n`` with ``n`` left unspecialized
(``do_not_specialize``) is not, and every 2-byte element became a load and a store of
its own. On the H100 that ran the SwiGLU kernels at 40-55% of the memory bandwidth
(``benchmarks/results/h100/session_h/``). Here a realistic call's arguments go through
Triton's own binder for an sm_90 target (the specialization a real launch gets), the
kernel is compiled to PTX with it, and its global accesses are read. No GPU needed;
skipped under the Triton interpreter (its kernels are not JIT functions).
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from dtree.ops.stack_ops import triton_kernels as stk  # noqa: E402
from dtree.ops.swiglu import triton_kernels as swk  # noqa: E402

pytestmark = pytest.mark.skipif(swk._INTERPRET, reason="the session runs the Triton interpreter")


def _ptx(kernel, *args, num_warps: int, **constexprs) -> str:
    """The PTX of ``kernel`` as a launch with these arguments would compile it for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    try:
        backend = make_backend(target)
    except Exception as e:  # a Triton build without the NVIDIA backend
        pytest.skip(f"no CUDA backend in this Triton: {e}")
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**constexprs, "num_warps": num_warps}
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, consts, attrs = kernel._pack_args(backend, kwargs, bound, specialization, None)
    src = ASTSource(kernel, signature, consts, attrs)
    return triton.compile(src, target=target, options=options.__dict__).asm["ptx"]


def _accesses(ptx: str) -> tuple[set[str], set[str]]:
    """The widths of the kernel's global loads and stores (e.g. ``v4.b32``, ``b16``)."""
    loads = {m.split(".", 2)[-1] for m in re.findall(r"ld\.global(?:\.\w+)*", ptx)}
    stores = {m.split(".", 2)[-1] for m in re.findall(r"st\.global(?:\.\w+)*", ptx)}
    return loads, stores


def _bf16(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.bfloat16)


@pytest.mark.parametrize("tokens", [4096, 16383])
def test_swiglu_kernels_move_16_byte_vectors(tokens):
    n = tokens * 8960  # qwen2.5-1.5b's intermediate size: n % 16 == 0 for any token count
    g, u, p = _bf16(n), _bf16(n), _bf16(n)
    fwd = _ptx(swk._silu_mul_fwd_kernel, g, u, p, n, BLOCK=swk._BLOCK, num_warps=8)
    assert _accesses(fwd) == ({"v4.b32"}, {"v4.b32"}), _accesses(fwd)
    bwd = _ptx(swk._silu_mul_bwd_kernel, p, g, u, _bf16(n), _bf16(n), n, BLOCK=swk._BLOCK, PRODUCT=False,
               num_warps=8)
    assert _accesses(bwd) == ({"v4.b32"}, {"v4.b32"}), _accesses(bwd)
    in_place = _ptx(swk._silu_mul_bwd_kernel, p, g, u, g, u, n, BLOCK=swk._BLOCK, PRODUCT=True,
                    num_warps=8)  # a re-run's chunk
    assert _accesses(in_place) == ({"v4.b32"}, {"v4.b32"}), _accesses(in_place)


def test_an_element_count_off_the_16_grid_still_runs_its_own_variant():
    """n % 16 != 0 (an odd intermediate size) compiles a second, scalar variant: correct,
    only slower; the grid of the common case is what the test above pins."""
    n = 7 * 8961
    ptx = _ptx(swk._silu_mul_fwd_kernel, _bf16(n), _bf16(n), _bf16(n), n, BLOCK=swk._BLOCK, num_warps=8)
    assert "b16" in _accesses(ptx)[0]


def test_stack_seed_fold_moves_16_byte_vectors():
    n = 3000 * 2 * 128  # a call's K slots: tokens x kv heads x head dim
    sk, gk, ok = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32), _bf16(n)
    ptx = _ptx(stk._fold_kernel, sk, sk, gk, gk, ok, ok, n, n, HAS_GK=True, HAS_GV=True, BLOCK=stk._BLOCK,
               num_warps=8)
    loads, stores = _accesses(ptx)
    assert loads == {"v4.b32"} and stores <= {"v4.b32", "v2.b32"}, (loads, stores)
