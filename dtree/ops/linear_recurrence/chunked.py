"""The ``chunked`` backend of :func:`dtree.ops.linear_recurrence.linear_recurrence`: the
chunkwise-parallel form of the recurrence in plain torch (float32 math, float64 for
float64 inputs), for a per-head decay ``g`` [T, H] with and without the delta rule
(gated DeltaNet, Mamba2's SSD, lightning attention). A per-key-row decay (Kimi, Mamba)
runs the ``reference`` recurrence instead.

The math, per head, for a chunk of ``C`` tokens that starts from state ``S0`` [K, V]
(``G_t = sum_{i<=t} g_i`` inside the chunk, ``D_ti = exp(G_t - G_i)`` for ``i <= t``,
else 0). The delta rule writes ``u_i = beta_i (v_i - S'_i^T k_i)`` into the state, where
``S'_i`` is the decayed state before token ``i``; unrolled inside the chunk::

    u = (I + A)^-1 diag(beta) (V - diag(exp G) K S0),    A_ij = beta_i D_ij k_i.k_j  (j < i)
      = W1 - W2 S0      W1 = T V,  W2 = T diag(exp G) K,  T = (I + A)^-1 diag(beta)

(the UT transform: one triangular solve per chunk; without the delta rule ``u = V``,
``W2 = 0``). Then, with ``P = (Q K^T) * D`` (``D`` with its diagonal)::

    O     = diag(exp G) Q S0 + P u               = Qe S0 + P W1
    S_end = exp(G_C) S0 + (K * exp(G_C - G))^T u = M S0 + B

where ``Qe = diag(exp G) Q - P W2``, ``M = exp(G_C) I - (K * exp(G_C - G))^T W2`` and
``B = (K * exp(G_C - G))^T W1`` depend on the chunk alone. So every chunk of every
segment computes its ``Qe``, ``P W1``, ``M`` and ``B`` in one batch of matmuls and one
batched triangular solve, and the states then cross the chunks in a loop of two
matmuls per step (``O = Qe S + P W1``, ``S = M S + B``), as many steps as the longest
segment has chunks, each step batched over the segments still running.

Layout: each segment is padded to whole chunks (padding rows have ``k = v = q = 0``,
``g = 0``, ``beta = 0``: they leave the state as it is), and the chunks are ordered
step-major over the segments sorted longest first, so the segments running at step
``j`` are a prefix of the state batch and their chunks a contiguous range. Autograd
differentiates everything, the initial states included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["recurrence_chunked", "CHUNK"]

CHUNK = 64


@dataclass(frozen=True)
class _ChunkLayout:
    """Host tables of one varlen call cut into chunks.

    ``order`` [N]: segments longest first; ``steps`` [J+1]: chunk offsets of each step
    (step ``j`` holds chunk ``j`` of the first ``running[j]`` segments of ``order``);
    ``running`` [J]; ``gather`` [num_chunks * C]: the call row of each padded position
    (``T``, a zero row, for padding); ``scatter`` [T]: each call row's padded position."""

    order: np.ndarray
    steps: np.ndarray
    running: np.ndarray
    gather: np.ndarray
    scatter: np.ndarray


