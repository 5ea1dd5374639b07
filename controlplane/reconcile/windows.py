"""The health-window loop: every window, judge every region and apply the plan, fenced.

One pass (``reconcile_once``) is level-based: it reads the whole fleet from etcd (liveness keys,
statuses, operators' overrides, the previous plan), calls ``policies.failover.plan`` and writes,
in one transaction guarded by the leader key, every region's judged health and desired state
(weight, capacity floor) and the new plan, then the events.  Only values that changed are
written.  A new leader continues from the stored plan, so killing the leader changes nothing.

Fail static: when etcd is unreachable the pass raises ``meridian_etcd.Unavailable`` and nothing
changes; the runner tries again and converges when etcd is back.

The failover policy's knobs come from the settings, overridden by what an admin stored under
``controller/policies`` through the admin API (``controlplane.failover_policy``, read every pass:
applied from the next window).
The admin API also uses ``prepare`` to show an action's plan (a dry run, with the operator's
override applied) and commits it with ``commit``; ``pass_lock`` keeps one pass at a time.
Both may hand ``commit`` an ``on_commit`` hook, called with each pass once it is written (the
replica's metrics count its failovers and recoveries there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import meridian_etcd as etcd
from controlplane import failover_policy
from controlplane.reconcile import fleet
from controlplane.settings import ControllerSettings
from meridian_service.clock import Clock
from meridian_wire import keys
from meridian_wire.models import (
    Event,
    FleetPlan,
    RegionDesired,
    RegionHealth,
    RegionOverride,
    RegionStatus,
)
from policies import failover, probing
from policies.failover import RegionId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PassResult:
    window: int
    writes: int
    events: int
    alert: str | None
    recheck_after_s: float


def _age(
    region: str, status: RegionStatus | None, *, now: float, freshness: Freshness | None
) -> float | None:
    if status is None:
        return None
    wall_age_s = max(0.0, now - status.updated_at)
    if freshness is None:
        return wall_age_s
    return freshness.age_s(region, updated_at=status.updated_at, wall_age_s=wall_age_s)


def topology_from(
    settings: ControllerSettings,
    statuses: Mapping[str, RegionStatus],
    measured: Mapping[tuple[str, str], float] | None = None,
) -> failover.Topology:
    """Configured regions, plus regions known only from their agents' statuses; the round
    trips of ``latency_ms``, and where it says nothing of a pair, those ``measured`` by the
    probes."""
    infos: dict[str, failover.RegionInfo] = {}
    for r in settings.regions:
        coordinates = (r.lat, r.lon) if r.lat is not None and r.lon is not None else None
        infos[r.id] = failover.RegionInfo(
            region=RegionId(r.id),
            geo=r.geo,
            residency=frozenset(r.residency),
            backups=tuple(RegionId(b) for b in r.backups),
            coordinates=coordinates,
        )
    for region, status in statuses.items():
        if region not in infos:
            infos[region] = failover.RegionInfo(
                region=RegionId(region), geo=status.geo, residency=frozenset(status.residency)
            )
    configured = {
        (RegionId(a), RegionId(b)): ms
        for a, row in settings.latency_ms.items()
        for b, ms in row.items()
    }
    latency = {
        (RegionId(a), RegionId(b)): ms
        for (a, b), ms in (measured or {}).items()
        if a in infos and b in infos
        and (RegionId(a), RegionId(b)) not in configured
        and (RegionId(b), RegionId(a)) not in configured
    }  # fmt: skip
    latency.update(configured)
    return failover.Topology.build(infos.values(), latency)


_LOCKS: weakref.WeakKeyDictionary[etcd.Store, asyncio.Lock] = weakref.WeakKeyDictionary()


def pass_lock(store: etcd.Store) -> asyncio.Lock:
    """One pass (or admin action) at a time per store, so none overwrites another's plan."""
    lock = _LOCKS.get(store)
    if lock is None:
        lock = _LOCKS[store] = asyncio.Lock()
    return lock


