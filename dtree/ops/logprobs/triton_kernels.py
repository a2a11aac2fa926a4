"""Fused LM-head log-probs and entropy: cuBLAS matmuls, Triton for everything elementwise.

Contract (the chunked torch op of :mod:`dtree.ops.logprobs` with a plain ``weight`` /
``bias`` head): for row ``i``,

    x = hidden[i] @ weight.T + bias            (model dtype, as an HF ``lm_head``)
    z = transform(x) = c * tanh(x * s / c) / T (float32; no tanh without a softcap c)
    logp[i] = log_softmax(z)[labels[i]]        entropy[i] = -sum_j p_j log p_j

with ``s = logit_scale``, ``c = softcap``, ``T = temperature``; both outputs are float32
and differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.

How (per chunk of ``chunk_size`` rows; ``[N, V]`` is never written):

* forward: ``logits = hidden_c @ weight.T`` (cuBLAS, model dtype, into one reused
  ``[chunk, V]`` buffer), then :func:`_row_stats_kernel` reads it once: an online
  softmax per row gives the normalizer, the label's log-prob and the entropy. Saved
  for backward: ``norm`` ``[N, 2]`` (row max, log sum exp(z - max)) and ``entropy``
  ``[N]``, float32. The normalizer stays split in two: ``lse`` in one float32 rounds
  by ``6e-8 |lse|``, which ``p = exp(z - lse)`` turns into a relative error of ``p``,
  and ``1 - p`` of a peaked row loses it all (measured: 7e-6 at |z| ~ 100).
* backward, per slice of ``[v0, v1)`` vocabulary columns for all rows (a ``[N, v1 - v0]``
  buffer no larger than the forward's ``[chunk, V]``): the slice's logits are recomputed
  (cuBLAS; with ``keep_logits`` and every row in one chunk, the forward's are kept
  instead) and :func:`_dlogits_kernel` turns them, in place, into ``dL/dx`` in the model
  dtype, for gradients arriving on ``logp`` and on ``entropy``; then
  ``dW[v0:v1] = dx.T @ hidden`` (one product over all rows: written once, no ``[V, H]``
  accumulator), ``db[v0:v1] = dx.sum(0)`` and ``dh += dx @ weight[v0:v1]`` (cuBLAS,
  summed over the slices in a float32 ``[N, H]`` buffer).

Gradient of one row, with ``p = softmax(z)``, ``g`` / ``ge`` the incoming gradients on
``logp`` / ``entropy`` and ``H`` the entropy:

    dz_j = g (1[j = y] - p_j) - ge p_j (log p_j + H)
    dx_j = dz_j * (s / T) * (1 - tanh^2(x_j s / c))      (the last factor only with c)

Why this split (``benchmarks/PERF_NOTES.md``, "LM-head log-probs"): the three matmuls
(8NHV FLOPs with the recompute) are a floor no fusion removes, and cuBLAS runs them at
~700 TFLOP/s on an H100; the chunked torch version spends as much again on ~70 bytes
per logit of float32 elementwise passes, which these two kernels cut to ~6.

Every fused stage has its pure-torch twin (:mod:`dtree.ops.logprobs.fused_head`:
:func:`_row_stats_torch`, :func:`_dlogits_torch`), used for float64 inputs and on CPU without the Triton
interpreter, and compared with the kernels by the tests; :func:`token_logprobs_dense`
is the plain full-logits autograd version the whole op is tested against.

Runs on CUDA or, for tests, on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1`` set before Triton is imported).
"""

from __future__ import annotations

import os

import torch

from ..fast_launch import cdiv, fast_launch
from .transform import LogitTransform

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the caller's fast-path selection catches this and keeps the torch op
    raise ImportError(
        "the fused LM-head log-prob kernels need Triton: pip install triton (or pip install 'dtree[triton]')"
    ) from e

