"""Checked arguments of the workload generators (each a ValueError naming the
argument and what it takes) and the random draws they share."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "check_vocab",
    "choices",
    "draw",
    "int_at_least",
    "length_range",
    "lognormal_length",
    "make_rng",
    "positive_float",
    "probability",
]

# Llama-2's vocabulary size; any value works, token ids are only drawn from it.
DEFAULT_VOCAB_SIZE = 32000


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def int_at_least(name: str, value: Any, low: int) -> int:
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def length_range(name: str, value: Any, low: int = 1) -> tuple[int, int]:
    """An int (exact) or an inclusive ``(lo, hi)`` pair, as ``(lo, hi)``."""
    if is_int(value):
        lo = hi = int(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value):
        lo, hi = int(value[0]), int(value[1])
    else:
        raise ValueError(f"{name} must be an int or an inclusive (lo, hi) pair of ints, got {value!r}")
    if lo < low or hi < lo:
        raise ValueError(f"{name} must satisfy {low} <= lo <= hi, got {value!r}")
    return lo, hi


def choices(name: str, value: Any) -> tuple[int, ...]:
    """An int (fixed) or a non-empty sequence of ints >= 1 to draw from uniformly."""
    if is_int(value):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value or not all(is_int(v) and v >= 1 for v in value):
        raise ValueError(f"{name} must be an int >= 1 or a non-empty sequence of ints >= 1, got {value!r}")
    return tuple(int(v) for v in value)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def probability(name: str, value: Any) -> float:
    if not is_real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def positive_float(name: str, value: Any) -> float:
    if not is_real(value) or not (value > 0 and np.isfinite(value)):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


def check_vocab(vocab_size: Any, distinct_needed: int) -> int:
    """Siblings (and trees) need distinct first tokens, so the vocabulary must hold them."""
    vocab_size = int_at_least("vocab_size", vocab_size, 1)
    if vocab_size < distinct_needed:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: this workload needs {distinct_needed} distinct first tokens "
            "(siblings of a branch point and the trees of a batch must start differently)"
        )
    return vocab_size


def draw(rng: np.random.Generator, spec: tuple[int, int], size: int | None = None) -> Any:
    """Uniform integers in the inclusive range ``spec``."""
    return rng.integers(spec[0], spec[1] + 1, size=size)


def lognormal_length(rng: np.random.Generator, spec: tuple[int, int], median: float, sigma: float) -> int:
    """A long-tailed length: lognormal around ``median``, clipped to the inclusive range."""
    if spec[0] == spec[1]:
        return spec[0]
    return int(np.clip(np.rint(rng.lognormal(np.log(median), sigma)), spec[0], spec[1]))


def make_rng(seed: Any) -> np.random.Generator:
    # An explicit int: numpy would also take None, which silently breaks reproducibility.
    return np.random.default_rng(int_at_least("seed", seed, 0))
