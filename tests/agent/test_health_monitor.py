"""The health monitor against real simulated nodes on loopback.

Probes are real ``GET /health`` requests, driven one round at a time with ``probe_once``;
faults are injected through the simulator's ``/admin/faults``.  Time is a fake clock the test
sets, so ejection and slow-start times never depend on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from meridian_service.clock import MonotonicClock
from policies.model import Health, NodeId
from regional_agent.health import HealthMonitor
from regional_agent.nodes import Node, NodePool
from regional_agent.settings import HealthSettings
from regional_agent.upstream.client import NodeClient
from regional_agent.workers.shared import PROBE_DETAIL_BYTES, PROBE_FIELDS, LoadShare, LoadTable
from tests.conftest import NodeFactory
from tests.support import ManualClock
from tests.support.agent import ADMIN, AgentFactory, admin_nodes, metric, openai_client
from tests.support.ports import free_port
from tests.support.process import in_child

MONITOR_LOG = "regional_agent.health.monitor"
POOL_LOG = "regional_agent.nodes"
MODEL = "tiny-model"
SETTINGS = HealthSettings(
    probe_interval_s=0.05,
    probe_timeout_s=1.0,
    unhealthy_after=2,
    healthy_after=2,
    eject_consecutive_errors=5,
    eject_base_s=30.0,
    eject_max_s=300.0,
    max_ejected_fraction=0.5,
    latency_outlier_factor=3.0,
    latency_outlier_min_s=0.5,
    latency_min_samples=5,
    slow_start_s=30.0,
)


@pytest.fixture
async def client() -> AsyncIterator[NodeClient]:
    c = NodeClient(connect_timeout_s=1, first_byte_timeout_s=5, read_timeout_s=5)
    yield c
    await c.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


class Notified:
    def __init__(self, pool: NodePool) -> None:
        self.count = 0
        pool.subscribe(self._bump)

    def _bump(self) -> None:
        self.count += 1


Setup = tuple[NodePool, HealthMonitor, list[NodeId], list[str]]
SetupFactory = Callable[..., Awaitable[Setup]]


@pytest.fixture
def make_monitor(sim_node: NodeFactory, client: NodeClient, clock: ManualClock) -> SetupFactory:
    """``pool, monitor, ids, urls = await make_monitor(n)``: n sim nodes in a fresh pool."""

    async def make(n: int, *, settings: HealthSettings = SETTINGS) -> Setup:
        pool = NodePool()
        urls = [await sim_node(profile_name="cpu-tiny", time_scale=20, seed=i) for i in range(n)]
        ids = [NodeId(f"node-{i}") for i in range(n)]
        for node_id, url in zip(ids, urls, strict=True):
            pool.add(Node(node_id=node_id, url=url))
        monitor = HealthMonitor(pool=pool, client=client, settings=settings, clock=clock)
        pool.health = monitor
        return pool, monitor, ids, urls

    return make


async def _faults(url: str, body: dict[str, object] | None) -> None:
    async with aiohttp.ClientSession() as session:
        if body is None:
            async with session.delete(f"{url}/admin/faults") as r:
                assert r.status == 200
        else:
            async with session.post(f"{url}/admin/faults", json=body) as r:
                assert r.status == 200


def _changes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == MONITOR_LOG]


# -- active probes -----------------------------------------------------------------------------


async def test_failing_health_makes_a_node_unhealthy_and_it_comes_back_slowly(
    make_monitor: SetupFactory, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=MONITOR_LOG)
    pool, monitor, (sick, well), (url, _) = await make_monitor(2)
    notified = Notified(pool)
    await monitor.probe_once()
    assert monitor.state(sick, now=clock.now()) is Health.HEALTHY
    assert monitor.slow_start(sick, now=clock.now()) == 1.0  # healthy at start-up: no ramp
    assert notified.count == 0

    await _faults(url, {"fail_health": True})
    for round_ in range(1, SETTINGS.unhealthy_after + 1):
        clock.t += 1
        await monitor.probe_once()
        expected = Health.UNHEALTHY if round_ == SETTINGS.unhealthy_after else Health.HEALTHY
        assert monitor.state(sick, now=clock.now()) is expected
    assert monitor.state(well, now=clock.now()) is Health.HEALTHY
    assert notified.count == 1
    view = monitor.describe(sick, now=clock.now())
    assert view["state"] == "unhealthy"
    assert view["reason"] == "2 consecutive failed probes (HTTP 503)"
    assert [v.health for v in pool.views(now=clock.now())] == [Health.UNHEALTHY, Health.HEALTHY]
    assert _changes(caplog) == [
        "node health changed node=node-0 state=unhealthy previous=healthy "
        'reason="2 consecutive failed probes (HTTP 503)"'
    ]

    await _faults(url, None)
    for round_ in range(1, SETTINGS.healthy_after + 1):
        clock.t += 1
        await monitor.probe_once()
        expected = Health.HEALTHY if round_ == SETTINGS.healthy_after else Health.UNHEALTHY
        assert monitor.state(sick, now=clock.now()) is expected
    assert notified.count == 2
    assert monitor.slow_start(sick, now=clock.now()) == pytest.approx(0.1)
    assert 0.1 < monitor.slow_start(sick, now=clock.now() + 15) < 1.0
    assert monitor.slow_start(sick, now=clock.now() + SETTINGS.slow_start_s) == 1.0
    assert pool.views(now=clock.now())[0].slow_start == pytest.approx(0.1)
    assert _changes(caplog)[-1] == (
        "node health changed node=node-0 state=healthy previous=unhealthy "
        'reason="2 consecutive good probes"'
    )


async def test_a_closed_port_is_unhealthy(make_monitor: SetupFactory, clock: ManualClock) -> None:
    pool, monitor, _, _ = await make_monitor(1)
    dead = NodeId("dead")
    pool.add(Node(node_id=dead, url=f"http://127.0.0.1:{free_port()}"))
    await monitor.probe_once()
    assert monitor.state(dead, now=clock.now()) is Health.HEALTHY  # one failure is not enough
    clock.t += 1
    await monitor.probe_once()
    assert monitor.state(dead, now=clock.now()) is Health.UNHEALTHY
    assert str(monitor.describe(dead, now=clock.now())["reason"]).startswith(
        "2 consecutive failed probes (unreachable"
    )
    assert monitor.state(NodeId("node-0"), now=clock.now()) is Health.HEALTHY


async def test_run_probes_on_its_own(sim_node: NodeFactory, client: NodeClient) -> None:
    url = await sim_node(profile_name="cpu-tiny", time_scale=20)
    pool = NodePool()
    node_id = NodeId("n")
    pool.add(Node(node_id=node_id, url=url))
    clock = MonotonicClock()
    monitor = HealthMonitor(pool=pool, client=client, settings=SETTINGS, clock=clock)
    changed = asyncio.Event()
    pool.subscribe(changed.set)
    await _faults(url, {"fail_health": True})
    task = asyncio.create_task(monitor.run())
    try:
        async with asyncio.timeout(10):
            await changed.wait()
        assert monitor.state(node_id, now=clock.now()) is Health.UNHEALTHY
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- passive outlier detection -------------------------------------------------------------------


async def test_failed_requests_eject_then_probation_then_healthy(
    make_monitor: SetupFactory, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=MONITOR_LOG)
    pool, monitor, (bad, _, _), _ = await make_monitor(3)
    notified = Notified(pool)
    await monitor.probe_once()
    for i in range(SETTINGS.eject_consecutive_errors):
        assert monitor.state(bad, now=clock.now()) is Health.HEALTHY
        monitor.record(bad, ok=False, ttft_s=None, now=clock.now() + i * 0.1)
    assert monitor.state(bad, now=clock.now()) is Health.EJECTED
    assert notified.count == 1
    view = monitor.describe(bad, now=clock.now())
    assert view["ejections"] == 1
    assert view["ejected_until"] == pytest.approx(clock.now() + 0.4 + SETTINGS.eject_base_s)
    assert view["reason"] == "5 consecutive failed requests; ejection #1 for 30 s"
    assert not pool.views(now=clock.now())[0].routable

    clock.t += SETTINGS.eject_base_s + 1  # the time is up; the next round reports it
    await monitor.probe_once()  # /health passes all along: it does not end an ejection early
    assert monitor.state(bad, now=clock.now()) is Health.PROBATION
    assert notified.count == 2
    view_of = pool.views(now=clock.now())[0]
    assert view_of.routable and view_of.health is Health.PROBATION
    assert monitor.slow_start(bad, now=clock.now()) == pytest.approx(0.1)

    monitor.record(bad, ok=True, ttft_s=0.05, now=clock.now())
    assert monitor.state(bad, now=clock.now()) is Health.HEALTHY
    assert notified.count == 3
    assert monitor.slow_start(bad, now=clock.now()) == pytest.approx(0.1)
    assert monitor.slow_start(bad, now=clock.now() + SETTINGS.slow_start_s) == 1.0
    assert [m.split(" reason=")[0] for m in _changes(caplog)] == [
        "node health changed node=node-0 state=ejected previous=healthy",
        "node health changed node=node-0 state=probation previous=ejected",
        "node health changed node=node-0 state=healthy previous=probation",
    ]
    assert [r.levelname for r in caplog.records if r.name == MONITOR_LOG] == [
        "WARNING",
        "INFO",
        "INFO",
    ]


async def test_a_failure_in_probation_ejects_for_twice_as_long(
    make_monitor: SetupFactory, clock: ManualClock
) -> None:
    _, monitor, (bad, _, _), _ = await make_monitor(3)
    for _ in range(SETTINGS.eject_consecutive_errors):
        monitor.record(bad, ok=False, ttft_s=None, now=clock.now())
    clock.t += SETTINGS.eject_base_s
    assert monitor.state(bad, now=clock.now()) is Health.PROBATION
    monitor.record(bad, ok=False, ttft_s=None, now=clock.now())
    view = monitor.describe(bad, now=clock.now())
    assert view["state"] == "ejected"
    assert view["ejections"] == 2
    assert view["ejected_until"] == pytest.approx(clock.now() + 2 * SETTINGS.eject_base_s)


async def test_a_latency_outlier_among_four_nodes_is_ejected(
    make_monitor: SetupFactory, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=MONITOR_LOG)
    _, monitor, ids, _ = await make_monitor(4)
    ttfts = dict(zip(ids, [0.20, 0.25, 0.22, 2.5], strict=True))
    for _ in range(SETTINGS.latency_min_samples):
        for node_id, ttft_s in ttfts.items():
            monitor.record(node_id, ok=True, ttft_s=ttft_s, now=clock.now())
    await monitor.probe_once()
    states = [monitor.state(i, now=clock.now()) for i in ids]
    assert states == [Health.HEALTHY] * 3 + [Health.EJECTED]
    view = monitor.describe(ids[3], now=clock.now())
    assert str(view["reason"]).startswith("latency outlier")
    assert view["ttft_samples"] == 0  # judged on fresh samples once back
    fast = monitor.describe(ids[0], now=clock.now())
    assert fast["ttft_samples"] == SETTINGS.latency_min_samples
    assert fast["ttft_median_s"] == pytest.approx(0.20)
    (line,) = _changes(caplog)
    assert 'state=ejected previous=healthy reason="latency outlier' in line


async def test_the_cap_keeps_one_of_two_failing_nodes_in(
    make_monitor: SetupFactory, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=MONITOR_LOG)
    pool, monitor, (a, b), _ = await make_monitor(2)
    notified = Notified(pool)
    for _ in range(SETTINGS.eject_consecutive_errors + 3):
        monitor.record(a, ok=False, ttft_s=None, now=clock.now())
        monitor.record(b, ok=False, ttft_s=None, now=clock.now())
    assert monitor.state(a, now=clock.now()) is Health.EJECTED
    assert monitor.state(b, now=clock.now()) is Health.HEALTHY
    assert notified.count == 1  # a refusal changes nothing routing sees
    assert monitor.describe(b, now=clock.now())["reason"] == (
        "5 consecutive failed requests; kept in: the ejection cap is reached"
    )
    assert _changes(caplog) == [
        "node health changed node=node-0 state=ejected previous=healthy "
        'reason="5 consecutive failed requests; ejection #1 for 30 s"',
        "node ejection refused node=node-1 state=healthy "
        'reason="5 consecutive failed requests; kept in: the ejection cap is reached"',
    ]


# -- membership --------------------------------------------------------------------------------


async def test_a_node_added_later_is_healthy_until_probed_and_ramps_up(
    make_monitor: SetupFactory, sim_node: NodeFactory, clock: ManualClock
) -> None:
    pool, monitor, _, _ = await make_monitor(1)
    await monitor.probe_once()  # start-up is over
    late = NodeId("late")
    pool.add(Node(node_id=late, url=await sim_node(profile_name="cpu-tiny", time_scale=20)))
    assert monitor.state(late, now=clock.now()) is Health.HEALTHY
    assert monitor.slow_start(late, now=clock.now()) == pytest.approx(0.1)
    clock.t += 15
    await monitor.probe_once()
    assert monitor.state(late, now=clock.now()) is Health.HEALTHY
    assert monitor.slow_start(late, now=clock.now()) == pytest.approx(0.55)


async def test_unknown_and_forgotten_nodes(make_monitor: SetupFactory, clock: ManualClock) -> None:
    pool, monitor, (node_id,), _ = await make_monitor(1)
    ghost = NodeId("ghost")
    monitor.record(ghost, ok=False, ttft_s=None, now=clock.now())  # not in the pool: ignored
    assert monitor.state(ghost, now=clock.now()) is Health.HEALTHY
    assert monitor.slow_start(ghost, now=clock.now()) == 1.0
    assert monitor.describe(ghost, now=clock.now())["reason"] == (
        "not tracked: healthy until probed"
    )
    for _ in range(SETTINGS.eject_consecutive_errors):
        monitor.record(node_id, ok=False, ttft_s=None, now=clock.now())
    assert monitor.state(node_id, now=clock.now()) is Health.EJECTED
    pool.remove(node_id)
    monitor.forget(node_id)
    assert monitor.describe(node_id, now=clock.now())["state"] == "healthy"
    assert set(monitor.describe(node_id, now=clock.now())) == {
        "state",
        "reason",
        "since",
        "ejections",
        "ejected_until",
        "consecutive_failures",
        "consecutive_probe_failures",
        "consecutive_probe_successes",
        "slow_start",
        "ttft_samples",
        "ttft_median_s",
        "probes_sent",
    }


async def test_a_probe_round_drops_nodes_removed_without_forget(
    make_monitor: SetupFactory, clock: ManualClock
) -> None:
    pool, monitor, (kept, gone), _ = await make_monitor(2)
    for _ in range(SETTINGS.eject_consecutive_errors):
        monitor.record(gone, ok=False, ttft_s=None, now=clock.now())
    assert monitor.state(gone, now=clock.now()) is Health.EJECTED
    pool.remove(gone)
    await monitor.probe_once()
    assert monitor.describe(gone, now=clock.now())["reason"] == "not tracked: healthy until probed"
    # the pool is one node now: its ejection is allowed (at least one always may be)
    for _ in range(SETTINGS.eject_consecutive_errors):
        monitor.record(kept, ok=False, ttft_s=None, now=clock.now())
    assert monitor.state(kept, now=clock.now()) is Health.EJECTED


# -- panic -------------------------------------------------------------------------------------


async def _until(pool: NodePool, done: Callable[[], bool], *, timeout_s: float = 10) -> None:
    """Wait until ``done()``, looking again at every change the pool is notified of."""
    changed = asyncio.Event()
    pool.subscribe(changed.set)
    async with asyncio.timeout(timeout_s):
        while not done():
            await changed.wait()
            changed.clear()


async def test_panic_routes_over_nodes_whose_probes_fail(
    sim_node: NodeFactory, start_agent: AgentFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The benchmark's finding: probes fail on most nodes (a loaded host) while they serve fine.
    Below ``panic_threshold`` routable, the agent routes to all of them and says so."""
    caplog.set_level(logging.WARNING, logger=POOL_LOG)
    urls = [await sim_node(profile_name="cpu-tiny", time_scale=20, seed=i) for i in range(4)]
    handle = await start_agent(
        urls,
        policy="round_robin",
        health={"unhealthy_after": 2, "healthy_after": 2, "panic_threshold": 0.5},
    )
    for url in urls[1:]:
        await _faults(url, {"fail_health": True})
    agent = handle.edge
    pool, clock = agent.pool, agent.clock
    await _until(pool, lambda: sum(v.routable for v in pool.observed(now=clock.now())) == 1)
    async with openai_client(handle.url) as client:
        for _ in range(8):
            reply = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert reply.choices[0].text
    nodes = await admin_nodes(handle.url, ADMIN)
    assert [nodes[u]["health"]["state"] for u in urls] == ["healthy"] + ["unhealthy"] * 3
    assert all(int(nodes[u]["requests_total"]) > 0 for u in urls)  # not squeezed onto one
    async with aiohttp.ClientSession() as s, s.get(f"{handle.url}/admin/nodes", headers=ADMIN) as r:
        panic = (await r.json())["panic"]
    assert panic["active"] is True and panic["routable"] == 1 and panic["eligible"] == 4
    assert await metric(handle.url, "meridian_agent_health_panic") == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == POOL_LOG]
    assert len(warnings) == 1 and warnings[0].startswith("health panic entered")

    for url in urls[1:]:
        await _faults(url, None)
    await _until(agent.pool, lambda: not agent.pool.panic(now=agent.clock.now()).active)
    assert await metric(handle.url, "meridian_agent_health_panic") == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == POOL_LOG]
    assert len(warnings) == 2 and warnings[1].startswith("health panic left")


