"""The controller's ``/metrics`` on its read port (``server.port``), scraped from real replicas
(``create_app``: election, window loop, admin API) on real etcd, with stand-in agents
(``tests/meridianctl/stack.py``) and, for DNS, a real BIND9 (``tests/controlplane/
test_dns_controller.py``'s stack).  The exposition is parsed with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiohttp import web

from controlplane.app import CONTROLLER, Controller
from meridian_service import version
from meridian_wire import keys
from meridian_wire.models import FleetPlan, RegionDesired
from tests.controlplane.dns_helpers import API, EU_ADDRESS, US_ADDRESS, answer
from tests.controlplane.test_dns_controller import EU
from tests.controlplane.test_dns_controller import Stack as DnsStack
from tests.meridianctl.stack import TOKENS, Stack
from tests.support import BindServer, EtcdServer, relaunch
from tests.support.metrics import (
    ROOT,
    Scrape,
    base,
    check_documented,
    documented,
    instrument_names,
    zeros,
)

OPERATOR = {"Authorization": f"Bearer {TOKENS['operator']}"}
STATES = ("healthy", "suspect", "failed", "recovering", "drained")


class ReadPorts:
    """The replicas' read ports served on loopback (``server.port``, as the process serves it)."""

    def __init__(self) -> None:
        self.sites: list[web.TCPSite] = []

    async def serve(self, runner: web.AppRunner) -> str:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.sites.append(site)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        for site in self.sites:
            with contextlib.suppress(RuntimeError):  # stopped with its runner already
                await site.stop()


