"""The ``fla`` backend of :func:`dtree.ops.linear_recurrence.linear_recurrence`:
flash-linear-attention's chunked Triton kernels (``pip install 'dtree[hybrid]'``,
which installs ``fla-core``; CUDA).

Each kernel takes a packed varlen call (``cu_seqlens``) with one initial state per
sequence, returns the final states, and differentiates through both, which is what a
call of packed segments over the state stack needs:

=========================  ====================================================
recurrence                 fla kernel
=========================  ====================================================
delta rule, per-head decay ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
delta rule, per-key decay  ``fla.ops.kda.chunk_kda``
no delta, per-head decay   ``fla.ops.simple_gla.chunk_simple_gla``
no delta, per-key decay    ``fla.ops.gla.chunk_gla``
=========================  ====================================================

The kernels run in the inputs' dtype with float32 states and gates (q, k, v are cast
to ``v``'s dtype); the reference backend is the token-by-token float32 recurrence, and
``benchmarks/hybrid_gpu.py`` checks each kernel against it under the flash-attention
rule. Grouped value heads (fewer q/k heads than value heads) go to the kernels as they
are for the delta rule and are repeated for the others.
"""

from __future__ import annotations

import numpy as np
import torch

from ..backends import Target

__all__ = ["recurrence_fla", "fla_nondeterministic", "fla_unavailable", "hopper_triton_refusal", "FLA_INSTALL"]

FLA_INSTALL = "pip install 'dtree[hybrid]'"


def fla_unavailable(target: Target) -> str | None:
    """Why the ``fla`` backend cannot run on ``target`` (None: it runs)."""
    if target.device.type != "cuda":
        return f"runs on CUDA only (the model is on {target.device.type}); use recurrence='chunked' or 'reference'"
    try:
        import fla.ops  # noqa: F401
    except Exception as error:  # ImportError, or a Triton/CUDA mismatch at import
        return f"needs flash-linear-attention ({FLA_INSTALL}): {type(error).__name__}: {error}"
    import importlib.util

    import triton

    capability = torch.cuda.get_device_capability(target.device)
    return hopper_triton_refusal(capability, triton.__version__, importlib.util.find_spec("tilelang") is not None)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split("+")[0].split(".")[:3])


def hopper_triton_refusal(capability: tuple[int, int], triton_version: str, tilelang: bool) -> str | None:
    """fla-core 0.6.0 raises in its gated chunk backward on Hopper with Triton >= 3.4.0 and
    < 3.7.1 ("produces incorrect results") unless tilelang is installed: say so before
    the first backward (``auto`` then takes ``chunked``)."""
    if capability[0] == 9 and (3, 4, 0) <= _version(triton_version) < (3, 7, 1) and not tilelang:
        return (f"refuses Hopper GPUs with Triton {triton_version} (fla-core: incorrect gated backward before "
                "Triton 3.7.1); upgrade Triton to >= 3.7.1, pip install tilelang, or use recurrence='chunked'")
    return None


def fla_nondeterministic(target: Target) -> str | None:
    """Why the ``fla`` backend does not count as deterministic (:mod:`dtree.ops.determinism`):
    dtree has not checked its kernels for a fixed summation order."""
    return "runs flash-linear-attention's Triton kernels, whose summation order dtree does not check"


def recurrence_fla(q, k, v, g, beta, cu_seqlens: np.ndarray, initial: torch.Tensor, scale: float, qk_l2norm: bool):
    """Signature and shapes of :func:`dtree.ops.linear_recurrence.recurrence_reference`."""
    dtype = v.dtype
    cu_cpu = torch.as_tensor(np.asarray(cu_seqlens, dtype=np.int64))
    cu = cu_cpu.to(v.device, non_blocking=True)
    q, k = q.to(dtype), k.to(dtype)
    heads = v.shape[1]
    per_key = g.dim() == 3
    if beta is None and q.shape[1] != heads:
        q, k = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (q, k))
    if beta is None and qk_l2norm:
        from .reference import l2norm

        q, k = l2norm(q.float()).to(dtype), l2norm(k.float()).to(dtype)
    # the kernels index [B, T, H, D] by its shape: the adapters' splits are strided views
    q, k, v, g = (x.contiguous().unsqueeze(0) for x in (q, k, v, g.float()))
    # the host copy spares the kernels' launch code a device sync
    common = dict(
        scale=scale, initial_state=initial.float(), output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu
    )
    if beta is not None:
        beta = beta.contiguous().unsqueeze(0)
        if per_key:
            from fla.ops.kda import chunk_kda

            out, final = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=qk_l2norm, **common)
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            out, final = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=qk_l2norm, **common)
    elif per_key:
        from fla.ops.gla import chunk_gla

        out, final = chunk_gla(q, k, v, g=g, **common)
    else:
        from fla.ops.simple_gla import chunk_simple_gla

        out, final = chunk_simple_gla(q, k, v, g=g, **common)
    return out[0].to(dtype), final.float()
