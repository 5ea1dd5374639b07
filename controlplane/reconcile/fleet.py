"""Read the fleet's whole state from etcd, validating every value.

A value that does not validate (written by hand or by an older agent) is reported with its key
and left out for this window — it never crashes the controller.

Several agents per region
    Each agent replica publishes ``regions/<r>/agents/<a>/alive`` and ``.../status`` under its
    own lease.  A region is alive when any of its agents is; its status is
    :func:`combine` of its live agents' statuses (of all its agents' when none is alive).  The
    single keys ``regions/<r>/alive`` and ``regions/<r>/status`` of older agents are read as one
    more agent, ``LEGACY_AGENT``, so a rolling upgrade needs no flag day.

Group tables
    ``routing/<r>/groups/<kind>-<first>`` (docs/group-tables.md) are read into
    :class:`TableView` per region and kind: ranges that do not validate, do not fit the table,
    or name a group that none of the region's agents reports (``RegionStatus.group_layout``)
    are reported as bad values and ignored, so a region's sessions are never seen as served by
    another region's GPUs.

Probe reports
    ``controller/probes/<replica>`` is each controller replica's last probe round of the
    regions' published endpoints (``controlplane.probing``); :func:`reach` tallies them for a
    region (``policies.probing``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pydantic

import meridian_etcd as etcd
from controlplane.errors import BadValue
from meridian_wire import keys
from meridian_wire.models import (
    FleetPlan,
    GroupTable,
    ProbeReport,
    RegionDesired,
    RegionHealth,
    RegionLoad,
    RegionOverride,
    RegionStatus,
)
from policies import groups, probing

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)


LEGACY_AGENT = ""  # the agent behind the single-agent keys regions/<r>/alive and /status


@dataclass(slots=True, kw_only=True)
class AgentRecord:
    agent: str
    alive: bool = False
    status: RegionStatus | None = None
    status_bad: bool = False  # a status exists but does not validate


@dataclass(slots=True, kw_only=True)
class TableView:
    """One of a region's group tables as stored: the valid ranges, painted over the assignment
    of the groups its agents report when they report them."""

    kind: str
    entries: int = 0  # valid stored ranges
    buckets: dict[str, int] = field(default_factory=dict)  # group -> buckets it serves
    n_buckets: int = 0
    newest_at: float | None = None  # updated_at of the newest valid range
    oldest_at: float | None = None
    agents: list[str] = field(default_factory=list)  # agents that wrote its ranges


@dataclass(slots=True, kw_only=True)
class RegionRecord:
    region: str
    alive: bool = False  # any agent alive
    status: RegionStatus | None = None  # combined from the agents' statuses
    status_bad: bool = False  # a status exists but none validates
    desired: RegionDesired | None = None
    health: RegionHealth | None = None
    override: RegionOverride | None = None
    agents: dict[str, AgentRecord] = field(default_factory=dict)
    tables: dict[str, TableView] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class FleetView:
    regions: dict[str, RegionRecord] = field(default_factory=dict)
    plan: FleetPlan = field(default_factory=FleetPlan)
    probes: dict[str, ProbeReport] = field(default_factory=dict)  # replica -> its last round
    bad: list[BadValue] = field(default_factory=list)


def parse(entry: etcd.Entry, model: type[M], bad: list[BadValue]) -> M | None:
    try:  # parsed and validated in one step by pydantic (a 500-region pass parses 6,000 keys)
        return model.model_validate_json(entry.value)
    except pydantic.ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            bad.append(BadValue(entry.key, f"not JSON: {exc.errors()[0]['msg']}"))
            return None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
        )
        bad.append(BadValue(entry.key, f"invalid {model.__name__}: {problems}"))
    return None


def _agent_status(entry: etcd.Entry, region: str, agent: AgentRecord, bad: list[BadValue]) -> None:
    agent.status = parse(entry, RegionStatus, bad)
    if agent.status is not None and agent.status.region != region:
        bad.append(BadValue(entry.key, f"names region {agent.status.region!r}, not {region!r}"))
        agent.status = None
    agent.status_bad = agent.status is None


def combine(statuses: list[RegionStatus]) -> RegionStatus:
    """One region status from the statuses of several agents of the region.

    The agents of a region front the same nodes, each with its own view of them and its own
    share of the traffic, so:

    * nodes healthy and total, capacity, each model's capacity, KV use: the largest any agent
      reports (they count the same nodes; a node one agent cannot reach is still served by
      the others);
    * queue depth, requests in flight, requests/s: summed (each agent's own requests);
    * error rate: the mean weighted by requests/s (the plain mean when none moves);
    * p99 TTFT: the largest (the p99 of a union is at most the largest p99);
    * geo, residency, endpoints, floor and admin state: from the freshest status, endpoints
      merged; ``observed_generation`` is the smallest (what every agent has applied);
    * ``updated_at``: the freshest; ``agent_id``: every agent, comma-separated;
    * ``group_layout``: the groups of every agent merged (largest weight), table parameters
      from the freshest status that has a layout.
    """
    if not statuses:
        raise ValueError("combine needs at least one status")
    ordered = sorted(statuses, key=lambda s: s.updated_at)
    fresh = ordered[-1]
    if len(ordered) == 1:
        return fresh
    rps = sum(s.load.requests_per_s for s in ordered)
    error_rate = (
        sum(s.load.error_rate * s.load.requests_per_s for s in ordered) / rps
        if rps > 0
        else sum(s.load.error_rate for s in ordered) / len(ordered)
    )
    ttfts = [s.load.ttft_p99_s for s in ordered if s.load.ttft_p99_s is not None]
    load = RegionLoad(
        queue_depth=sum(s.load.queue_depth for s in ordered),
        in_flight=sum(s.load.in_flight for s in ordered),
        kv_util=max(s.load.kv_util for s in ordered),
        requests_per_s=round(rps, 3),
        error_rate=round(min(1.0, error_rate), 4),
        ttft_p99_s=max(ttfts) if ttfts else None,
        spilled_per_s=round(sum(s.load.spilled_per_s for s in ordered), 3),
    )
    endpoints = list(fresh.endpoints)
    for s in reversed(ordered):
        endpoints += [e for e in s.endpoints if e not in endpoints]
    published = [s.models for s in ordered if s.models is not None]
    models: dict[str, float] | None = None
    if published:  # each model's capacity: the largest any agent reports (the same nodes)
        most: dict[str, float] = {}
        for seen in published:
            for model, capacity in seen.items():
                most[model] = max(capacity, most.get(model, 0.0))
        models = dict(sorted(most.items()))
    layouts = [s.group_layout for s in ordered if s.group_layout is not None]
    layout = None
    if layouts:
        merged: dict[str, float] = {}
        for lay in layouts:
            for g, w in lay.groups.items():
                merged[g] = max(w, merged.get(g, 0.0))
        layout = layouts[-1].model_copy(update={"groups": dict(sorted(merged.items()))})
    laggard = min(ordered, key=lambda s: s.observed_generation)
    return fresh.model_copy(
        update={
            "endpoints": endpoints,
            "nodes_healthy": max(s.nodes_healthy for s in ordered),
            "nodes_total": max(s.nodes_total for s in ordered),
            "capacity": max(s.capacity for s in ordered),
            "models": models,
            "load": load,
            "admin": laggard.admin,
            "observed_generation": laggard.observed_generation,
            "agent_id": ",".join(sorted(s.agent_id for s in ordered)),
            "group_layout": layout,
        }
    )


def _settle(record: RegionRecord) -> None:
    """The region's liveness and status from its agents'."""
    agents = record.agents.values()
    record.alive = any(a.alive for a in agents)
    live = [a.status for a in agents if a.alive and a.status is not None]
    valid = live or [a.status for a in agents if a.status is not None]
    record.status = combine(valid) if valid else None
    record.status_bad = record.status is None and any(a.status_bad for a in agents)


def _tables(view: FleetView, entries: Sequence[etcd.Entry]) -> None:
    """Group tables per region and kind; bad ranges reported and ignored."""
    ranges: dict[tuple[str, str], list[tuple[int, GroupTable]]] = {}
    for entry in entries:
        where = keys.parse_group_key(entry.key)
        if where is None:
            continue  # not a group-table key (flat tables, other data): not ours to judge
        region, kind, first = where
        value = parse(entry, GroupTable, view.bad)
        if value is None:
            continue
        record = view.regions.get(region)
        status = record.status if record is not None else None
        layout = status.group_layout if status is not None else None
        problem = None
        if (value.region, value.kind, value.first) != (region, kind, first):
            problem = (
                f"value names {value.region}/{value.kind}-{value.first}, the key "
                f"{region}/{kind}-{first}"
            )
        elif layout is None:
            problem = f"no agent of region {region!r} reports group tables"
        elif value.owner not in layout.groups:
            problem = (
                f"group {value.owner!r} is not a group of region {region!r} "
                f"(its agents report {', '.join(sorted(layout.groups)) or 'none'})"
            )
        elif value.n_buckets != layout.n_buckets:
            problem = (
                f"a table of {value.n_buckets} buckets; region {region!r} uses {layout.n_buckets}"
            )
        if problem is not None:
            view.bad.append(BadValue(entry.key, problem))
            continue
        ranges.setdefault((region, kind), []).append((entry.mod_revision, value))
    for (region, kind), found in sorted(ranges.items()):
        record = view.regions[region]
        layout = record.status.group_layout if record.status is not None else None
        assert layout is not None  # checked above
        found.sort(key=lambda rv: (rv[0], rv[1].first))
        base = groups.assign(
            {groups.GroupId(g): w for g, w in layout.groups.items()},
            n_buckets=layout.n_buckets,
            kind="session" if kind == "session" else "prefix",
            vnodes=layout.vnodes,
            load_factor=layout.load_factor,
        )
        table = base.paint(
            (groups.Range(first=v.first, end=v.end, owner=v.owner) for _, v in found),
            allowed=set(layout.groups),
        )
        times = [v.updated_at for _, v in found]
        record.tables[kind] = TableView(
            kind=kind,
            entries=len(found),
            buckets=dict(sorted(table.shares().items())),
            n_buckets=layout.n_buckets,
            newest_at=max(times),
            oldest_at=min(times),
            agents=sorted({v.agent for _, v in found}),
        )
    for record in view.regions.values():  # regions with group routing but nothing moved yet
        layout = record.status.group_layout if record.status is not None else None
        if layout is None or not layout.groups:
            continue
        for kind in keys.GROUP_KINDS:
            if kind not in record.tables:
                base = groups.assign(
                    {groups.GroupId(g): w for g, w in layout.groups.items()},
                    n_buckets=layout.n_buckets,
                    vnodes=layout.vnodes,
                    load_factor=layout.load_factor,
                )
                record.tables[kind] = TableView(
                    kind=kind,
                    buckets=dict(sorted(base.shares().items())),
                    n_buckets=layout.n_buckets,
                )


async def read(store: etcd.Store, *, tables: bool = False) -> FleetView:
    """The fleet as etcd holds it; with ``tables``, the regions' group tables too."""
    view = FleetView()
    for entry in (await store.get_prefix(keys.REGIONS)).entries:
        in_agent = keys.parse_agent_key(entry.key)
        if in_agent is not None:
            region, agent_id, leaf = in_agent
            record = view.regions.setdefault(region, RegionRecord(region=region))
            agent = record.agents.setdefault(agent_id, AgentRecord(agent=agent_id))
            if leaf == "alive":
                agent.alive = True
            elif leaf == "status":
                _agent_status(entry, region, agent, view.bad)
            continue
        parsed = keys.parse_region_key(entry.key)
        if parsed is None:
            continue
        region, leaf = parsed
        record = view.regions.setdefault(region, RegionRecord(region=region))
        if leaf in ("alive", "status"):  # an older, single-agent publisher
            legacy = record.agents.setdefault(LEGACY_AGENT, AgentRecord(agent=LEGACY_AGENT))
            if leaf == "alive":
                legacy.alive = True
            else:
                _agent_status(entry, region, legacy, view.bad)
        elif leaf == "desired":
            record.desired = parse(entry, RegionDesired, view.bad)
        elif leaf == "health":
            record.health = parse(entry, RegionHealth, view.bad)
        elif leaf == "override":
            record.override = parse(entry, RegionOverride, view.bad)
    for record in view.regions.values():
        _settle(record)
    if tables:
        _tables(view, (await store.get_prefix(keys.ROUTING)).entries)
    plan = await store.get(keys.PLAN)
    if plan is not None:
        view.plan = parse(plan, FleetPlan, view.bad) or FleetPlan()
    for entry in (await store.get_prefix(keys.PROBES)).entries:
        report = parse(entry, ProbeReport, view.bad)
        if report is not None and entry.key != keys.PROBES + report.replica:
            view.bad.append(BadValue(entry.key, f"names replica {report.replica!r}"))
        elif report is not None:
            view.probes[report.replica] = report
    for problem in view.bad:
        log.warning(
            "ignoring a bad value in etcd this window key=%s problem=%s",
            problem.key,
            problem.problem,
        )
    return view


def reach(
    view: FleetView, region: str, endpoints: list[str], *, now: float, max_age_s: float
) -> probing.Reach | None:
    """The controller replicas' votes on ``region`` (``policies.probing.tally``)."""
    return probing.tally(
        region, _rounds(view, region), endpoints=endpoints, now=now, max_age_s=max_age_s
    )


def _rounds(view: FleetView, region: str) -> list[probing.Round]:
    return [
        probing.Round(
            replica=report.replica,
            at=report.at,
            vantage=report.region,
            probes=tuple(
                probing.Probe(endpoint=p.endpoint, ok=p.ok, error=p.error, latency_ms=p.latency_ms)
                for p in report.regions[region]
            ),
        )
        for report in view.probes.values()
        if region in report.regions
    ]


def measured_latency(
    view: FleetView, *, now: float, max_age_s: float
) -> dict[tuple[str, str], float]:
    """Round trips between regions measured by the probes of replicas with ``probe.region``
    (``policies.probing.measured_rtt_ms``)."""
    targets = {r for report in view.probes.values() for r in report.regions}
    return probing.measured_rtt_ms(
        {t: _rounds(view, t) for t in sorted(targets)}, now=now, max_age_s=max_age_s
    )


def describe_probes(view: FleetView, region: str, *, now: float) -> dict[str, object]:
    """Each replica's last probes of ``region`` for the read API, with the round's age."""
    return {
        replica: {
            "age_s": round(max(0.0, now - report.at), 3),
            "region": report.region,
            "probes": [p.model_dump() for p in report.regions[region]],
        }
        for replica, report in sorted(view.probes.items())
        if region in report.regions
    }


def describe_agents(record: RegionRecord) -> dict[str, dict[str, object]]:
    """Each agent of the region for the read API (the legacy single-agent keys as ``""``)."""
    return {
        a.agent: {
            "alive": a.alive,
            "status_bad": a.status_bad,
            "updated_at": a.status.updated_at if a.status is not None else None,
        }
        for a in sorted(record.agents.values(), key=lambda a: a.agent)
    }


def describe_tables(record: RegionRecord, *, now: float) -> dict[str, dict[str, object]]:
    """Each group table of the region for the read API: its groups and their buckets, how many
    ranges are stored, and ``stale_s``, the age of its newest range (``None``: none stored; the
    table is the assignment)."""
    return {
        kind: {
            "groups": t.buckets,
            "n_buckets": t.n_buckets,
            "entries": t.entries,
            "agents": t.agents,
            "stale_s": None if t.newest_at is None else round(max(0.0, now - t.newest_at), 3),
            "oldest_s": None if t.oldest_at is None else round(max(0.0, now - t.oldest_at), 3),
        }
        for kind, t in sorted(record.tables.items())
    }
