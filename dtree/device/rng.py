"""Random-number state for exact replay of dropout (and any other random op).

dtree runs some model code twice: a recomputed group (forward without grad, again with
grad at pop time) and an LM-head chunk (forward, then again in backward). Both runs
must draw the same dropout masks, or the gradient is that of a different network than
the one whose K/V the descendants read. That is what ``torch.utils.checkpoint`` does
with ``preserve_rng_state=True``; the helpers here do the same for the CPU generator
and the CUDA generator of the model's device.

``seeded`` gives each model call its own generator state, seeded from one draw of the
global CPU generator. Every mode then consumes exactly one draw per group forward, so
retain, recompute and auto draw identical masks under the same ``torch.manual_seed``,
whatever else (the LM head) a mode runs or skips at forward time.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["RngState", "capture", "restore", "rewound", "replaying", "next_seed", "seeded"]

RngState = tuple[torch.Tensor, torch.Tensor | None]  # (CPU state, CUDA state of the device or None)


def capture(device: torch.device) -> RngState:
    """The CPU generator's state, and the CUDA generator's of ``device`` when it is one."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore(state: RngState, device: torch.device) -> None:
    """Set the generators back to ``state`` (a :func:`capture`)."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextlib.contextmanager
def rewound(device: torch.device) -> Iterator[None]:
    """Whatever the block draws, the generators are as before it afterwards (the CPU
    generator, and ``device``'s CUDA generator when it is one)."""
    saved = capture(device)
    try:
        yield
    finally:
        restore(saved, device)


@contextlib.contextmanager
def replaying(state: RngState | None, device: torch.device) -> Iterator[None]:
    """Run the block from ``state`` (a :func:`capture`), leaving the generators as they
    were before the block. ``None``: no-op."""
    if state is None:
        yield
        return
    with rewound(device):
        restore(state, device)
        yield


def next_seed() -> int:
    """One draw from the global CPU generator: the seed of one model call."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Run the block with the CPU generator (and ``device``'s CUDA generator) seeded
    with ``seed``, restoring both afterwards. ``None``: no-op."""
    if seed is None:
        yield
        return
    with rewound(device):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield
