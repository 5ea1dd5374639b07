"""What the region's status says (:func:`observe`) and when it is worth a write (:func:`decide`).

Both are pure: ``observe`` builds the status from plain values the publisher reads (the serving
nodes' views, counts, the load window, the desired state), and ``decide`` compares the status
about to be written with the one etcd holds.

* a change of what the controller decides on — nodes healthy or total, capacity, each model's
  capacity, the floor honoured, endpoints, residency, geo, the admin state and generation
  acknowledged — is written as soon as the debounce allows (``min_interval_s`` after the
  previous write);
* a move of load alone (queue, in flight, KV use, request rate, error rate, p99 TTFT) by more
  than ``load_change`` of its size, and more than a small absolute step, is written at most every
  ``load_min_interval_s``;
* otherwise the status is rewritten every ``window_s`` as a heartbeat (its ``updated_at`` is how
  the controller sees the figures are fresh);
* after the liveness lease was granted again, or etcd came back, it is written at once
  (``force``): etcd may have lost it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meridian_wire.models import GroupLayout, RegionDesired, RegionLoad, RegionStatus
from policies.model import NodeView
from regional_agent.nodes import capacity_by_model
from regional_agent.publisher.load import WindowLoad
from regional_agent.settings import RegionSettings

# Absolute steps below which a load figure is noise, whatever its relative move.
_LOAD_STEPS: dict[str, float] = {
    "queue_depth": 4,
    "in_flight": 4,
    "kv_util": 0.05,
    "requests_per_s": 1.0,
    "error_rate": 0.02,
    "ttft_p99_s": 0.05,
    "spilled_per_s": 0.1,
}
_STRUCTURE_EXCLUDES = {"load", "updated_at", "agent_id"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """What the status says of the region itself, fixed for the agent's life."""

    region: str
    geo: str
    residency: tuple[str, ...]
    endpoints: tuple[str, ...]
    agent_id: str

    @classmethod
    def of(cls, settings: RegionSettings, *, agent_id: str) -> Identity:
        if settings.id is None or settings.geo is None:
            raise ValueError("the publisher needs region.id and region.geo")
        return cls(
            region=settings.id,
            geo=settings.geo,
            residency=tuple(settings.residency),
            endpoints=tuple(settings.endpoints),
            agent_id=settings.agent_id or agent_id,
        )


def observe(
    *,
    serving: Sequence[NodeView],
    nodes_total: int,
    in_flight: int,
    queue_depth: int,
    identity: Identity,
    window: WindowLoad,
    desired: RegionDesired,
    floor: float,
    wall_now: float,
    layout: GroupLayout | None = None,
    offered: Iterable[str] = (),
) -> RegionStatus:
    """The region's status as the agent sees it now: ``serving`` the views of the nodes that
    serve (active and healthy), ``nodes_total`` every node, ``in_flight`` and ``queue_depth``
    the agent's own requests, ``offered`` the models of every node (a model whose nodes all
    are down is published with capacity 0, so the controller knows it is not served)."""
    known_kv = [v.telemetry.kv_util for v in serving if v.telemetry is not None]
    load = RegionLoad(
        queue_depth=queue_depth,
        in_flight=in_flight,
        kv_util=round(sum(known_kv) / len(known_kv), 4) if known_kv else 0.0,
        requests_per_s=round(window.requests_per_s, 3),
        error_rate=round(window.error_rate, 4),
        ttft_p99_s=None if window.ttft_p99_s is None else round(window.ttft_p99_s, 4),
        spilled_per_s=round(window.spilled_per_s, 3),
    )
    models = {**dict.fromkeys(offered, 0.0), **capacity_by_model(serving)}
    return RegionStatus(
        region=identity.region,
        geo=identity.geo,
        residency=list(identity.residency),
        endpoints=list(identity.endpoints),
        nodes_healthy=len(serving),
        nodes_total=nodes_total,
        capacity=round(sum(v.weight for v in serving), 6),
        capacity_floor=floor,
        models={m: round(c, 6) for m, c in sorted(models.items())},
        load=load,
        admin=desired.admin,
        observed_generation=desired.generation,
        agent_id=identity.agent_id,
        group_layout=layout,
        updated_at=round(wall_now, 3),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """The write pacing, from ``RegionSettings``."""

    window_s: float
    min_interval_s: float
    load_change: float
    load_min_interval_s: float

    @classmethod
    def of(cls, settings: RegionSettings) -> Timing:
        return cls(
            window_s=settings.window_s,
            min_interval_s=settings.min_interval_s,
            load_change=settings.load_change,
            load_min_interval_s=settings.load_min_interval_s,
        )


def decide(
    *,
    written: RegionStatus | None,
    current: RegionStatus,
    since_write_s: float,
    force: str | None,
    timing: Timing,
) -> str | None:
    """Why ``current`` should be written now, or ``None`` to leave etcd alone.

    ``written`` is the last status written (``None``: nothing yet), ``since_write_s`` the time
    since that write, ``force`` a reason to write regardless of change (still debounced)."""
    if written is None:
        return "first status"
    if since_write_s < timing.min_interval_s:
        return None
    if force is not None:
        return force
    changed = structural_changes(written, current)
    if changed:
        return "changed: " + ", ".join(changed)
    if since_write_s >= timing.window_s:
        return "heartbeat"
    if since_write_s >= timing.load_min_interval_s:
        moved = load_moves(written.load, current.load, relative=timing.load_change)
        if moved:
            return "load: " + ", ".join(moved)
    return None


def structural_changes(before: RegionStatus, after: RegionStatus) -> list[str]:
    """``field old→new`` for each field the controller decides on that differs."""
    a = before.model_dump(exclude=_STRUCTURE_EXCLUDES)
    b = after.model_dump(exclude=_STRUCTURE_EXCLUDES)
    return [f"{k} {_short(a[k])}→{_short(b[k])}" for k in b if a.get(k) != b[k]]


def load_moves(before: RegionLoad, after: RegionLoad, *, relative: float) -> list[str]:
    """``field old→new`` for each load figure that moved by more than ``relative`` of its size
    and more than its absolute step (unknown p99 counts as 0)."""
    out = []
    for name, step in _LOAD_STEPS.items():
        old = getattr(before, name)
        new = getattr(after, name)
        x = 0.0 if old is None else float(old)
        y = 0.0 if new is None else float(new)
        if abs(y - x) > max(step, relative * max(abs(x), abs(y))):
            out.append(f"{name} {_short(old)}→{_short(new)}")
    return out


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(_short(v) for v in value) or "-"
    if isinstance(value, Iterable) and not isinstance(value, str):
        return str(list(value))
    return str(value)
