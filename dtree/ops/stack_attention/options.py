"""What every stack-attention backend takes besides ``q, k, v``, and the host-side checks
every backend runs before anything launches.

One signature for every backend (:data:`dtree.ops.stack_attention.BACKENDS`)::

    attend(q, k, v, slots: StackSlots, options: AttentionOptions = PLAIN) -> out

    q    [T, Hq, Dk]   packed queries of all segments of the call (Hq a multiple of Hkv)
    k    [T, Hkv, Dk]  the segments' own keys
    v    [T, Hkv, Dv]  the segments' own values (Dv may differ from Dk: MLA)
    out  [T, Hq, Dv]   in ``q.dtype``

``slots`` says where the segments' ancestors sit on the KV stack (the stack, the layer,
the :class:`SegmentLayout`); ``options`` holds the softmax scale, the score options and
the determinism flag. Backward returns dq, the own dk, dv and dsinks through autograd and
adds the prefix dK/dV into ``slots.stack.grad_k/grad_v[slots.layer]``.

The checks (shapes against each other, the stack and the layout; option values) each
raise a ValueError that names the fix.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..stack_ops.kv_stack import KVStack
from .segment_layout import SegmentLayout

__all__ = ["PLAIN", "AttentionOptions", "StackSlots", "check_packed_qkv", "check_stack_attention"]


@dataclass(frozen=True)
class StackSlots:
    """Where one call's segments read their ancestors' K/V.

    Attributes:
        stack: the KV stack holding every ancestor's K/V (and, in training, the
            gradient slots the prefix dK/dV are added into).
        layer: the layer index into the stack.
        layout: the segments' query offsets and prefix ranges (its device tables are
            built once and reused by every layer).
        own_in_stack: the caller wrote the call's own K/V (the ``k, v`` it passes) into
            their slots (``layout.own_slot``) already, so a backend that reads them from
            the stack (the flash-attn backend's one-call path) does not copy them again.
    """

    stack: KVStack
    layer: int
    layout: SegmentLayout
    own_in_stack: bool = False


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """The options of one call (score options all None: plain causal attention).

    Attributes:
        softcap: scores ``s -> softcap * tanh(s / softcap)`` after ``scale``.
        sinks: [Hq] a sink logit per query head in the softmax denominator only.
        alibi_slopes: [Hq] adds ``-slope_h * (pos_q - pos_k)`` to the scores.
        window: a query at depth ``i`` sees keys at depths ``i - window < j <= i``.
        scale: the softmax scale (None: ``Dk ** -0.5``).
        deterministic: the same bits in every run (:mod:`dtree.ops.determinism`; None:
            on under ``torch.use_deterministic_algorithms(True)``): the prefix dK/dV are
            added in a fixed order, and on CUDA the ``sdpa`` backend differentiates the
            float32 math in its backward (SDPA's fused backward sums dQ with atomics).
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    window: int | None = None
    scale: float | None = None
    deterministic: bool | None = None

    @property
    def plain(self) -> bool:
        """No score option: plain causal attention (scale and determinism aside)."""
        return self.softcap is None and self.sinks is None and self.alibi_slopes is None and self.window is None

    def softmax_scale(self, head_dim: int) -> float:
        """``scale``, or ``head_dim ** -0.5`` where it is None."""
        return float(head_dim**-0.5 if self.scale is None else self.scale)


PLAIN = AttentionOptions()


def _check_head_vector(name: str, x, q: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape [{q.shape[1]}] (one value per query head), got {type(x).__name__}")
    if x.shape != (q.shape[1],):
        raise ValueError(f"{name} must have shape [{q.shape[1]}] (one value per query head), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}; move it to {q.device}")


def check_stack_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StackSlots, options: AttentionOptions
) -> None:
    """Host-side checks every backend runs before anything launches: the shapes of
    q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] against each other, the stack and the
    layout, and the option values. Raises ValueError naming the fix."""
    if not isinstance(slots, StackSlots):
        raise TypeError(f"slots must be a StackSlots(stack, layer, layout), got {type(slots).__name__}")
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    stack, layout = slots.stack, slots.layout
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"expected q [T, Hq, Dk], k [T, Hkv, Dk] and v [T, Hkv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or q.shape[2] != k.shape[2] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"expected q [T, Hq, Dk], k [T, Hkv, Dk] and v [T, Hkv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if (stack.num_kv_heads, stack.head_dim, stack.v_head_dim) != (k.shape[1], k.shape[2], v.shape[2]):
        raise ValueError(
            f"the stack holds {stack.num_kv_heads} kv heads with key dim {stack.head_dim} and value dim "
            f"{stack.v_head_dim}, the call has {k.shape[1]} with {k.shape[2]} and {v.shape[2]}; size the stack "
            "(ModelSpec num_kv_heads / head_dim / v_head_dim) from what the attention receives"
        )
    t = q.shape[0]
    if len(layout.q_offsets) < 2 or int(layout.q_offsets[0]) != 0 or int(layout.q_offsets[-1]) != t:
        raise ValueError(f"layout.q_offsets must run from 0 to T={t}, got {list(layout.q_offsets)}")
    cap = options.softcap
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not math.isfinite(cap) or cap <= 0
    ):
        raise ValueError(f"softcap must be a finite number > 0 (or None for no capping), got {cap!r}")
    if options.sinks is not None:
        _check_head_vector("sinks", options.sinks, q)
    if options.alibi_slopes is not None:
        _check_head_vector("alibi_slopes", options.alibi_slopes, q)
        if options.alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes must not require grad (ALiBi slopes are constants); pass slopes.detach()")
    w = options.window
    if w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 1):
        raise ValueError(f"window must be an int >= 1 (or None for full attention), got {w!r}")
    scale = options.scale
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number (or None for Dk ** -0.5), got {scale!r}")


def check_packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_tokens: int, layout_name: str) -> None:
    """Shapes of a packed call: q [T, Hq, D], k and v [T, Hkv, D] with Hkv dividing Hq,
    and T the ``num_tokens`` the layout (``layout_name``, for the message) covers."""
    if q.ndim != 3 or k.shape != v.shape or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q [T, Hq, D] and k, v [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.shape[0] != num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows but {layout_name} covers {num_tokens}")
