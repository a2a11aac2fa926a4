"""Linear recurrences of packed segments, each starting from its parent's state.

One op covers the recurrent token mixers of the hybrid families. Per head, a state
``S`` [K, V] evolves token by token::

    S = S * exp(g_t)                          g_t: [H] per head, or [H, K] per key row
    S = S + k_t^T ((v_t - S^T k_t) * beta_t)  with beta: the (gated) delta rule
    S = S + k_t^T v_t                         without: decayed linear attention
    o_t = scale * S^T q_t

=========================  ==========================  =========================
mixer                      decay ``g``                 ``beta``
=========================  ==========================  =========================
gated DeltaNet (Qwen3.5,   per head                    yes
Qwen3-Next, OLMo-hybrid)
Kimi delta attention       per key row                 yes
Mamba2 SSD (Nemotron-H,    per head (``A * dt``;       no (``k = B``, ``q = C``,
Bamba, Granite, Falcon-H1) ``v = x * dt``)             ``scale = 1``)
Mamba (Jamba)              per key row (one head per   no
                           channel, ``V = 1``)
lightning (MiniMax)        per head, constant          no
=========================  ==========================  =========================

:func:`linear_recurrence` runs the segments of one call (:mod:`dtree.ops.segment_states`):
level by level (a segment after its parent in the same call), each level one varlen
kernel call with a per-segment initial state: zeros at a root, the state stack's slot,
or the in-call parent's final state. Backends (``linear_recurrence`` in
:mod:`dtree.ops.backends`), each ``kernel(q, k, v, g, beta, cu_seqlens, initial,
scale, qk_l2norm) -> (o, final)``:

* ``reference``: :func:`recurrence_reference`, token by token in float32, one segment
  at a time; exactly transformers' recurrent torch path (which its chunked path equals
  to rounding). The CPU path and the test reference.
* ``chunked``: the chunkwise-parallel form in torch (:mod:`dtree.ops.linear_recurrence.chunked`,
  per-head decays; a per-key decay runs the reference). CUDA without fla.
* ``fla``: flash-linear-attention's chunked Triton kernels with ``cu_seqlens`` and
  per-sequence initial states (:mod:`dtree.ops.linear_recurrence.fla_backend`, CUDA,
  ``pip install 'dtree[hybrid]'``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..backends import Backends
from ..segment_states import LayerStates, StateLayout
from . import fla_backend
from .chunked import recurrence_chunked
from .reference import recurrence_reference, state_dtype

__all__ = ["BACKENDS", "linear_recurrence"]


@dataclass(frozen=True)
class _Level:
    """One level of a call's segments (all their in-call parents ran in the level before).

    ``rows`` [n_rows] the call rows of the level's segments in order (None: the whole
    call, a single level); ``cu`` [n+1] their varlen offsets; ``from_stack`` and
    ``in_call`` the positions (in the level) of the segments whose initial state comes
    from the stack or from a parent of the previous level, ``parent_pos`` those parents'
    positions there; ``pushing`` the positions of the segments that store their state."""

    segments: np.ndarray
    rows: np.ndarray | None
    cu: np.ndarray
    from_stack: np.ndarray
    in_call: np.ndarray
    parent_pos: np.ndarray
    pushing: np.ndarray


def _level_plan(layout: StateLayout) -> tuple[list[_Level], np.ndarray | None]:
    """The levels of a call and the inverse of their row order (None for one level);
    built once per call, shared by its layers."""
    levels = layout.levels()
    position = np.zeros(layout.num_segments, dtype=np.int64)
    plan, order = [], []
    for segments in levels:
        position[segments] = np.arange(len(segments))
        lengths = layout.q_offsets[segments + 1] - layout.q_offsets[segments]
        rows = None if len(levels) == 1 else layout.rows_of(segments)
        if rows is not None:
            order.append(rows)
        in_call = np.flatnonzero(layout.call_parent[segments] >= 0)
        plan.append(_Level(
            segments, rows, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            np.flatnonzero(layout.read_slot[segments] >= 0), in_call,
            position[layout.call_parent[segments[in_call]]], np.flatnonzero(layout.push_slot[segments] >= 0),
        ))
    if len(levels) == 1:
        return plan, None
    inverse = np.empty(layout.num_rows, dtype=np.int64)
    inverse[np.concatenate(order)] = np.arange(layout.num_rows)
    return plan, inverse


def _initial_states(
    states: LayerStates, name: str, li: int, level: _Level, previous: torch.Tensor | None, shape, dtype, device
) -> torch.Tensor:
    """[n, *shape] initial states of level ``li``: zeros at roots, the stack's slot, or the
    in-call parent's final state (a row of ``previous``, the last level's final states)."""
    initial = torch.zeros((len(level.segments), *shape), dtype=dtype, device=device)
    index = states.layout.device_index
    if len(level.from_stack):
        read = states.read(name, level.segments[level.from_stack], dtype, device)
        initial = initial.index_copy(0, index(("level_stack", li), lambda: level.from_stack, device), read)
    if len(level.in_call):
        parents = previous.index_select(0, index(("level_parents", li), lambda: level.parent_pos, device))
        initial = initial.index_copy(0, index(("level_in_call", li), lambda: level.in_call, device), parents)
    return initial


def linear_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    states: LayerStates,
    *,
    scale: float,
    qk_l2norm: bool = False,
    name: str = "recurrent",
) -> torch.Tensor:
    """The recurrence of the module docstring over the packed segments of one call.

    Args:
        q, k: [T, Hk, K]; v: [T, H, V]; g: [T, H] or [T, H, K]; beta: [T, H] or None
            (as :func:`recurrence_naive`), rows of ``states.layout``'s segments.
        states: the layer's states; state ``name`` is [H, K, V] (:func:`state_dtype`).

    Returns:
        [T, H, V] in ``v.dtype``."""
    layout = states.layout
    kernel = BACKENDS.function(states.backend)
    heads, shape, dev = v.shape[1], (v.shape[1], k.shape[2], v.shape[2]), v.device
    plan, inverse = layout.cached("recurrence_levels", lambda: _level_plan(layout))
    final, outs = None, []
    for li, level in enumerate(plan):
        initial = _initial_states(states, name, li, level, final, shape, state_dtype(v.dtype), dev)
        inputs = (q, k, v, g, beta)
        if level.rows is not None:
            rows = layout.device_index(("level_rows", li), lambda: level.rows, dev)
            inputs = tuple(None if x is None else x.index_select(0, rows) for x in inputs)
        out, final = kernel(*inputs, level.cu, initial, scale, qk_l2norm)
        if out.shape[1] != heads:
            raise AssertionError(f"backend {states.backend!r} returned {out.shape[1]} heads for {heads}")
        outs.append(out)
        if len(level.pushing):
            pushed = final.index_select(0, layout.device_index(("level_push", li), lambda: level.pushing, dev))
            states.push(name, level.segments[level.pushing], pushed)
    if inverse is not None:
        outs = [torch.cat(outs).index_select(0, layout.device_index("inverse", lambda: inverse, dev))]
    return states.tie(outs[0])


def _recurrence_fla(*args):
    """The ``fla`` backend (:func:`dtree.ops.linear_recurrence.fla_backend.recurrence_fla`)."""
    return fla_backend.recurrence_fla(*args)


BACKENDS = Backends(
    "recurrence",
    {"reference": recurrence_reference, "chunked": recurrence_chunked, "fla": _recurrence_fla},
    {"cuda": ("fla", "chunked"), "other": ("reference",)},
    unavailable={"fla": lambda target: fla_backend.fla_unavailable(target)},
    nondeterministic={"fla": lambda target: fla_backend.fla_nondeterministic(target)},
    option="recurrence",
)