__all__: list[str] = []  # the op is in dtree.ops.logprobs.fused_head

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Launch shapes. Forward: one program per row, BLOCK_V columns per step (bf16: 16 per
# thread at 8 warps, 128-bit loads). Backward: [BLOCK_M, BLOCK_V] tiles, a 2-D grid.
_FWD = {"BLOCK_V": 4096, "num_warps": 8}
_BWD = {"BLOCK_M": 8, "BLOCK_V": 1024, "num_warps": 8}
# Under the interpreter: small blocks, so that the tests' V ~ 1000 crosses many.
_INTERPRETER_FWD = {"BLOCK_V": 128}
_INTERPRETER_BWD = {"BLOCK_M": 4, "BLOCK_V": 128}


# --------------------------------------------------------------------------- kernels
@triton.jit
def _tanh(x):
    # tl has no tanh; exp(-2|x|) never overflows, and |error| stays ~1e-7 absolute
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _transformed(x, scale, softcap, temperature, HAS_SOFTCAP: tl.constexpr):
    """(z, dz/dx) of the logit transform, float32, both shaped like ``x``: the compiler
    needs one return type from both branches (a scalar dz/dx in the plain branch did
    not compile on a GPU: "Inconsistent return types"; the interpreter accepted it)."""
    u = x * scale
    if HAS_SOFTCAP:
        th = _tanh(u / softcap)
        return softcap * th / temperature, scale * (1.0 - th * th) / temperature
    return u / temperature, tl.zeros_like(u) + scale / temperature


# Arguments that change between calls are not specialized on (an int equal to 1 or
# divisible by 16, a pointer aligned to 16 bytes would each compile a new variant):
# the runtime passes label slices at any offset, N is the chunk's row count, and the
# backward's vocabulary slices differ in width (V) and first id (V0); their row stride is
# their width, a multiple of 16 for every slice where the vocabulary's size is one.
@triton.jit(do_not_specialize=["LABELS"])
def _row_stats_kernel(
    LOGITS, LABELS, LOGP, NORM, ENTROPY,
    stride_row, V,
    scale, softcap, temperature,
    HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row per program: the normalizer (max, log sum), log p(label) and
    (optionally) the entropy in one read.

    Online softmax with a scalar running max ``m`` and per-lane sums
    ``s = sum exp(z - m)`` and ``t = sum exp(z - m) (z - m)``. ``t`` is kept relative to
    the max so that the entropy ``log S - T / S`` has no cancellation against
    ``|max logit|`` when the distribution is peaked, and ``z - m`` is taken in natural
    units before the base-2 scaling (scaling ``z`` and ``m`` first rounds each by
    ``6e-8 |z|``: 4e-6 nats at |z| = 100, measured in the peaked test)."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # a finite start: (old max - new max) stays a number (-inf - -inf would be NaN)
    # and its exp underflows to 0
    m = tl.full([], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    t = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        x = tl.load(base + v0 + cols, mask=ok, other=0.0).to(tl.float32)
        z, _ = _transformed(x, scale, softcap, temperature, HAS_SOFTCAP)
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp2((m - m_new) * 1.4426950408889634)
        d = z - m_new
        e = tl.exp2(d * 1.4426950408889634)
        if WITH_ENTROPY:
            t = alpha * (t + s * (m - m_new)) + tl.where(ok, e * d, 0.0)
        s = s * alpha + e
        m = m_new
    total = tl.sum(s, axis=0)
    log_sum = tl.log(total)
    tl.store(NORM + 2 * row, m)
    tl.store(NORM + 2 * row + 1, log_sum)
    if WITH_ENTROPY:
        tl.store(ENTROPY + row, log_sum - tl.sum(t, axis=0) / total)
    # the label's logit: one element; labels outside [0, V) give NaN instead of a wild read
    y = tl.load(LABELS + row)
    valid = (y >= 0) & (y < V)
    xl = tl.load(base + tl.where(valid, y, 0)).to(tl.float32)
    zl, _ = _transformed(xl, scale, softcap, temperature, HAS_SOFTCAP)
    tl.store(LOGP + row, tl.where(valid, (zl - m) - log_sum, float("nan")))


@triton.jit(do_not_specialize=["LABELS", "NORM", "ENTROPY", "G", "GE", "N", "V", "V0"])
def _dlogits_kernel(
    LOGITS, LABELS, NORM, ENTROPY, G, GE,
    stride_row, N, V, V0,
    scale, softcap, temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_GE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Overwrite a [BLOCK_M, BLOCK_V] tile of recomputed logits with dL/dlogits; the
    ``V`` columns are vocabulary ids ``V0 .. V0 + V - 1``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < V)[None, :]
    ptr = LOGITS + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    x = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    z, dzdx = _transformed(x, scale, softcap, temperature, HAS_SOFTCAP)
    row_max = tl.load(NORM + 2 * rows, mask=row_ok, other=0.0)
    log_sum = tl.load(NORM + 2 * rows + 1, mask=row_ok, other=0.0)
    logp = (z - row_max[:, None]) - log_sum[:, None]
    p = tl.exp(logp)
    dz = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    if HAS_G:
        g = tl.load(G + rows, mask=row_ok, other=0.0)
        y = tl.load(LABELS + rows, mask=row_ok, other=-1)
        dz = tl.where(cols[None, :] + V0 == y[:, None], g[:, None], 0.0) - g[:, None] * p
    if HAS_GE:
        ge = tl.load(GE + rows, mask=row_ok, other=0.0)
        h = tl.load(ENTROPY + rows, mask=row_ok, other=0.0)
        dz -= ge[:, None] * p * (logp + h[:, None])
    tl.store(ptr, (dz * dzdx).to(LOGITS.dtype.element_ty), mask=ok)


def _can_launch(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device`` (CUDA, or CPU tensors when the
    interpreter is on)."""
    return _INTERPRET if device.type == "cpu" else device.type == "cuda"


def _row_stats_triton(logits, labels, tf: LogitTransform, with_entropy: bool):
    """Fused twin of :func:`dtree.ops.logprobs.fused_head._row_stats_torch`."""
    n, v = logits.shape
    norm = torch.empty(n, 2, dtype=torch.float32, device=logits.device)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp) if with_entropy else None
    launch = _INTERPRETER_FWD if _INTERPRET else _FWD
    fast_launch(
        _row_stats_kernel, (n,),
        logits, labels, logp, norm, entropy if with_entropy else logp,
        logits.stride(0), v,
        tf.scale, tf.softcap or 1.0, tf.temperature,
        HAS_SOFTCAP=tf.softcap is not None, WITH_ENTROPY=with_entropy, **launch,
    )
    return logp, norm, entropy


def _dlogits_triton(logits, labels, norm, entropy, g, ge, tf: LogitTransform, first_id: int = 0) -> torch.Tensor:
    """Fused twin of :func:`dtree.ops.logprobs.fused_head._dlogits_torch` (``logits``: the
    vocabulary columns from id ``first_id`` on)."""
    n, v = logits.shape
    launch = dict(_INTERPRETER_BWD if _INTERPRET else _BWD)
    grid = (cdiv(n, launch["BLOCK_M"]), cdiv(v, launch["BLOCK_V"]))
    fast_launch(
        _dlogits_kernel, grid,
        logits, labels, norm, entropy if entropy is not None else norm,
        g if g is not None else norm, ge if ge is not None else norm,
        logits.stride(0), n, v, first_id,
        tf.scale, tf.softcap or 1.0, tf.temperature,
        HAS_SOFTCAP=tf.softcap is not None, HAS_G=g is not None, HAS_GE=ge is not None, **launch,
    )
    return logits
