"""Non-negative least squares (Lawson & Hanson, 1974), in numpy.

The cost model's coefficients are times per unit of work (seconds per token, per
node, ...), so they must not be negative: an unconstrained fit on a few noisy
steps happily trades a negative per-node cost against a larger per-token one and
then mispredicts small trees. scipy has ``nnls``; dtree does not depend on scipy,
and the problem here has four columns, so the textbook active-set method is
plenty.
"""

from __future__ import annotations

import numpy as np

__all__ = ["nnls"]


def nnls(
    a: np.ndarray, b: np.ndarray, *, max_iter: int | None = None, tol: float | None = None
) -> tuple[np.ndarray, float]:
    """Solve ``min ||a @ x - b||_2`` subject to ``x >= 0``.

    Args:
        a: [m, n] design matrix.
        b: [m] targets.
        max_iter: bound on outer iterations (default ``3 * n``; the method finishes
            in at most ``n`` additions in exact arithmetic, the slack covers rounding).
        tol: a dual variable above ``tol`` lets its column enter the solution
            (default scales with machine epsilon and the size of ``a``).

    Returns:
        (x [n], residual norm ``||a @ x - b||``).

    The active-set loop: ``passive`` holds the columns allowed to be positive. Add the
    column whose gradient ``a.T @ (b - a @ x)`` is most positive, solve the
    unconstrained least squares on the passive columns, and if that goes negative,
    step back along the segment to the first zero crossing and drop the columns that
    hit zero. Ties pick the lowest column index, so the result is deterministic.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 1 or a.shape[0] != b.shape[0]:
        raise ValueError(f"nnls needs a [m, n] matrix and [m] targets, got {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("nnls inputs must be finite")
    m, n = a.shape
    max_iter = 3 * n if max_iter is None else max_iter
    if tol is None:
        tol = 10 * np.finfo(np.float64).eps * max(m, n) * max(1.0, float(np.abs(a).sum(axis=0).max(initial=0.0)))
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        j = int(np.flatnonzero(candidates)[np.argmax(w[candidates])])  # argmax: first index on ties
        passive[j] = True
        for _inner in range(3 * n + 1):
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(s[passive] > 0):
                break
            # Step from x towards s only as far as every passive coordinate stays >= 0.
            bad = passive & (s <= 0)
            gap = x[bad] - s[bad]  # >= 0 since x >= 0 >= s there
            alpha = float(np.min(np.divide(x[bad], gap, out=np.zeros_like(gap), where=gap > 0)))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        else:  # pragma: no cover - only with a degenerate (rank-deficient, noisy) system
            s = np.where(passive, np.maximum(s, 0.0), 0.0)
        x = s
        w = a.T @ (b - a @ x)
    return x, float(np.linalg.norm(a @ x - b))
