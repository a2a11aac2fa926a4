"""Deterministic mode, by torch's convention.

Deterministic mode is on when ``RuntimeConfig(deterministic=True)`` asks for it or when
``torch.use_deterministic_algorithms(True)`` is in force. Then every dtree kernel either
runs in a fixed order (the same bits in every run on the same GPU and software) or raises
a ``RuntimeError`` the way torch's own nondeterministic ops do (a warning instead under
``warn_only=True``). Where dtree's kernels stand:

* stack attention: ``reference`` is deterministic; ``sdpa`` keeps SDPA's forward and, on
  CUDA, differentiates the float32 math in its backward (SDPA's fused backward sums dQ
  with atomics unless torch's own mode is on);
  ``triton`` is deterministic when its backward takes ``deterministic=True`` (prefix
  dK/dV without float atomics), and is otherwise skipped by ``attention="auto"`` and
  refused when named (:func:`alert_nondeterministic`);
* the KV-stack ops (:mod:`dtree.ops.stack_ops`, CUDA extension or torch): no float
  atomics; repeated slots are summed by a fixed-order segmented reduction;
* the LM-head log-prob kernels (:mod:`dtree.ops.logprobs.triton_kernels`): no atomics (every
  output element is written by one program; dW/db are cuBLAS matmuls and reductions);
* recurrent layers (hybrid models, :mod:`dtree.ops.segment_states`): the ``reference``
  recurrence, the state stack and the short convolution are torch ops (gathers whose
  backward adds repeated rows, ``index_add_``, depthwise ``conv1d``) that sum in a fixed
  order on CUDA only under ``torch.use_deterministic_algorithms(True)``: deterministic
  mode on CUDA without it raises (:func:`dtree.plan.backend_choice.pick_recurrence`); ``fla``
  (flash-linear-attention's kernels, not checked for a fixed order) is skipped by
  ``recurrence="auto"`` (which takes ``chunked``, torch ops) and refused when named.

The plan sets the order of the sums as well (call sizes, checkpointed layers, head
chunks): in deterministic mode the planner keeps a forest shape's last plan while it is
predicted to fit (:func:`dtree.plan.step_plan.plan_memory`), so the memory free at the
call does not change the bits.

torch's ops inside the model (matmuls, norms, the embedding backward) follow
``torch.use_deterministic_algorithms``; on one GPU the usual ones are deterministic
already, which ``benchmarks/csrc_gpu.py`` checks on every parameter of a real model.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["alert_nondeterministic", "requested"]


def requested(deterministic: bool = False) -> bool:
    """Whether deterministic mode is on: asked for here, or torch's global setting."""
    return bool(deterministic) or torch.are_deterministic_algorithms_enabled()


def alert_nondeterministic(what: str, fix: str) -> None:
    """Raise (or, under torch's ``warn_only=True``, warn) that ``what`` has no
    deterministic implementation, as torch does for its own ops; ``fix`` says what to
    use instead."""
    message = (
        f"{what} does not have a deterministic implementation, but deterministic mode is on "
        f"(RuntimeConfig(deterministic=True) or torch.use_deterministic_algorithms(True)); {fix}"
    )
    if torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, stacklevel=3)
        return
    raise RuntimeError(message)
