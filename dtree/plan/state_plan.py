"""Where every segment's recurrent states come from and go: the state stack's slots.

Built from a :class:`~dtree.plan.schedule.Schedule`, host-side, once per step, for models
with recurrent layers (docs/design.md section 4, "the state stack"). A segment's
initial state is its parent segment's final state:

* the parent is in the same group: the op hands the state on inside the call
  (``StateLayout.call_parent``);
* the parent is in an ancestor group: that group stored it in a state-stack slot
  (``read_slot``), which stays on the stack until the group's backward;
* no parent (a tree's root): zeros.

A segment with a child in a later group takes one slot (``push_slot``). The slots of a
group lie right above its parent group's, as its K/V tokens do on the KV stack, so the
state stack holds the slots of the groups on the current path only; the high-water mark
over the walk is the capacity the step needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops.segment_states import StateLayout
from .schedule import Schedule

__all__ = ["StatePlan", "plan_states"]


@dataclass(frozen=True)
class StatePlan:
    """The state slots of one schedule.

    Attributes:
        layouts: per group, its segments' :class:`StateLayout` (read and push slots,
            in-call parents).
        slot_start: [G] the first state slot of each group's pushes.
        num_slots: [G] the group's pushes.
        capacity: the most slots alive at once (the state stack's size).
    """

    layouts: list[StateLayout]
    slot_start: np.ndarray
    num_slots: np.ndarray
    capacity: int


def plan_states(sched: Schedule) -> StatePlan:
    """The state slots of ``sched`` (see the module docstring)."""
    parent = sched.segment_parent
    seg_group = np.full(sched.num_segments, -1, dtype=np.int64)
    seg_local = np.zeros(sched.num_segments, dtype=np.int64)
    for g, plan in enumerate(sched.groups):
        seg_group[plan.segments] = g
        seg_local[plan.segments] = np.arange(plan.num_segments)
    has_parent = parent >= 0
    outside = np.zeros(sched.num_segments, dtype=bool)  # has a child in another group
    kids = np.flatnonzero(has_parent)
    crossing = kids[seg_group[kids] != seg_group[parent[kids]]]
    outside[parent[crossing]] = True

    push_slot = np.full(sched.num_segments, -1, dtype=np.int64)
    slot_start = np.zeros(sched.num_groups, dtype=np.int64)
    num_slots = np.zeros(sched.num_groups, dtype=np.int64)
    for g, plan in enumerate(sched.groups):  # a group's parent group has a smaller id
        start = 0 if plan.parent < 0 else int(slot_start[plan.parent] + num_slots[plan.parent])
        pushing = [s for s in plan.segments if outside[s]]
        slot_start[g], num_slots[g] = start, len(pushing)
        push_slot[pushing] = start + np.arange(len(pushing))

    layouts = []
    for g, plan in enumerate(sched.groups):
        segs = np.asarray(plan.segments, dtype=np.int64)
        p = parent[segs]
        same = (p >= 0) & (seg_group[np.maximum(p, 0)] == g)
        earlier = (p >= 0) & ~same
        layouts.append(
            StateLayout(
                q_offsets=np.asarray(plan.seg_q_offsets, dtype=np.int64),
                call_parent=np.where(same, seg_local[np.maximum(p, 0)], -1),
                read_slot=np.where(earlier, push_slot[np.maximum(p, 0)], -1),
                push_slot=push_slot[segs],
            )
        )
    capacity = int((slot_start + num_slots).max(initial=0))
    return StatePlan(layouts, slot_start, num_slots, capacity)