def _snapshot(status: RegionStatus) -> failover.StatusSnapshot:
    return failover.StatusSnapshot(
        nodes_healthy=status.nodes_healthy,
        nodes_total=status.nodes_total,
        capacity=status.capacity,
        error_rate=status.load.error_rate,
        ttft_p99_s=status.load.ttft_p99_s,
        kv_util=status.load.kv_util,
        queue_depth=status.load.queue_depth,
        in_flight=status.load.in_flight,
        models=status.models,
        spilled_per_s=status.load.spilled_per_s,
    )


# -- the policy's state, as JSON in controller/plan -----------------------------------------------


def state_to_json(state: failover.FleetState) -> dict[str, Any]:
    return {
        "verdicts": {r: dataclasses.asdict(v) for r, v in state.verdicts.items()},
        "window": state.window,
        "serving": {g: dict(shares) for g, shares in state.serving.items()},
        "alert": state.alert,
    }


def state_from_json(data: Mapping[str, Any]) -> failover.FleetState:
    if not data:
        return failover.FleetState()
    verdicts = {}
    for region, v in data.get("verdicts", {}).items():
        v = dict(v)
        v["region"] = RegionId(v["region"])
        v["protects"] = tuple(RegionId(p) for p in v.get("protects", ()))
        v["backup"] = RegionId(v["backup"]) if v.get("backup") else None
        v["serving_models"] = tuple((m, float(c)) for m, c in v.get("serving_models", ()))
        v["model_backups"] = tuple(
            (m, RegionId(b) if b else None) for m, b in v.get("model_backups", ())
        )
        v["model_floors"] = tuple((m, float(f)) for m, f in v.get("model_floors", ()))
        v["ignored_models"] = tuple(v.get("ignored_models", ()))
        verdicts[RegionId(region)] = failover.Verdict(**v)
    return failover.FleetState(
        verdicts=verdicts,
        window=int(data.get("window", 0)),
        serving={
            g: {RegionId(r): float(s) for r, s in shares.items()}
            for g, shares in data.get("serving", {}).items()
        },
        alert=data.get("alert"),
    )


# -- one pass -------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Prepared:
    """One pass computed but not written: what ``commit`` writes, and what it decided."""

    view: fleet.FleetView
    previous: failover.FleetState
    result: failover.Plan
    topology: failover.Topology
    puts: dict[str, bytes] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


