"""Probing from outside, against real etcd and a real agent behind a TCP proxy the test owns.

Three controller replicas' probers (``controlplane.probing.Prober``, each with its own
``election.id``) probe two regions: eu-west publishes the proxy's address, eu-north the agent's
own.  The proxy blackholes every connection (the region's load balancer dead while its agents
are healthy) or only one replica's (that replica's network cut off).  The leader's passes
(``reconcile.windows``, driven clock) tally the rounds: eu-west fails when a majority of the
replicas that probed could not reach it, and never on one replica's word; the region detail of
the admin API shows each replica's probes, and a ``probe`` event says when it changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import meridian_etcd
from controlplane.probing import Prober, probe, probe_url
from controlplane.reconcile import fleet, windows
from controlplane.settings import ControllerSettings, ProbeSettings
from meridian_wire import keys
from meridian_wire.models import (
    EndpointProbe,
    Event,
    FleetPlan,
    ProbeReport,
    RegionHealth,
    RegionStatus,
)
from tests.conftest import NodeFactory
from tests.faults.harness import Proxy
from tests.support import EtcdServer, ManualClock
from tests.support.agent import AgentFactory

WINDOW_S = 10.0
REPLICAS = ("ctl-a", "ctl-b", "ctl-c")


def _settings(etcd: EtcdServer, replica: str = "ctl-a", **probe: Any) -> ControllerSettings:
    return ControllerSettings(
        etcd={"endpoints": [etcd.url]},
        election={"id": replica},
        failover={"window_s": WINDOW_S, "min_hold_s": 0.0, "strikes": 2},
        probe={"enabled": True, "interval_s": WINDOW_S, "timeout_s": 0.5, **probe},
        regions=[
            {"id": "eu-west", "geo": "eu", "residency": ["eu"], "backups": ["eu-north"]},
            {"id": "eu-north", "geo": "eu", "residency": ["eu"], "backups": ["eu-west"]},
        ],
    )  # type: ignore[arg-type]


async def _publish(store: meridian_etcd.Store, clock: ManualClock, region: str, url: str) -> None:
    """The region's agent says it is healthy (its status and liveness, as an agent writes)."""
    status = RegionStatus(
        region=region, geo="eu", residency=["eu"], endpoints=[url], nodes_healthy=1,
        nodes_total=1, capacity=1.0, agent_id="a1", updated_at=clock.now(),
    )  # fmt: skip
    await store.put(keys.agent_status(region, "a1"), status.model_dump_json().encode())
    await store.put(keys.agent_alive(region, "a1"), b"")