async def scrape(url: str) -> Scrape:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(f"{url}/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


async def until_scraped(
    url: str, check: Callable[[Scrape], bool], timeout_s: float, what: str
) -> Scrape:
    end = time.monotonic() + timeout_s
    while True:
        got = await scrape(url)
        if check(got):
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def state_of(m: Scrape, region: str) -> str | None:
    """The one state whose series is 1; asserts the region has one series per state."""
    series = m.find("meridian_controller_region_state", region=region)
    if not series:
        return None
    assert sorted(s.labels["state"] for s in series) == sorted(STATES)
    (up,) = [s.labels["state"] for s in series if s.value == 1]
    assert all(s.value == 0 for s in series if s.labels["state"] != up)
    return up


@pytest.fixture
async def stack(etcd: EtcdServer) -> AsyncIterator[Stack]:
    s = Stack(etcd.url)
    s.start_agents()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def ports() -> AsyncIterator[ReadPorts]:
    p = ReadPorts()
    yield p
    await p.close()


async def _leading(stack: Stack, ports: ReadPorts) -> tuple[Controller, str]:
    await stack.controller("ctl-a")
    leader = await stack.leader()
    return leader, await ports.serve(stack.runners["ctl-a"])


# -- the regions ---------------------------------------------------------------------------------


async def test_the_region_series_flip_when_a_region_fails(stack: Stack, ports: ReadPorts) -> None:
    _, url = await _leading(stack, ports)
    m = await scrape(url)
    assert m.value("meridian_controller_build_info", version=version.version()) == 1
    assert m.value("meridian_controller_leader") == 1
    assert m.value("meridian_controller_etcd_connected") == 1
    assert m.value("meridian_controller_elections_total", kind="new") == 1
    for region in ("eu-west", "eu-north", "us-east"):
        assert state_of(m, region) == "healthy"
        assert m.value("meridian_controller_region_weight", region=region) == 1
        assert m.value("meridian_controller_region_strikes", region=region) == 0
        assert m.value("meridian_controller_region_capacity", region=region) == 4
    assert m.value("meridian_controller_region_backup", region="eu-west", backup="eu-north") == 1
    assert len(m.find("meridian_controller_region_backup", region="eu-west")) == 1
    # the floors are those the leader wrote: eu-north keeps half of what it protects warm
    for region in ("eu-west", "eu-north", "us-east"):
        entry = await stack.store.get(keys.desired(region))
        assert entry is not None
        floor = RegionDesired.model_validate_json(entry.value).capacity_floor
        assert m.value("meridian_controller_region_capacity_floor", region=region) == floor
    assert (m.value("meridian_controller_region_capacity_floor", region="eu-north") or 0) >= 2
    assert (m.value("meridian_controller_window_duration_seconds_count") or 0) >= 2
    assert (m.value("meridian_controller_window_lateness_seconds_count") or 0) >= 2
    assert zeros(m.find("meridian_controller_failovers_total"))

    stack.up["eu-west"] = False  # its agent dies: liveness gone, status goes stale
    await stack.store.delete(keys.alive("eu-west"))

    def suspect(m: Scrape) -> bool:
        return state_of(m, "eu-west") == "suspect"

    m = await until_scraped(url, suspect, 10, "eu-west suspect")
    assert 1 <= (m.value("meridian_controller_region_strikes", region="eu-west") or 0) < 3
    m = await until_scraped(url, lambda m: state_of(m, "eu-west") == "failed", 10, "failed")
    assert m.value("meridian_controller_region_state", region="eu-west", state="healthy") == 0
    assert m.value("meridian_controller_region_strikes", region="eu-west") == 3
    assert m.value("meridian_controller_region_weight", region="eu-west") == 0
    assert state_of(m, "eu-north") == "healthy"
    assert m.value("meridian_controller_failovers_total", region="eu-west", cause="health") == 1
    assert zeros(m.find("meridian_controller_failovers_total", region="eu-north"))

    stack.up["eu-west"] = True  # back: good windows, then the ramp to healthy

    def recovered(m: Scrape) -> bool:
        return state_of(m, "eu-west") == "healthy"

    m = await until_scraped(url, recovered, 20, "eu-west healthy again")
    # the ramp: one recovery event per weight step (0.05, 0.25, 0.5, 1), all earned by windows
    assert m.value("meridian_controller_recoveries_total", region="eu-west", cause="health") == 4
    assert m.value("meridian_controller_failovers_total", region="eu-west", cause="health") == 1
    check_documented(m, "meridian_controller_")


async def test_agents_alive_and_the_regions_serving_each_geography(
    stack: Stack, ports: ReadPorts
) -> None:
    """``region_agents_alive`` counts the liveness keys the pass read; ``geo_regions`` the
    members of each geography and the regions its plan in force serves it from."""
    _, url = await _leading(stack, ports)

    def geo(m: Scrape, name: str) -> dict[str, float]:
        return {s.labels["which"]: s.value for s in m.find("meridian_controller_geo_regions",
                                                              geo=name)}  # fmt: skip

    m = await scrape(url)
    for region in ("eu-west", "eu-north", "us-east"):
        assert m.value("meridian_controller_region_agents_alive", region=region) == 1
    assert geo(m, "eu") == {"member": 2, "serving": 2}
    assert geo(m, "us") == {"member": 1, "serving": 1}

    stack.up["eu-west"] = False  # its agent dies: liveness gone at once, then failed
    await asyncio.sleep(0.5)  # a put the stand-in agent had begun lands before the delete
    await stack.store.delete(keys.alive("eu-west"))
    m = await until_scraped(
        url,
        lambda m: m.value("meridian_controller_region_agents_alive", region="eu-west") == 0,
        10,
        "eu-west without a live agent",
    )
    assert m.value("meridian_controller_region_agents_alive", region="eu-north") == 1
    m = await until_scraped(url, lambda m: state_of(m, "eu-west") == "failed", 10, "failed")
    assert geo(m, "eu") == {"member": 2, "serving": 1}  # eu-north alone: its last region
    assert geo(m, "us") == {"member": 1, "serving": 1}
    check_documented(m, "meridian_controller_")

    stack.up["eu-west"] = True
    m = await until_scraped(url, lambda m: geo(m, "eu").get("serving") == 2, 20, "eu on two")
    assert m.value("meridian_controller_region_agents_alive", region="eu-west") == 1


async def test_admin_actions_are_counted_by_verb_and_result(stack: Stack, ports: ReadPorts) -> None:
    _, url = await _leading(stack, ports)
    assert zeros((await scrape(url)).find("meridian_controller_admin_actions_total"))
    async with httpx.AsyncClient(base_url=stack.url("ctl-a"), timeout=10) as admin:

        async def post(path: str, status: int) -> None:
            r = await admin.post(path, json={"reason": "metrics test"}, headers=OPERATOR)
            assert r.status_code == status, r.text

        await post("/v1/regions/eu-west/drain?dry_run=true", 200)
        await post("/v1/regions/eu-west/undrain", 409)  # not drained: refused
        await post("/v1/regions/eu-west/failover", 200)
        m = await scrape(url)
        assert state_of(m, "eu-west") == "failed"
        assert m.value("meridian_controller_region_backup", region="eu-west", backup="eu-north")
        assert m.value("meridian_controller_failovers_total", region="eu-west", cause="manual") == 1
        actions = {
            (s.labels["verb"], s.labels["result"]): s.value
            for s in m.find("meridian_controller_admin_actions_total")
            if s.value
        }
        assert len(m.find("meridian_controller_admin_actions_total")) == 25  # 5 verbs x 5 results
        assert actions == {("drain", "dry-run"): 1, ("undrain", "refused"): 1,
                           ("failover", "applied"): 1}  # fmt: skip

        # held by the operator while its windows are good: a failback with enough good
        # windows starts the ramp at once, a recovery caused by the failback
        async def good_windows() -> bool:  # the plan has them (regions/<r>/health lags)
            entry = await stack.store.get(keys.PLAN)
            assert entry is not None
            verdicts = FleetPlan.model_validate_json(entry.value).state["verdicts"]
            return bool(verdicts["eu-west"]["good_windows"] >= 2)

        await _until(good_windows, 10, "two good windows")
        await post("/v1/regions/eu-west/failback", 200)
        m = await scrape(url)
        assert (
            m.value("meridian_controller_recoveries_total", region="eu-west", cause="failback") == 1
        )
        assert m.value("meridian_controller_admin_actions_total", verb="failback",
                       result="applied") == 1  # fmt: skip
        assert zeros(m.find("meridian_controller_failovers_total", cause="health"))
        check_documented(m, "meridian_controller_")


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# -- the replicas --------------------------------------------------------------------------------


async def test_leader_is_1_on_the_leader_only_and_moves_with_leadership(
    stack: Stack, ports: ReadPorts
) -> None:
    await stack.controller("ctl-a")
    await stack.controller("ctl-b")
    leader = await stack.leader()
    lead = leader.election.identity
    follow = "ctl-b" if lead == "ctl-a" else "ctl-a"
    urls = {name: await ports.serve(stack.runners[name]) for name in (lead, follow)}
    m_lead, m_follow = await scrape(urls[lead]), await scrape(urls[follow])
    assert m_lead.value("meridian_controller_leader") == 1
    assert m_follow.value("meridian_controller_leader") == 0
    assert m_lead.value("meridian_controller_elections_total", kind="new") == 1
    assert zeros(m_follow.find("meridian_controller_elections_total"))
    for m in (m_lead, m_follow):
        assert m.value("meridian_controller_etcd_connected") == 1
        assert m.value("meridian_controller_build_info", version=version.version()) == 1
    # the region series come from the replica that judges the windows
    assert state_of(m_lead, "eu-west") == "healthy"
    assert m_follow.find("meridian_controller_region_state") == []
    assert m_follow.find("meridian_controller_window_duration_seconds_count") == []
    assert (m_lead.value("meridian_controller_window_duration_seconds_count") or 0) >= 2

    # a clean stop (its read port with it) resigns: the follower leads at once
    await stack.runners.pop(lead).cleanup()

    def leads(m: Scrape) -> bool:
        return m.value("meridian_controller_leader") == 1

    m = await until_scraped(urls[follow], leads, 10, f"{follow} to lead")
    assert m.value("meridian_controller_elections_total", kind="new") == 1
    m = await until_scraped(
        urls[follow], lambda m: state_of(m, "eu-west") == "healthy", 10, "its first window"
    )
    assert m.value("meridian_controller_region_backup", region="eu-west", backup="eu-north") == 1


async def test_etcd_reachability_and_errors(fresh_etcd: EtcdServer, ports: ReadPorts) -> None:
    stack = Stack(fresh_etcd.url)
    stack.start_agents()
    again: EtcdServer | None = None
    try:
        _, url = await _leading(stack, ports)
        m = await scrape(url)
        assert m.value("meridian_controller_etcd_connected") == 1
        assert zeros(m.find("meridian_controller_etcd_errors_total", kind="unavailable"))
        fresh_etcd.process.kill()

        def down(m: Scrape) -> bool:
            return m.value("meridian_controller_etcd_connected") == 0

        m = await until_scraped(url, down, 15, "etcd_connected 0")
        assert (m.value("meridian_controller_etcd_errors_total", kind="unavailable") or 0) >= 1
        again = relaunch(fresh_etcd)
        m = await until_scraped(
            url, lambda m: m.value("meridian_controller_etcd_connected") == 1, 20, "etcd back"
        )
        check_documented(m, "meridian_controller_")
    finally:
        await stack.close()
        if again is not None:
            again.process.stop()


# -- DNS ----------------------------------------------------------------------------------------


@pytest.fixture
async def dns_stack(etcd: EtcdServer, bind: BindServer) -> AsyncIterator[DnsStack]:
    s = DnsStack(etcd, bind)
    yield s
    await s.close()


async def test_dns_apply_time_advances_and_generations_follow_the_plan(
    dns_stack: DnsStack, bind: BindServer, ports: ReadPorts
) -> None:
    controller = await dns_stack.start()
    assert dns_stack.runner is not None
    url = await ports.serve(dns_stack.runner)
    assert dns_stack.runner.app is not None and dns_stack.runner.app[CONTROLLER] is controller

    async def eu_answer(want: str) -> bool:
        return await answer(bind, EU, API, "A") == {want}

    await _until(lambda: eu_answer(EU_ADDRESS), 15, "the eu answer")

    def applied(m: Scrape) -> bool:
        return m.value("meridian_controller_dns_last_apply_timestamp_seconds") is not None

    m = await until_scraped(url, applied, 5, "a DNS pass")
    first = m.value("meridian_controller_dns_last_apply_timestamp_seconds")
    assert first is not None and abs(first - time.time()) < 10

    def later(m: Scrape) -> bool:
        at = m.value("meridian_controller_dns_last_apply_timestamp_seconds")
        return at is not None and at > first

    m = await until_scraped(url, later, 5, "the apply time to advance")  # every window's pass

    def generations(m: Scrape) -> dict[tuple[str, str], float]:
        return {
            (s.labels["view"], s.labels["which"]): s.value
            for s in m.find("meridian_controller_dns_generation")
        }

    before = generations(m)
    assert set(before) == {(v, w) for v in ("geo-a", "default") for w in ("desired", "applied")}
    assert before[("geo-a", "desired")] == before[("geo-a", "applied")]

    await dns_stack.kill_agent("eu-west")  # failed after three windows: eu is told us-east
    await _until(lambda: eu_answer(US_ADDRESS), 15, "the eu answer to flip")

    def caught_up(m: Scrape) -> bool:
        g = generations(m)
        return (
            g[("geo-a", "desired")] > before[("geo-a", "desired")]
            and g[("geo-a", "applied")] == g[("geo-a", "desired")]
        )

    await until_scraped(url, caught_up, 5, "geo-a's applied generation to catch up")

    bind.process.stop()  # the server is down: passes fail, the apply time stands still

    def failing(m: Scrape) -> bool:
        return bool(m.value("meridian_controller_dns_update_errors_total", kind="unavailable"))

    m = await until_scraped(url, failing, 10, "a DNS error counted")
    stuck = m.value("meridian_controller_dns_last_apply_timestamp_seconds")
    await asyncio.sleep(4 * 0.4)
    m = await scrape(url)
    assert m.value("meridian_controller_dns_last_apply_timestamp_seconds") == stuck
    assert (m.value("meridian_controller_dns_update_errors_total", kind="unavailable") or 0) >= 2
    assert zeros(m.find("meridian_controller_dns_update_errors_total", kind="refused"))
    check_documented(m, "meridian_controller_")


def test_the_reference_documents_exactly_the_controllers_series() -> None:
    """docs/observability.md's controller table against the names controlplane/observability.py
    creates (the scrapes above check types and labels of those they see)."""
    rows = {base(name) for name in documented("meridian_controller_")}
    source = ROOT / "controlplane" / "observability.py"
    assert rows == instrument_names(source, "meridian_controller_")


async def test_the_admin_port_has_no_metrics(stack: Stack, ports: ReadPorts) -> None:
    """One scrape target per replica: the read port.  The admin port (operators' writes, maybe
    over TLS) answers /metrics like any unknown path."""
    _, url = await _leading(stack, ports)
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(f"{stack.url('ctl-a')}/metrics")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem")
    assert (await scrape(url)).value("meridian_controller_leader") == 1
