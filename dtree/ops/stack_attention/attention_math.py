"""Attention of one segment whose keys sit at consecutive depths ending at its last
query's (prefix first): the float32 math and the SDPA version of it, with the options
of :class:`dtree.ops.stack_attention.options.AttentionOptions`. The per-segment backends of
stack attention and the varlen baseline (no prefix) share them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .options import PLAIN, AttentionOptions

__all__ = ["attend_math", "attend_sdpa"]


def _distance(tq: int, tk: int, device) -> torch.Tensor:
    """[tq, tk] ``pos_q - pos_k`` for queries that are the last ``tq`` of ``tk`` keys."""
    rows = torch.arange(tq, device=device)[:, None] + (tk - tq)
    return rows - torch.arange(tk, device=device)[None, :]


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv * group, D], head h of the result being kv head h // group."""
    if group == 1:
        return x
    t, h, d = x.shape
    return x[:, :, None, :].expand(t, h, group, d).reshape(t, h * group, d)


def attend_math(
    q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float, options: AttentionOptions | None = None
) -> torch.Tensor:
    """Float32 (float64 for float64 inputs) attention of one segment.

    q: [Tq, Hq, Dk]; kk: [Tk, Hkv, Dk], vv: [Tk, Hkv, Dv], the keys at consecutive
    depths ending at the last query's (prefix first): row r sees keys ``0 .. Tk - Tq + r``
    (and, with a window, only the last ``window`` of those). Returns [Tq, Hq, Dv].
    """
    opts = options or PLAIN
    group = q.shape[1] // kk.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    tq, tk = q.shape[0], kk.shape[0]
    qf = q.to(compute)
    # each kv head serves `group` consecutive q heads; an expanded view's backward is a sum
    # over the group (repeat_interleave's is an index_add with atomics on CUDA)
    kf = _expand_heads(kk.to(compute), group)
    vf = _expand_heads(vv.to(compute), group)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if opts.softcap is not None:
        scores = opts.softcap * torch.tanh(scores / opts.softcap)
    dist = _distance(tq, tk, q.device)
    if opts.alibi_slopes is not None:
        scores = scores - opts.alibi_slopes.to(compute)[:, None, None] * dist.to(compute)
    hidden = dist < 0
    if opts.window is not None:
        hidden = hidden | (dist >= opts.window)
    scores = scores.masked_fill(hidden, float("-inf"))
    if opts.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = opts.sinks.to(compute)[:, None, None].expand(-1, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def _sdpa_mask(q: torch.Tensor, tq: int, tk: int, opts: AttentionOptions) -> torch.Tensor:
    """[Hq or 1, tq, tk (+1 sink column)] mask for SDPA: bool (True = attend) for a
    window alone, else additive in q's dtype (0 / -inf, ALiBi bias, the sink logits)."""
    dist = _distance(tq, tk, q.device)
    visible = dist >= 0
    if opts.window is not None:
        visible = visible & (dist < opts.window)
    if opts.alibi_slopes is None and opts.sinks is None:
        return visible[None]
    bias = torch.zeros((1, tq, tk), dtype=q.dtype, device=q.device)
    if opts.alibi_slopes is not None:
        bias = -opts.alibi_slopes.to(q.dtype)[:, None, None] * dist.to(q.dtype)
    bias = bias.masked_fill(~visible, float("-inf"))
    if opts.sinks is not None:
        sink = opts.sinks.to(q.dtype)[:, None, None].expand(-1, tq, 1)
        bias = torch.cat([bias.expand(sink.shape[0], -1, -1), sink], dim=-1)
    return bias


def attend_sdpa(
    q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float, options: AttentionOptions | None = None
) -> torch.Tensor:
    """Same contract as :func:`attend_math`, through ``scaled_dot_product_attention``
    (FlashAttention-2 inside on CUDA for plain causal attention). A window, ALiBi and
    sinks become a mask (a sink is one more key with zero K and V whose mask entry is
    the sink logit, so its gradient flows through the mask); softcapping needs a
    transform of the scores that SDPA cannot apply, so it runs :func:`attend_math`."""
    from torch.nn.attention.bias import causal_lower_right

    opts = options or PLAIN
    if opts.softcap is not None:
        return attend_math(q, kk, vv, scale, opts)
    tq, tk = q.shape[0], kk.shape[0]
    if opts.sinks is not None:
        kk = torch.cat([kk, kk.new_zeros((1, *kk.shape[1:]))])
        vv = torch.cat([vv, vv.new_zeros((1, *vv.shape[1:]))])
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, kk, vv))
    if not opts.plain:
        mask = _sdpa_mask(q, tq, tk, opts)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None], scale=scale, enable_gqa=True)
    elif tq == tk:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(tq, tk), scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)