class Freshness:
    """How long each region's status has stood unchanged, by this replica's own monotonic
    clock: the status age a pass judges is the smaller of this and ``now - updated_at``.

    ``updated_at`` is the agent's wall clock and ``now`` the controller's: a clock step on
    either host (NTP correcting a drifted VM, a leap) makes every status look stale or fresh at
    once.  A status that keeps changing is fresh whatever the clocks say; one that stopped
    changing ages at the rate of this replica's monotonic clock, which never steps.  A replica
    that just started leading has seen nothing yet, so it reads every status as fresh for up to
    ``status_stale_s`` (its first pass judges nothing anyway)."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._seen: dict[str, tuple[float, float]] = {}  # region -> (updated_at, first seen)

    def age_s(self, region: str, *, updated_at: float, wall_age_s: float) -> float:
        now = self._monotonic()
        seen = self._seen.get(region)
        if seen is None or seen[0] != updated_at:
            self._seen[region] = (updated_at, now)
            return 0.0  # it changed since the last look (or this replica never saw it)
        return min(wall_age_s, now - seen[1])


async def reconcile_once(
    *,
    store: etcd.Store,
    fence: etcd.Fence | None,
    settings: ControllerSettings,
    clock: Clock,
    judge: bool = True,
    freshness: Freshness | None = None,
    on_commit: Callable[[Prepared], None] | None = None,
) -> PassResult:
    controller = fence.value.decode() if fence is not None else ""
    async with pass_lock(store):
        prepared = await prepare(
            store=store, settings=settings, clock=clock, judge=judge, controller=controller,
            freshness=freshness,
        )  # fmt: skip
        return await commit(
            prepared, store=store, fence=fence, settings=settings, on_commit=on_commit
        )


async def prepare(
    *,
    store: etcd.Store,
    settings: ControllerSettings,
    clock: Clock,
    judge: bool = True,
    overrides: Mapping[str, RegionOverride | None] | None = None,
    controller: str = "",
    freshness: Freshness | None = None,
) -> Prepared:
    """Read the fleet and plan, writing nothing.  ``overrides`` replaces regions' operator
    overrides (``None``: cleared) as if they were stored: the plan of an admin action.
    ``freshness``: the window loop's memory of when each status last changed (``None``: judge
    ages by the wall clocks alone)."""
    now = clock.now()
    view = await fleet.read(store)
    for region, replaced in (overrides or {}).items():
        view.regions.setdefault(region, fleet.RegionRecord(region=region)).override = replaced
    stored = await failover_policy.stored(store)
    last_status = dict(view.plan.last_status)
    for region, record in view.regions.items():
        if record.status is not None:
            last_status[region] = record.status
    statuses = {
        r: s
        for r, s in last_status.items()
        if r in view.regions or r in {c.id for c in settings.regions}
    }
    measured = fleet.measured_latency(view, now=now, max_age_s=settings.probe.vote_age_s)
    topology = topology_from(settings, statuses, measured)
    observations = []
    reaches: dict[str, probing.Reach] = {}
    for region in topology.regions:
        record = view.regions.get(region) or fleet.RegionRecord(region=region)
        # a malformed status this window: judge on the last valid one (ignored, not missing)
        status = record.status or (last_status.get(region) if record.status_bad else None)
        override = record.override
        target = override.target if override is not None and override.failover else None
        reach = None
        if status is not None and view.probes:
            reach = fleet.reach(
                view, region, status.endpoints, now=now, max_age_s=settings.probe.vote_age_s
            )
            if reach is not None:
                reaches[region] = reach
        observations.append(
            failover.Observation(
                region=RegionId(region),
                alive=record.alive,
                status=_snapshot(status) if status is not None else None,
                status_age_s=_age(region, status, now=now, freshness=freshness),
                admin=override.admin if override is not None else "active",
                manual_failover=bool(override is not None and override.failover),
                failover_target=RegionId(target) if target and target in topology.regions else None,
                reach=reach,
            )
        )
    previous = state_from_json(view.plan.state)
    result = failover.plan(
        previous,
        observations,
        topology=topology,
        config=failover_policy.config_from(settings, stored.values if stored is not None else None),
        now=now,
        judge=judge,
    )
    state = result.state
    puts: dict[str, bytes] = {}
    for region, verdict in state.verdicts.items():
        known = view.regions.get(region)
        override = known.override if known is not None else None
        health = RegionHealth(
            state=verdict.state,
            strikes=verdict.strikes,
            good_windows=verdict.good_windows,
            since=verdict.since,
            reason=verdict.reason,
            weight=verdict.weight,
            backup=verdict.backup,
            backup_reason=verdict.backup_reason,
            model_backups=dict(verdict.model_backups),
            manual=verdict.manual,
            window=state.window,
        )
        desired = RegionDesired(
            admin=override.admin if override is not None else "active",
            weight=verdict.weight,
            capacity_floor=round(verdict.capacity_floor, 6),
            protects=list(verdict.protects),
            model_floors=dict(verdict.model_floors),
            reason=verdict.backup_reason if verdict.protects else verdict.reason,
            generation=state.window,
        )
        old_health = known.health if known is not None else None
        # the window counter and a healthy region's growing run of good windows change every
        # window; they are refreshed when something else changes (the plan key has them all)
        volatile = {"window", "good_windows"}
        if old_health is None or old_health.model_dump(exclude=volatile) != health.model_dump(
            exclude=volatile
        ):
            puts[keys.health(region)] = health.model_dump_json().encode()
        old_desired = known.desired if known is not None else None
        if old_desired is None or old_desired.model_dump(
            exclude={"generation"}
        ) != desired.model_dump(exclude={"generation"}):
            puts[keys.desired(region)] = desired.model_dump_json().encode()
    plan_value = FleetPlan(
        window=state.window,
        serving={
            g: {r: round(s, 6) for r, s in shares.items()} for g, shares in state.serving.items()
        },
        alert=state.alert,
        state=state_to_json(state),
        last_status=statuses,
        unreachable=sorted(r for r, reach in reaches.items() if reach.unreachable),
        measured_latency_ms=_rows(measured),
        updated_at=now,
        controller=controller,
    )
    puts[keys.PLAN] = plan_value.model_dump_json().encode()
    events = [
        Event(
            at=e.at,
            kind=e.kind,
            region=e.region,
            reason=e.reason,
            data={k: list(v) if isinstance(v, tuple) else v for k, v in e.data.items()},
            controller=plan_value.controller,
        )
        for e in result.events
    ]
    events += _probe_events(view.plan.unreachable, reaches, now=now, controller=controller)
    for event in events:
        puts[keys.event(int(event.at * 1000), uuid.uuid4().hex[:8])] = (
            event.model_dump_json().encode()
        )
    return Prepared(
        view=view, previous=previous, result=result, topology=topology, puts=puts, events=events
    )


def _rows(pairs: Mapping[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (a, b), ms in sorted(pairs.items()):
        out.setdefault(a, {})[b] = ms
    return out


def _probe_events(
    before: list[str], reaches: Mapping[str, probing.Reach], *, now: float, controller: str
) -> list[Event]:
    """A ``probe`` event for each region the replicas' probes find unreachable, or reachable
    again, since the last pass."""
    out = []
    for region in sorted(set(before) | set(reaches)):
        reach = reaches.get(region)
        was, now_unreachable = region in before, reach is not None and reach.unreachable
        if was == now_unreachable:
            continue
        reason = "no replica probes it any more" if reach is None else reach.reason
        data: dict[str, object] = {"unreachable": now_unreachable}
        if reach is not None:
            data |= {"reached": list(reach.reached), "failed": list(reach.failed)}
        out.append(
            Event(
                at=now, kind="probe", region=region, reason=reason, data=data,
                controller=controller,
            )
        )  # fmt: skip
    return out


async def commit(
    prepared: Prepared,
    *,
    store: etcd.Store,
    fence: etcd.Fence | None,
    settings: ControllerSettings,
    extra_puts: Mapping[str, bytes] | None = None,
    deletes: tuple[str, ...] = (),
    on_commit: Callable[[Prepared], None] | None = None,
) -> PassResult:
    """Write a prepared pass (plus ``extra_puts``/``deletes``), fenced; then
    ``on_commit(prepared)``.

    One transaction when it fits in ``etcd.max_txn_ops`` (etcd refuses a bigger one: a fleet
    of 60 regions writes 300 keys in its first pass).  Otherwise the regions' health and
    desired keys and the events go first, in as many fenced transactions as they need, and the
    plan with ``extra_puts`` and ``deletes`` (an admin action's override and audit) last, so a
    plan is never stored before the keys it describes.  A replica fenced off half-way leaves
    some regions' keys newer than the plan; the next leader's first pass rewrites whatever
    differs from its own plan."""
    puts = {**prepared.puts, **(extra_puts or {})}
    last = {k: v for k, v in puts.items() if k == keys.PLAN or k in (extra_puts or {})}
    rest = [(k, v) for k, v in puts.items() if k not in last]
    await store.commit_batches(puts=rest, deletes=deletes, fence=fence, last=last)
    if on_commit is not None:
        on_commit(prepared)
    state, result = prepared.result.state, prepared.result
    for event in prepared.events:
        level = (
            logging.WARNING
            if event.kind in ("state", "failover", "alert", "residency", "probe", "model")
            else logging.INFO
        )
        log.log(
            level,
            "event kind=%s region=%s reason=%s data=%s",
            event.kind, event.region or "-", event.reason, json.dumps(event.data, sort_keys=True),
        )  # fmt: skip
    await _prune_events(store, fence=fence, retention=settings.events.retention)
    return PassResult(
        window=state.window,
        writes=len(puts),
        events=len(prepared.events),
        alert=state.alert,
        recheck_after_s=result.recheck_after_s,
    )


async def _prune_events(store: etcd.Store, *, fence: etcd.Fence | None, retention: int) -> None:
    entries = sorted((await store.get_prefix(keys.EVENTS)).entries, key=lambda e: e.key)
    if len(entries) <= retention:
        return
    old = [e.key for e in entries[: len(entries) - retention]]
    await store.commit_batches(deletes=old, fence=fence)