@pytest.fixture
async def proxied(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> AsyncIterator[tuple[str, Proxy]]:
    """A real agent over one simulated node, and a proxy in front of it."""
    agent = await start_agent([await sim_node()])
    port = int(agent.url.rsplit(":", 1)[1])
    proxy = await Proxy("127.0.0.1", port).start()
    yield agent.url, proxy
    await proxy.close()


class Replicas:
    """Three probers over one etcd and one driven clock, and the leader's window passes."""

    def __init__(
        self,
        store: meridian_etcd.Store,
        etcd: EtcdServer,
        clock: ManualClock,
        vantages: dict[str, str] | None = None,
    ) -> None:
        self.store, self.clock = store, clock
        self.settings = _settings(etcd)
        where = vantages or {}
        self.probers = {
            r: Prober(
                _settings(etcd, r, **({"region": where[r]} if r in where else {})),
                store=store,
                clock=clock,
            )
            for r in REPLICAS
        }

    async def window(self, *, west: str, north: str) -> windows.PassResult:
        """One window: the agents publish, each replica probes (its own client), the leader
        judges."""
        self.clock.t += WINDOW_S
        await _publish(self.store, self.clock, "eu-west", west)
        await _publish(self.store, self.clock, "eu-north", north)
        for prober in self.probers.values():
            async with prober.session() as session:
                await prober.once(session, ssl_context=prober.ssl_context())
        return await windows.reconcile_once(
            store=self.store, fence=None, settings=self.settings, clock=self.clock
        )

    async def health(self, region: str) -> RegionHealth:
        entry = await self.store.get(keys.health(region))
        assert entry is not None
        return RegionHealth.model_validate_json(entry.value)

    async def events(self) -> list[Event]:
        entries = (await self.store.get_prefix(keys.EVENTS)).entries
        return [Event.model_validate_json(e.value) for e in sorted(entries, key=lambda e: e.key)]


async def test_a_blackholed_endpoint_of_a_region_with_healthy_agents_is_failed_by_the_probes(
    store: meridian_etcd.Store, etcd: EtcdServer, proxied: tuple[str, Proxy]
) -> None:
    agent_url, proxy = proxied
    clock = ManualClock()
    fleet_ = Replicas(store, etcd, clock)
    await fleet_.window(west=proxy.url, north=agent_url)  # the first plan
    await fleet_.window(west=proxy.url, north=agent_url)
    assert (await fleet_.health("eu-west")).state == "healthy"
    view = await fleet.read(store)
    assert sorted(view.probes) == list(REPLICAS)
    for report in view.probes.values():  # every replica reached both, via the real agent
        assert [p.ok for p in report.regions["eu-west"]] == [True]
        assert report.regions["eu-west"][0].status == 200

    proxy.partition()  # the region's public address is dead; its agent is not
    await fleet_.window(west=proxy.url, north=agent_url)
    west = await fleet_.health("eu-west")
    assert west.state == "suspect"
    assert "unreachable from 3 of 3 controller replicas" in west.reason
    assert "no answer within 0.5 s" in west.reason
    await fleet_.window(west=proxy.url, north=agent_url)
    west = await fleet_.health("eu-west")
    assert west.state == "failed" and west.weight == 0.0
    north = await fleet_.health("eu-north")
    assert north.state == "healthy"
    plan_entry = await store.get(keys.PLAN)
    assert plan_entry is not None
    plan = FleetPlan.model_validate_json(plan_entry.value)
    assert plan.unreachable == ["eu-west"]
    assert plan.serving["eu"] == {"eu-north": 1.0}

    probe_events = [e for e in await fleet_.events() if e.kind == "probe"]
    assert [(e.region, e.data["unreachable"]) for e in probe_events] == [("eu-west", True)]
    assert probe_events[0].data["failed"] == list(REPLICAS)

    proxy.heal()
    for _ in range(6):  # recovery windows, then the ramp
        await fleet_.window(west=proxy.url, north=agent_url)
    assert (await fleet_.health("eu-west")).state == "healthy"
    probe_events = [e for e in await fleet_.events() if e.kind == "probe"]
    assert [(e.region, e.data["unreachable"]) for e in probe_events] == [
        ("eu-west", True),
        ("eu-west", False),
    ]
    assert probe_events[-1].reason == "reached by 3 of 3 controller replicas"


async def test_one_replica_cut_off_cannot_fail_a_region_the_others_reach(
    store: meridian_etcd.Store, etcd: EtcdServer, proxied: tuple[str, Proxy]
) -> None:
    agent_url, proxy = proxied
    clock = ManualClock()
    fleet_ = Replicas(store, etcd, clock)
    proxy.blackhole_for(b"meridian-probe/ctl-c")  # only ctl-c's probes are lost
    for _ in range(4):
        await fleet_.window(west=proxy.url, north=agent_url)
    west = await fleet_.health("eu-west")
    assert west.state == "healthy", west.reason
    view = await fleet.read(store)
    assert view.probes["ctl-c"].regions["eu-west"][0].ok is False
    assert view.probes["ctl-a"].regions["eu-west"][0].ok is True
    reach = fleet.reach(view, "eu-west", [proxy.url], now=clock.now(), max_age_s=30)
    assert reach is not None and reach.failed == ("ctl-c",) and not reach.unreachable

    proxy.blackhole_for(b"meridian-probe/ctl-")  # now ctl-b's and ctl-a's too
    await fleet_.window(west=proxy.url, north=agent_url)
    assert "unreachable from 3 of 3" in (await fleet_.health("eu-west")).reason


async def test_a_dead_replica_stops_voting_and_a_stale_round_does_not_vote(
    store: meridian_etcd.Store, etcd: EtcdServer, proxied: tuple[str, Proxy]
) -> None:
    """A replica's round lives under its lease (revoked when it stops) and votes only while
    fresh: two replicas that probed once and then stopped cannot hold a region failed."""
    agent_url, proxy = proxied
    clock = ManualClock()
    fleet_ = Replicas(store, etcd, clock)
    proxy.partition()
    await fleet_.window(west=proxy.url, north=agent_url)
    assert sorted((await fleet.read(store)).probes) == list(REPLICAS)
    await fleet_.probers["ctl-c"]._revoke()  # what run() does when the replica stops
    assert sorted((await fleet.read(store)).probes) == ["ctl-a", "ctl-b"]

    view = await fleet.read(store)
    later = clock.now() + 3 * WINDOW_S + 1  # past probe.max_age_s (3 x interval)
    assert fleet.reach(view, "eu-west", [proxy.url], now=later, max_age_s=30) is None
    endpoint_moved = fleet.reach(
        view, "eu-west", ["http://eu-west.example:8080"], now=clock.now(), max_age_s=30
    )
    assert endpoint_moved is None  # probes of an endpoint it no longer publishes
    for prober in fleet_.probers.values():
        await prober._revoke()


async def test_probe_answers_other_than_2xx(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory, tmp_path: Path
) -> None:
    """A 401 is reached (the key is refused, the round says so) and the key from
    probe.api_key_file is accepted; a 404, a refused connection and a TLS handshake with a
    plain-HTTP server are not reached."""
    key = "sk-probe-123"
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(
        '[[tenants]]\nname = "probe"\n[[tenants.keys]]\n'
        f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
    )
    node = await sim_node()
    keyed_agent = await start_agent([node], tenants={"keys_file": str(keys_file)})
    open_agent = await start_agent([node])
    settings = _settings(etcd).probe
    headers = {"User-Agent": "meridian-probe/test"}

    async def run(url: str, probe_settings: ProbeSettings, **extra: str) -> EndpointProbe:
        return await probe(
            session, url, settings=probe_settings, headers={**headers, **extra},
            ssl_context=True,
        )  # fmt: skip

    async with aiohttp.ClientSession() as session:
        refused = await run(keyed_agent.url, settings)
        assert refused.ok and refused.status == 401 and "probe.api_key_file" in refused.error
        key_file = tmp_path / "probe.key"
        key_file.write_text(key + "\n")
        keyed = _settings(etcd, api_key_file=key_file).probe
        assert keyed.api_key() == key
        answered = await run(keyed_agent.url, keyed, Authorization=f"Bearer {keyed.api_key()}")
        assert answered.ok and answered.status == 200 and not answered.error
        assert answered.latency_ms is not None and answered.latency_ms > 0
        missing = await run(open_agent.url, _settings(etcd, path="/nowhere").probe)
        assert (missing.ok, missing.status, missing.error) == (False, 404, "answered 404")
        closed = await run("http://127.0.0.1:1", settings)
        assert not closed.ok and closed.error.startswith("cannot connect")
        tls = await run(open_agent.url.replace("http://", "https://"), settings)
        assert not tls.ok and tls.status is None and tls.error
    assert probe_url("10.0.0.1:443", "/v1/models") == "https://10.0.0.1:443/v1/models"
    assert probe_url("http://a.example:8080/", "/v1/models") == "http://a.example:8080/v1/models"


def test_probe_settings_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match=r"probe.timeout_s \(10 s\) must be below"):
        ControllerSettings(probe={"timeout_s": 10, "interval_s": 10})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must start with '/'"):
        ControllerSettings(probe={"path": "v1/models"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no such file"):
        ControllerSettings(probe={"api_key_file": "/nonexistent/key"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_age_s"):
        ControllerSettings(probe={"max_age_s": 5, "interval_s": 10})  # type: ignore[arg-type]
    assert ControllerSettings().probe.vote_age_s == 30.0
    with pytest.raises(ValueError, match=r"election.id 'Host-1': with probe.enabled"):
        ControllerSettings(election={"id": "Host-1"}, probe={"enabled": True})  # type: ignore[arg-type]
    assert ControllerSettings(election={"id": "Host-1"}).election.id == "Host-1"  # type: ignore[arg-type]


async def test_a_report_under_another_replicas_key_is_a_bad_value(
    store: meridian_etcd.Store,
) -> None:
    report = ProbeReport(replica="ctl-b", at=1.0, interval_s=10.0)
    await store.put(keys.probes("ctl-a"), report.model_dump_json().encode())
    await store.put(keys.probes("ctl-c"), b"{not json")
    view = await fleet.read(store)
    assert view.probes == {}
    assert sorted(str(b) for b in view.bad) == [
        f"{keys.probes('ctl-a')}: names replica 'ctl-b'",
        f"{keys.probes('ctl-c')}: not JSON: Invalid JSON: key must be a string at line 1 column 2",
    ]


async def test_replicas_with_a_region_measure_the_round_trip_for_backups(
    store: meridian_etcd.Store, etcd: EtcdServer, proxied: tuple[str, Proxy]
) -> None:
    """ctl-a and ctl-b run in eu-north (probe.region): their probes of eu-west time the round
    trip eu-north -> eu-west, which the plan keeps and backups use where latency_ms is
    silent; ctl-c has no region and measures nothing; eu-north's own replicas do not measure
    eu-north."""
    agent_url, proxy = proxied
    clock = ManualClock()
    fleet_ = Replicas(store, etcd, clock, vantages={"ctl-a": "eu-north", "ctl-b": "eu-north"})
    await fleet_.window(west=proxy.url, north=agent_url)  # the first plan: what to probe
    await fleet_.window(west=proxy.url, north=agent_url)
    entry = await store.get(keys.PLAN)
    assert entry is not None
    measured = FleetPlan.model_validate_json(entry.value).measured_latency_ms
    assert list(measured) == ["eu-north"] and list(measured["eu-north"]) == ["eu-west"]
    rtt = measured["eu-north"]["eu-west"]
    view = await fleet.read(store)
    fastest = sorted(
        view.probes[r].regions["eu-west"][0].latency_ms or 0.0 for r in ("ctl-a", "ctl-b")
    )
    assert rtt == pytest.approx(sum(fastest) / 2 / 2, abs=0.002)  # median of 2, over 2 trips
    assert view.probes["ctl-a"].region == "eu-north" and view.probes["ctl-c"].region is None

    statuses = {r: rec.status for r, rec in view.regions.items() if rec.status is not None}
    topology = windows.topology_from(fleet_.settings, statuses, {("eu-north", "eu-west"): rtt})
    assert topology.latency_ms[("eu-north", "eu-west")] == rtt  # type: ignore[index]
    configured = fleet_.settings.model_copy(update={"latency_ms": {"eu-west": {"eu-north": 42.0}}})
    topology = windows.topology_from(configured, statuses, {("eu-north", "eu-west"): rtt})
    assert ("eu-north", "eu-west") not in topology.latency_ms  # configured wins, either order
    assert topology.latency_ms[("eu-west", "eu-north")] == 42.0  # type: ignore[index]
    for prober in fleet_.probers.values():
        await prober._revoke()