async def test_without_panic_traffic_is_squeezed_onto_the_healthy_node(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = [await sim_node(profile_name="cpu-tiny", time_scale=20, seed=i) for i in range(3)]
    handle = await start_agent(
        urls, policy="round_robin", health={"unhealthy_after": 2, "panic_threshold": 0.0}
    )
    for url in urls[1:]:
        await _faults(url, {"fail_health": True})
    agent = handle.edge
    pool, clock = agent.pool, agent.clock
    await _until(pool, lambda: sum(v.routable for v in pool.views(now=clock.now())) == 1)
    async with openai_client(handle.url) as client:
        for _ in range(4):
            await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    nodes = await admin_nodes(handle.url, ADMIN)
    assert [int(nodes[u]["requests_total"]) for u in urls] == [4, 0, 0]


async def test_a_recovered_node_is_re_admitted_under_light_load_with_the_default_policy(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """The fault-probe finding: with ``meridian``, a node back from an ejection sat on probation
    for good (30k requests, none to it).  Now a probation trial reaches it within
    ``probation_every`` requests, it succeeds, and the node is HEALTHY again."""
    urls = [await sim_node(profile_name="cpu-tiny", time_scale=20, seed=i) for i in range(3)]
    handle = await start_agent(
        urls,
        policy="meridian",
        health={"eject_consecutive_errors": 2, "eject_base_s": 1.0, "max_ejected_fraction": 0.5},
        retry={"max_attempts": 3},
        routing={"tuning": {"probation_every": 8}},
    )
    await _faults(urls[2], {"error_rate": 1.0, "error_status": 500})
    pool, clock = handle.edge.pool, handle.edge.clock
    bad = next(n.node_id for n in pool if n.url == urls[2])
    async with openai_client(handle.url) as client:
        while pool.health.state(bad, now=clock.now()) is not Health.EJECTED:
            await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        await _faults(urls[2], None)  # it recovers while ejected
        await _until(pool, lambda: pool.health.state(bad, now=clock.now()) is Health.PROBATION)
        before = pool.get(bad).requests_total  # type: ignore[union-attr]
        for _ in range(8):  # one at a time: light load, the other two nodes idle
            await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    node = pool.get(bad)
    assert node is not None and node.requests_total == before + 1  # its trial
    assert pool.health.state(bad, now=clock.now()) is Health.HEALTHY
    decisions = [d for d in node.decisions if "probation trial" in d.reason]
    assert decisions, [d.reason for d in node.decisions]


# -- several workers: one probe of each node a round, shared ----------------------------------


async def test_workers_share_one_probe_of_each_node_and_take_over_a_silent_owner(
    sim_node: NodeFactory,
    client: NodeClient,
    clock: ManualClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two workers' monitors over the same four nodes, sharing a table: each node's owner
    probes it, the other applies the owner's probe (a failing node goes unhealthy on both,
    one round later on the one that did not probe it), and takes the node over while its
    owner is silent."""
    caplog.set_level(logging.INFO, logger=MONITOR_LOG)
    urls = [await sim_node(profile_name="cpu-tiny", time_scale=20, seed=i) for i in range(4)]
    ids = [NodeId(f"node-{i}") for i in range(4)]
    table = LoadTable(workers=2, slots=64)
    settings = SETTINGS.model_copy(update={"probe_interval_s": 1.0})

    def worker(index: int) -> HealthMonitor:
        pool = NodePool()
        for node_id, url in zip(ids, urls, strict=True):
            pool.add(Node(node_id=node_id, url=url))
        monitor = HealthMonitor(pool=pool, client=client, settings=settings, clock=clock)
        pool.health = monitor
        monitor.share = LoadShare(table, worker=index, lock_file=tmp_path / "slots.lock")
        return monitor

    first, second = worker(0), worker(1)
    assert first.share is not None and second.share is not None
    mine = [n for n in ids if first.share.owns(n)]
    theirs = [n for n in ids if second.share.owns(n)]
    assert sorted(mine + theirs) == ids and mine and theirs  # each node has one owner

    def sent() -> list[int]:  # probes each node got, from either worker
        return [first.probes_sent[n] + second.probes_sent[n] for n in ids]

    await first.probe_once()  # nothing published yet: it probes every node
    await second.probe_once()  # its own nodes only: the first's probes are fresh
    assert sent() == [2 if n in theirs else 1 for n in ids]
    for _ in range(3):  # from then on, one probe of each node a round
        clock.t += 1.0
        before = sent()
        await first.probe_once()
        await second.probe_once()
        assert [s - b for s, b in zip(sent(), before, strict=True)] == [1, 1, 1, 1]
    for node_id in ids:
        for monitor in (first, second):
            view = monitor.describe(node_id, now=clock.now())
            assert view["state"] == "healthy" and view["consecutive_probe_successes"] >= 3

    # a node of the first's fails its probes: the second learns it from the first's between
    # its own rounds (run() calls this every SIBLING_PROBES_S)
    sick = mine[0]
    await _faults(urls[ids.index(sick)], {"fail_health": True})
    for _ in range(SETTINGS.unhealthy_after):
        clock.t += 1.0
        await first.probe_once()
        second.apply_sibling_probes()
    for monitor in (first, second):
        assert monitor.state(sick, now=clock.now()) is Health.UNHEALTHY
    reason = str(second.describe(sick, now=clock.now())["reason"])
    assert reason == "2 consecutive failed probes (HTTP 503, probed by w0)", reason
    await _faults(urls[ids.index(sick)], None)

    # the first stops (killed): the second takes its nodes over once the owner is silent
    silent_at = clock.now()
    while clock.now() - silent_at < 5.0:
        clock.t += 1.0
        before = sent()
        await second.probe_once()
        took_over = clock.now() - silent_at > 2 * 1.0 + settings.probe_timeout_s
        for node_id, was, now in zip(ids, before, sent(), strict=True):
            probed = node_id in theirs or took_over
            assert now - was == (1 if probed else 0), (node_id, clock.now() - silent_at)
    silent = [r.getMessage() for r in caplog.records if "health owner silent" in r.getMessage()]
    assert sorted(m.split()[3] for m in silent) == [f"node={n}" for n in sorted(mine)]
    assert second.state(sick, now=clock.now()) is Health.HEALTHY  # its own probes: good again

    await first.probe_once()  # the first is back (started again): the second lets go
    clock.t += 1.0
    before = sent()
    await second.probe_once()
    assert [s - b for s, b in zip(sent(), before, strict=True)] == [
        0 if n in mine else 1 for n in ids
    ]
    assert sum("health owner back" in r.getMessage() for r in caplog.records) == len(mine)


def test_a_published_probe_crosses_a_fork_and_one_read_while_written_is_skipped(
    tmp_path: Path,
) -> None:
    table = LoadTable(workers=2, slots=8)
    reader = LoadShare(table, worker=0, lock_file=tmp_path / "slots.lock")
    assert reader.probe("http://a:8000") is None
    long_detail = "unreachable: " + "\u00e9" * PROBE_DETAIL_BYTES  # two bytes a character
    in_child(  # the sibling publishes
        lambda: LoadShare(table, worker=1, lock_file=tmp_path / "slots.lock").publish_probe(
            "http://a:8000", 12.5, False, long_detail
        )
    )
    got = reader.probe("http://a:8000")
    assert got is not None and got[:3] == (12.5, 1, False)
    assert long_detail.startswith(got[3]) and len(got[3].encode()) == PROBE_DETAIL_BYTES - 1
    slot = reader.slot("http://a:8000")
    assert slot is not None
    # the owner's last probe is kept apart: only the owner's publishing moves it
    assert reader.owner_probed("http://a:8000") == (12.5 if slot % 2 == 1 else None)
    table.cells[table.probes_at + slot * PROBE_FIELDS] += 1  # odd: a writer is midway
    assert reader.probe("http://a:8000") is None
    reader.publish_probe("http://a:8000", 13.0, True, "HTTP 200")  # a dead writer blocks nothing
    assert reader.probe("http://a:8000") == (13.0, 0, True, "HTTP 200")
