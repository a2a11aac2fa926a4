"""The fused LM-head log-prob op (:func:`token_logprobs_triton`): cuBLAS matmuls per chunk
of rows (forward) or slice of the vocabulary (backward, :func:`vocab_slice`) and the two
Triton passes of :mod:`dtree.ops.logprobs.triton_kernels` (design notes there), each
beside its pure-torch twin, and :func:`token_logprobs_dense`, the plain full-logits version
the op is tested against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .transform import LogitTransform, compute_dtype
from .triton_kernels import _KERNEL_DTYPES, _can_launch, _dlogits_triton, _row_stats_triton

__all__ = ["token_logprobs_dense", "token_logprobs_triton", "vocab_slice"]


# --------------------------------------------------------------------------- torch twins
def _log_softmax(z: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``log p`` of [rows, V] transformed logits from their normalizer [rows, 2]."""
    return (z - norm[:, :1]) - norm[:, 1:]


def _label_logp(z: torch.Tensor, norm: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p[i, labels[i]]``; NaN where the label is outside [0, V), as the kernel."""
    valid = (labels >= 0) & (labels < z.shape[1])
    zl = z.gather(1, labels.clamp(0, z.shape[1] - 1)[:, None].long())
    return torch.where(valid, _log_softmax(zl, norm).squeeze(1), torch.nan)


def _row_stats_torch(logits, labels, tf: LogitTransform, with_entropy: bool):
    """Per row of ``logits`` [rows, V]: (log p(label) [rows], normalizer [rows, 2] = (max,
    log sum exp(z - max)), entropy [rows] or None), float32 (float64 for float64 logits)."""
    z = tf.apply(logits.to(compute_dtype(logits.dtype)))
    row_max = z.amax(dim=1, keepdim=True)
    norm = torch.cat([row_max, (z - row_max).exp().sum(1, keepdim=True).log()], dim=1)
    entropy = None
    if with_entropy:
        logq = _log_softmax(z, norm)
        entropy = -(logq.exp() * logq).sum(1)
    return _label_logp(z, norm, labels), norm, entropy


def _dlogits_torch(logits, labels, norm, entropy, g, ge, tf: LogitTransform, first_id: int = 0) -> torch.Tensor:
    """Overwrite ``logits`` [rows, v] (the vocabulary columns from id ``first_id`` on) with
    dL/dlogits (see :mod:`.triton_kernels`) for gradients ``g`` on log p(label) and ``ge``
    on the entropy ([rows] or None each), from the rows' normalizer ``norm`` [rows, 2]."""
    with torch.enable_grad():  # the transform's derivative, by autograd on the chunk
        x = logits.detach().to(compute_dtype(logits.dtype)).requires_grad_(True)
        z = tf.apply(x.to(compute_dtype(x.dtype)))
    logq = _log_softmax(z.detach(), norm)
    p = logq.exp()
    dz = torch.zeros_like(p)
    if g is not None:
        dz -= g[:, None] * p
        col = labels.long() - first_id
        valid = (col >= 0) & (col < dz.shape[1])  # as the kernel: no one-hot term for ids outside the columns
        dz.scatter_add_(1, col.clamp(0, dz.shape[1] - 1)[:, None], (g * valid)[:, None].to(dz.dtype))
    if ge is not None:
        dz -= ge[:, None] * p * (logq + entropy[:, None])
    (dx,) = torch.autograd.grad(z, x, dz)
    return logits.copy_(dx)


# --------------------------------------------------------------------------- the op
_FP32_OUT_MM: dict[torch.device, bool] = {}


def _fp32_out_mm_works(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` accumulates
    16-bit products straight into a float32 buffer here (cuBLAS; torch >= 2.9). Probed
    once per device on a small product against the float32 result."""
    if device not in _FP32_OUT_MM:
        ok = False
        if device.type == "cuda":
            try:
                gen = torch.Generator(device=device).manual_seed(0)
                a = torch.randn(8, 16, device=device, generator=gen).to(torch.bfloat16)
                b = torch.randn(16, 8, device=device, generator=gen).to(torch.bfloat16)
                acc = torch.ones(8, 8, device=device)
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                ok = torch.allclose(acc, 1 + a.float() @ b.float(), atol=1e-4, rtol=1e-4)
            except (RuntimeError, TypeError):
                ok = False
        _FP32_OUT_MM[device] = ok
    return _FP32_OUT_MM[device]


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in a wider dtype than ``a, b`` (or the same):
    accumulated by cuBLAS in place when it can, so no ``[V, H]`` product is rounded to
    16 bits per chunk and no extra pass over it is made. On CPU the inputs are widened
    first (exact). On a CUDA torch without ``addmm(out_dtype=)`` the product is rounded
    to 16 bits and added, as the chunked torch op does: widening ``a`` (``[V, chunk]``)
    would cost a 2.5 GB float32 copy per chunk at V = 152k."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype == torch.float32 and _fp32_out_mm_works(acc.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif acc.device.type == "cuda":
        acc += a @ b
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _logits_into(out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``out[:] = hidden @ weight.T + bias`` in the model dtype (what ``F.linear`` computes).
    ``out`` is contiguous in every caller: on an H200 a strided ``out`` (a slice of wider rows)
    gave gradients 3x off the bf16 error downstream (session M)."""
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, tf: LogitTransform, with_entropy: bool, chunk: int, fused: bool,
                keep_logits: bool):
        n, v = hidden.shape[0], weight.shape[0]
        row_stats = _row_stats_triton if fused else _row_stats_torch
        cdt = compute_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=cdt, device=hidden.device)
        norm = torch.empty(n, 2, dtype=cdt, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else None
        buf = torch.empty(min(chunk, n), v, dtype=hidden.dtype, device=hidden.device)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            logits = _logits_into(buf[: b - a], hidden[a:b], weight, bias)
            lp, ls, ent = row_stats(logits, labels[a:b], tf, with_entropy)
            logp[a:b], norm[a:b] = lp, ls
            if with_entropy:
                entropy[a:b] = ent
        # one chunk: its buffer holds every row's logits, which the backward's one vocabulary
        # slice (vocab_slice: the whole vocabulary) would recompute with the same matmul
        ctx.logits = buf if keep_logits and n <= chunk else None
        del buf
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, norm, entropy)
        ctx.tf, ctx.chunk, ctx.fused = tf, chunk, fused
        if entropy is None:
            return logp
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, bias, labels, norm, entropy = ctx.saved_tensors
        kept, ctx.logits = ctx.logits, None  # overwritten in place below: a second backward recomputes
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        dlogits = _dlogits_triton if ctx.fused else _dlogits_torch
        n, v = hidden.shape[0], weight.shape[0]
        cdt = norm.dtype
        width = vocab_slice(n, v, ctx.chunk)
        several = width < v
        grad_w = torch.empty(v, hidden.shape[1], dtype=weight.dtype, device=weight.device) if need_w else None
        grad_b = torch.empty(v, dtype=cdt, device=weight.device) if (need_b and bias is not None) else None
        # dh sums over the vocabulary slices in the compute dtype, rounded once at the end
        grad_h = None
        if need_h:
            make = torch.zeros if several else torch.empty
            grad_h = make(n, hidden.shape[1], dtype=cdt if several else hidden.dtype, device=hidden.device)
        g = grad_logp.to(cdt).contiguous() if grad_logp is not None else None
        ge = grad_entropy.to(cdt).contiguous() if grad_entropy is not None else None
        # every slice a contiguous [n, b - a] view of one buffer (a narrower last slice as a strided
        # view of a [n, width] buffer made its bf16 gradients 3x less accurate on an H200, session M)
        buf = torch.empty(n * width, dtype=hidden.dtype, device=hidden.device) if kept is None else None
        for a in range(0, v, width):
            b = min(v, a + width)
            w = weight[a:b]
            if kept is None:
                d = _logits_into(buf[: n * (b - a)].view(n, b - a), hidden, w, bias[a:b] if bias is not None else None)
            else:  # width == v: the forward's logits, the same bits
                d = kept
            dlogits(d, labels, norm, entropy, g, ge, ctx.tf, a)
            if need_w:
                torch.mm(d.t(), hidden, out=grad_w[a:b])
            if grad_b is not None:
                grad_b[a:b] = d.sum(0, dtype=cdt)
            if need_h:
                if several:
                    _accumulate_mm(grad_h, d, w)
                else:
                    torch.mm(d, w, out=grad_h)
        del buf, kept, d
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def vocab_slice(rows: int, vocab: int, chunk: int) -> int:
    """Vocabulary columns per slice of :class:`_FusedLogprobs`' backward over ``rows``: the
    ``[rows, slice]`` logits buffer holds no more than the forward's ``[chunk, vocab]`` one
    (the whole vocabulary when ``rows <= chunk``); a multiple of 128 when it is split, so
    that every slice's row stride but the last one's is a multiple of 16 elements (one
    compiled dL/dlogits kernel) and each slice of the weight starts 256-byte aligned."""
    if rows <= chunk:
        return vocab
    width = max(1, chunk * vocab // rows)
    return width - width % 128 if width >= 128 else width


def _check(hidden, weight, labels, bias, tf: LogitTransform, chunk_size: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels must be [N] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 or int32 token ids, got {labels.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        raise ValueError(f"hidden, weight and bias must share one floating dtype, got {dtypes}; cast the hidden states")
    devices = {hidden.device, weight.device, labels.device} | ({bias.device} if bias is not None else set())
    if len(devices) != 1:
        raise ValueError(f"hidden, weight, labels and bias must be on one device, got {sorted(map(str, devices))}")
    if not (math.isfinite(tf.temperature) and tf.temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {tf.temperature}")
    if tf.softcap is not None and not (math.isfinite(tf.softcap) and tf.softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {tf.softcap}")
    if not math.isfinite(tf.scale):
        raise ValueError(f"logit_scale must be finite, got {tf.scale}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 4096,
    impl: str = "auto",
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and the entropy) under ``softmax(transform(hidden @ weight.T + bias))``.

    Args:
        hidden: [N, H] final hidden states (after the model's last norm).
        weight: [V, H] output embedding; ``bias``: [V] or None. Same dtype as ``hidden``.
        labels: [N] int64/int32 token ids in ``[0, V)``. Not range-checked here (that
            would cost a device sync); an id outside gives a NaN log-prob, never a
            read outside the logits.
        logit_scale: multiplies the logits after the matmul.
        softcap: ``softcap * tanh(logits / softcap)`` after the scale (Gemma-2's final
            softcapping), or None.
        temperature: the logits are divided by it last (the rollouts' sampling
            temperature).
        with_entropy: also return the entropy of each row's distribution.
        chunk_size: rows per chunk of the forward; the backward runs slices of the
            vocabulary over all rows, each no larger (:func:`vocab_slice`): peak extra
            memory is one ``[chunk_size, V]`` buffer in the model dtype, plus, in backward,
            the weight's gradient and, when the vocabulary is split, a float32 ``[N, H]``
            sum of the hidden states' gradient.
        impl: ``"triton"`` (the fused kernels; CUDA, or CPU under TRITON_INTERPRET=1;
            float16/bfloat16/float32), ``"torch"`` (the same chunks and matmuls with the
            elementwise stages in torch), or ``"auto"``: triton where it runs, else torch
            (float64 inputs, CPU without the interpreter).
        keep_logits: where every row fits one chunk (``N <= chunk_size``), keep the
            forward's ``[N, V]`` logits for the backward instead of recomputing them (one
            matmul of ``2 N H V`` FLOPs less; the same gradients bit for bit). The buffer
            then lives until the backward has run, so pass True only where the backward
            follows the loss at once (as a training call's does); the backward needs an
            equal buffer at that point anyway.

    Returns:
        (logp [N], entropy [N] or None), float32 (float64 for float64 inputs), both
        differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.
    """
    tf = LogitTransform(float(logit_scale), None if softcap is None else float(softcap), float(temperature))
    _check(hidden, weight, labels, bias, tf, chunk_size)
    runs_here = hidden.dtype in _KERNEL_DTYPES and _can_launch(hidden.device)
    if impl == "auto":
        fused = runs_here
    elif impl == "triton":
        if not runs_here:
            raise ValueError(
                f"impl='triton' runs {_KERNEL_DTYPES} on CUDA (or on CPU with TRITON_INTERPRET=1 set before "
                f"Triton is imported), got {hidden.dtype} on {hidden.device}; use impl='auto' or 'torch'"
            )
        fused = True
    elif impl == "torch":
        fused = False
    else:
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    n = hidden.shape[0]
    if n == 0:
        empty = hidden.new_zeros(0, dtype=compute_dtype(hidden.dtype))
        return empty, (empty.clone() if with_entropy else None)
    out = _FusedLogprobs.apply(
        hidden.contiguous(), weight, bias, labels.contiguous(), tf, bool(with_entropy), int(chunk_size), fused,
        bool(keep_logits),
    )
    return (out[0], out[1]) if with_entropy else (out, None)


def token_logprobs_dense(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain version of :func:`token_logprobs_triton`: full ``[N, V]`` logits and
    autograd (tests and small inputs only). Same arguments and results."""
    tf = LogitTransform(float(logit_scale), None if softcap is None else float(softcap), float(temperature))
    z = tf.apply(F.linear(hidden, weight, bias).to(compute_dtype(hidden.dtype)))
    logq = torch.log_softmax(z, dim=-1)
    logp = logq.gather(-1, labels[:, None].long()).squeeze(-1)
    return logp, (-(logq.exp() * logq).sum(-1) if with_entropy else None)