def _chunk_layout(cu_seqlens: np.ndarray, chunk: int) -> _ChunkLayout:
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    chunks = np.maximum(1, -(-lengths // chunk))  # an empty segment still passes its state through
    order = np.argsort(-chunks, kind="stable")
    steps_count = int(chunks.max(initial=0))
    running = np.array([(chunks > j).sum() for j in range(steps_count)], dtype=np.int64)
    steps = np.concatenate([[0], np.cumsum(running)]).astype(np.int64)
    total = int(cu[-1])
    gather = np.full(int(steps[-1]) * chunk, total, dtype=np.int64)
    scatter = np.empty(total, dtype=np.int64)
    for rank, seg in enumerate(order):  # one vectorized fill per segment
        pos = np.arange(lengths[seg])
        slot = steps[pos // chunk] + rank  # segment `rank` of step j is chunk steps[j] + rank
        padded = slot * chunk + pos % chunk
        gather[padded] = cu[seg] + pos
        scatter[cu[seg] + pos] = padded
    return _ChunkLayout(order, steps, running, gather, scatter)


def _padded(x: torch.Tensor, gather: torch.Tensor, chunk: int) -> torch.Tensor:
    """[T, *rest] -> [num_chunks, C, *rest]: the rows ``gather`` names (``T``: a zero row)."""
    x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return x.index_select(0, gather).unflatten(0, (-1, chunk))  # [Nc, C, *rest]


def _chunk_terms(q, k, v, g, beta):
    """Per chunk ``(Qe, PW1, M, B)`` of the module docstring: [Nc, H, C, K], [Nc, H, C, V],
    [Nc, H, K, K], [Nc, H, K, V], from q, k [Nc, H, C, K], v [Nc, H, C, V], g and beta
    [Nc, H, C] (beta None: no delta rule)."""
    size = g.shape[-1]
    cum = g.cumsum(-1)
    lower = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    diff = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # D_ti = exp(G_t - G_i), i <= t
    to_end = (cum[..., -1:] - cum).exp().unsqueeze(-1)  # exp(G_C - G_i) [Nc, H, C, 1]
    grown = cum.exp().unsqueeze(-1)  # exp(G_t)
    k_end = k * to_end
    scores = (q @ k.transpose(-1, -2)) * decay  # P
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    end_decay = cum[..., -1].exp()[..., None, None]
    if beta is None:
        return q * grown, scores @ v, end_decay * eye, k_end.transpose(-1, -2) @ v
    b = beta.unsqueeze(-1)
    strict = (k @ k.transpose(-1, -2)) * decay * b
    unit = torch.eye(size, dtype=k.dtype, device=k.device)
    lhs = unit + strict.masked_fill(~lower, 0.0).masked_fill(unit.bool(), 0.0)
    rhs = torch.cat([v * b, k * grown * b], dim=-1)
    solved = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    w1, w2 = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    return (
        q * grown - scores @ w2,
        scores @ w1,
        end_decay * eye - k_end.transpose(-1, -2) @ w2,
        k_end.transpose(-1, -2) @ w1,
    )


def _affine(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``weight @ x + bias`` over [n, H, ...] batches in one batched GEMM (one launch per
    step of the state loop, which runs once per chunk of the longest segment)."""
    out = torch.baddbmm(bias.flatten(0, 1), weight.flatten(0, 1), x.flatten(0, 1))
    return out.unflatten(0, x.shape[:2])


def _across_chunks(terms, initial: torch.Tensor, layout: _ChunkLayout):
    """The state loop: ([Nc, H, C, V] chunk outputs, [N, H, K, V] final states in the
    order of ``layout.order``)."""
    qe, pw1, m, b = (x.contiguous() for x in terms)  # each step's slices then batch without copies
    state = initial
    outs, finished = [], []
    for j, running in enumerate(layout.running.tolist()):
        a, z = int(layout.steps[j]), int(layout.steps[j + 1])
        if running < state.shape[0]:  # the shorter segments ended: keep their final states
            finished.append(state[running:])
            state = state[:running]
        outs.append(_affine(qe[a:z], state, pw1[a:z]))
        state = _affine(m[a:z], state, b[a:z])
    finished.append(state)
    return torch.cat(outs), torch.cat(finished[::-1])


def recurrence_chunked(
    q, k, v, g, beta, cu_seqlens: np.ndarray, initial: torch.Tensor, scale: float, qk_l2norm: bool, chunk: int = CHUNK
):
    """Signature and shapes of :func:`dtree.ops.linear_recurrence.recurrence_reference`:
    q, k [T, Hk, K]; v [T, H, V]; g [T, H] (or [T, H, K]: the reference runs); beta
    [T, H] or None; ``cu_seqlens`` [N+1] (host); ``initial`` [N, H, K, V]. Returns
    ([T, H, V] in ``v.dtype``, [N, H, K, V] in the state dtype).

    Under autograd the whole computation is checkpointed: backward re-runs it from the
    inputs (a second forward of the recurrence, small beside the model's matmuls)
    instead of keeping its float32 chunk terms, several times the state per chunk and
    head, alive through the step."""
    from .reference import recurrence_reference, state_dtype

    if g.dim() == 3:  # per-key-row decay: not in this form
        return recurrence_reference(q, k, v, g, beta, cu_seqlens, initial, scale, qk_l2norm)
    if len(cu_seqlens) < 2:  # no segments
        return v.new_zeros(0, v.shape[1], v.shape[2]), initial.to(state_dtype(v.dtype))
    layout = _chunk_layout(cu_seqlens, chunk)
    inputs = (q, k, v, g, beta, initial)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(_recurrence, *inputs, layout, scale, qk_l2norm, chunk, use_reentrant=False)
    return _recurrence(*inputs, layout, scale, qk_l2norm, chunk)


def _recurrence(q, k, v, g, beta, initial, layout: _ChunkLayout, scale: float, qk_l2norm: bool, chunk: int):
    from .reference import l2norm, state_dtype

    heads, dtype, device, out_dtype = v.shape[1], state_dtype(v.dtype), v.device, v.dtype
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    if q.shape[1] != heads:
        q, k = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (q, k))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    gather = torch.as_tensor(layout.gather).to(device, non_blocking=True)
    rows = [q * scale, k, v, g] + ([] if beta is None else [beta.to(dtype)])
    # [Nc, C, H, ...] -> [Nc, H, C, ...]
    padded = [_padded(x, gather, chunk).movedim(2, 1) for x in rows]
    terms = _chunk_terms(*padded[:4], padded[4] if beta is not None else None)
    order = torch.as_tensor(layout.order).to(device, non_blocking=True)
    out, final = _across_chunks(terms, initial.to(dtype).index_select(0, order), layout)
    scatter = torch.as_tensor(layout.scatter).to(device, non_blocking=True)
    out = out.movedim(1, 2).flatten(0, 1).index_select(0, scatter)
    inverse = torch.as_tensor(np.argsort(layout.order)).to(device, non_blocking=True)
    return out.to(out_dtype), final.index_select(0, inverse)
