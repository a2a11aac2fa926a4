"""Deterministic mode, by torch's convention.

Deterministic mode is on when ``RuntimeConfig(deterministic=True)`` asks for it or when
``torch.use_deterministic_algorithms(True)`` is in force. Then every dtree kernel either
runs in a fixed order (the same bits in every run on the same GPU and software) or raises
a ``RuntimeError`` the way torch's own nondeterministic ops do (a warning instead under
``warn_only=True``). Where dtree's kernels stand:

* stack attention: ``reference`` is deterministic; ``sdpa`` runs torch's SDPA backward
  under torch's deterministic mode (:func:`torch_deterministic`, for that call only);
  ``triton`` is deterministic when its backward takes ``deterministic=True`` (prefix
  dK/dV without float atomics), and is otherwise skipped by ``attention="auto"`` and
  refused when named (:func:`alert_nondeterministic`);
* the KV-stack ops (:mod:`dtree.ops.stack_ops`, CUDA extension or torch): no float
  atomics; repeated slots are summed by a fixed-order segmented reduction;
* the LM-head log-prob kernels (:mod:`dtree.ops.logprobs_triton`): no atomics (every
  output element is written by one program; dW/db are cuBLAS matmuls and reductions).

torch's ops inside the model (matmuls, norms, the embedding backward) follow
``torch.use_deterministic_algorithms``; on one GPU the usual ones are deterministic
already, which ``benchmarks/csrc_gpu.py`` checks on every parameter of a real model.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

__all__ = ["alert_nondeterministic", "requested", "torch_deterministic"]


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


@contextlib.contextmanager
def torch_deterministic(enabled: bool = True):
    """torch's deterministic algorithms inside (strict), switched off again after: how
    dtree makes the torch kernels it calls itself (SDPA's backward) follow its own
    deterministic mode without changing anything outside the call. Where the user has
    set torch's mode (strict or ``warn_only``), that setting stands."""
    if not enabled or torch.are_deterministic_algorithms_enabled():  # the user's own setting stands
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
