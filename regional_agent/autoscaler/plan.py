"""The scaling decision of an actuator that runs nodes itself (the simulator actuator): pure,
no I/O, no clock (``now`` is passed in).

Up fast, down slow:

* below the floor, start as many nodes as the deficit needs (``ceil(deficit / node_weight)``),
  within what the actuator may still bring (``room``);
* above it, stop one of the actuator's own nodes only when capacity without that node still
  meets the floor, and has for ``scale_down_delay_s`` without a break; then wait that long again
  before the next one.  Nodes the actuator did not start are never its to stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_EPSILON = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    kind: str  # start, stop, short (below the floor, no room), met, excess (waiting to stop)
    start: int = 0  # nodes to bring (undrain own draining nodes first, then start new ones)
    stop: int = 0  # own nodes to drain and stop: 0 or 1
    excess_since: float | None = None  # since when capacity has exceeded the floor by a node
    reason: str


def step(
    *,
    floor: float,
    current: float,
    node_weight: float,
    room: int,
    victim_weight: float | None,
    excess_since: float | None,
    now: float,
    scale_down_delay_s: float,
) -> Step:
    """What to do now.

    ``current`` is the region's healthy capacity; ``room`` how many nodes the actuator may still
    bring; ``victim_weight`` what the own node it would stop next adds to ``current`` (0 when
    that node is not healthy; ``None`` when it runs none)."""
    deficit = floor - current
    if deficit > _EPSILON:
        want = max(1, math.ceil(deficit / node_weight - _EPSILON))
        n = min(want, max(0, room))
        if n == 0:
            return Step(
                kind="short",
                reason=f"capacity {current:g} below floor {floor:g} and no room for another node",
            )
        return Step(
            kind="start",
            start=n,
            reason=f"capacity {current:g} below floor {floor:g}: bringing {n} node(s)",
        )
    if victim_weight is None or current - victim_weight < floor - _EPSILON:
        return Step(kind="met", reason=f"capacity {current:g} meets floor {floor:g}")
    since = now if excess_since is None else excess_since
    if now - since >= scale_down_delay_s:
        return Step(
            kind="stop",
            stop=1,
            excess_since=now,
            reason=f"capacity {current:g} meets floor {floor:g} without a node for "
            f"{now - since:.0f} s: stopping one",
        )
    return Step(
        kind="excess",
        excess_since=since,
        reason=f"capacity {current:g} meets floor {floor:g} without a node: waiting "
        f"{scale_down_delay_s:g} s before stopping one",
    )
