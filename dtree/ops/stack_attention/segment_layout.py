"""SegmentLayout: where the query segments of one stack-attention call read K/V from.

Host tables (numpy) built by the runtime once per call, shared by every layer, plus
the derived tables the backends build from them (device copies, the fused kernel's
work items), memoized on the layout through :meth:`SegmentLayout.cached` so that a
call's layers build each one once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple, TypeVar

import numpy as np
import torch

from ...device.transfer import upload

__all__ = ["Run", "SegmentLayout"]

T = TypeVar("T")


class Run(NamedTuple):
    """Consecutive non-empty segments with identical prefix ranges (siblings: a GRPO
    group's answers, the children of one tool call): rows ``[row_lo, row_hi)``, their
    ``ranges`` ((lo, hi) stack slots, root first) and the index of the first segment."""

    row_lo: int
    row_hi: int
    ranges: tuple[tuple[int, int], ...]
    segment: int


@dataclass
class SegmentLayout:
    """Where the query segments of one call read K/V from.

    Attributes:
        q_offsets: [S+1] row offsets of the segments in the call.
        own_slot: [S] stack slot of each segment's first own token.
        prefix_ranges: per segment, ancestor slot ranges ``((lo, hi), ...)``, root first.
        call_slots: ``(lo, hi)``, the call's own stack slots, when some of its segments
            have ancestors in the same call (their slots are then inside prefix
            ranges, so the backward adds gradients into them: pass the call's
            ``k, v`` through :func:`dtree.ops.stack_attention.seed_from_stack` to get
            them back); None otherwise.

    The attributes are not changed after construction: derived tables are memoized.
    """

    q_offsets: np.ndarray
    own_slot: np.ndarray
    prefix_ranges: list[tuple[tuple[int, int], ...]]
    call_slots: tuple[int, int] | None = None
    _derived: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_segments(self) -> int:
        return len(self.own_slot)

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, called once per ``key`` for this layout (a backend's derived
        table: ``key`` names the backend, the device and whatever else the table depends
        on)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def runs(self) -> list[Run]:
        """The call's runs (see :class:`Run`) in row order; they tile its rows."""
        return self.cached(("runs",), self._build_runs)

    def _build_runs(self) -> list[Run]:
        q_off = np.asarray(self.q_offsets, dtype=np.int64)
        runs: list[Run] = []
        for i in np.flatnonzero(np.diff(q_off)):
            ranges = tuple((int(lo), int(hi)) for lo, hi in self.prefix_ranges[i])
            if runs and ranges == runs[-1].ranges:
                runs[-1] = runs[-1]._replace(row_hi=int(q_off[i + 1]))
            else:
                runs.append(Run(int(q_off[i]), int(q_off[i + 1]), ranges, int(i)))
        return runs

    def prefix_index(self, i: int, device: torch.device) -> slice | torch.Tensor | None:
        """Stack slots of segment ``i``'s prefix: a slice when contiguous, else a
        LongTensor; None when the segment has no ancestors."""
        ranges = self.prefix_ranges[i]
        if not ranges:
            return None
        if len(ranges) == 1:
            return slice(ranges[0][0], ranges[0][1])
        return self.cached(
            ("prefix_index", i, device),
            lambda: upload(np.concatenate([np.arange(lo, hi) for lo, hi in ranges]), device),
        )

    def device_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """int32 tables for fused kernels: ``q_offsets [S+1]``, ``own_slot [S]``,
        ``range_offsets [S+1]`` into ``range_lo/range_hi [R]``."""
        return self.cached(("tables", device), lambda: self._build_device_tables(device))

    def _build_device_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        counts = [len(r) for r in self.prefix_ranges]
        offs = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offs[1:])
        flat = [p for r in self.prefix_ranges for p in r] or [(0, 0)]
        lo = np.array([p[0] for p in flat], dtype=np.int64)
        hi = np.array([p[1] for p in flat], dtype=np.int64)
        # one upload for all five tables: one host-to-device copy per call
        packed = np.concatenate([self.q_offsets, self.own_slot, offs, lo, hi]).astype(np.int32)
        t = upload(packed, device)
        s = self.num_segments
        cuts = np.cumsum([s + 1, s, s + 1, len(lo)])
        return {
            "q_offsets": t[: cuts[0]],
            "own_slot": t[cuts[0] : cuts[1]],
            "range_offsets": t[cuts[1] : cuts[2]],
            "range_lo": t[cuts[2] : cuts[3]],
            "range_hi": t[cuts[3] :],
        }
