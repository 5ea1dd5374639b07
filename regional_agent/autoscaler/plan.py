"""The scaling decision of an actuator that runs nodes itself (the simulator actuator): pure,
no I/O, no clock (``now`` is passed in).

Up fast, down slow:

* below the floor, start as many nodes as the deficit needs (``ceil(deficit / node_weight)``),
  within what the actuator may still bring (``room``);
* above it, stop one of the actuator's own nodes only when capacity without that node still
  meets the floor, and has for ``scale_down_delay_s`` without a break; then wait that long again
  before the next one.  Nodes the actuator did not start are never its to stop.

Per model (``regions/<r>/desired``'s ``model_floors``, what the region keeps warm for the
regions whose backup it is for that model): a :class:`ModelNeed` says how far the capacity of
the nodes serving a model is below its floor.  An actuator whose nodes serve a fixed set of
models (``autoscaler.models``) is handed the region floor :func:`raised` to cover each of those
models' shortfall; the simulator actuator starts nodes of the short model itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EPSILON = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    kind: str  # start, stop, short (below the floor, no room), met, excess (waiting to stop)
    start: int = 0  # nodes to bring (undrain own draining nodes first, then start new ones)
    stop: int = 0  # own nodes to drain and stop: 0 or 1
    excess_since: float | None = None  # since when capacity has exceeded the floor by a node
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelNeed:
    """One model's floor and the capacity of the serving nodes that serve it."""

    model: str
    floor: float
    current: float

    @property
    def short(self) -> float:
        """How much capacity the model lacks (0 when its floor is met)."""
        return max(0.0, self.floor - self.current)


def needs(floors: dict[str, float], current: dict[str, float]) -> tuple[ModelNeed, ...]:
    """Each model with a floor above 0, in name order, with its current capacity."""
    return tuple(
        ModelNeed(model=m, floor=f, current=round(current.get(m, 0.0), 6))
        for m, f in sorted(floors.items())
        if f > 0
    )


def raised(
    *, floor: float, current: float, models: tuple[ModelNeed, ...], serves: frozenset[str]
) -> tuple[float, tuple[str, ...]]:
    """The region floor raised so that the nodes an actuator brings, which serve ``serves``
    (empty: every model the region serves), make up each such model's shortfall; and the models
    short that those nodes cannot serve, so that no floor raise helps them."""
    covered = [n.short for n in models if not serves or n.model in serves]
    unmet = tuple(n.model for n in models if n.short > EPSILON and serves and n.model not in serves)
    short = max(covered, default=0.0)
    return (max(floor, current + short) if short > EPSILON else floor), unmet


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
    if deficit > EPSILON:
        want = max(1, math.ceil(deficit / node_weight - EPSILON))
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
    if victim_weight is None or current - victim_weight < floor - EPSILON:
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
