"""Spill-over between regions, end to end on loopback: real agents over real simulated nodes,
real etcd, and the controller's window passes writing the plan the agents read.

eu-west serves models A and B, eu-central A only, us-east A and B (outside the eu).  eu-west
saturated on A forwards what it cannot start soon to eu-central and the client sees no 429; a
request for B that reaches eu-central (which does not serve it) is forwarded to eu-west; nothing
ever goes to us-east (residency), nothing is forwarded twice, and a region that fails forwards is
ejected from spill-over like a failing node.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

import meridian_etcd
from controlplane.reconcile import windows
from controlplane.settings import ControllerSettings
from meridian_service.clock import WallClock
from meridian_wire import keys
from meridian_wire.models import Event
from tests.conftest import NodeFactory
from tests.support import EtcdServer
from tests.support.agent import AgentFactory, AgentHandle, metric
from tests.support.ports import free_port

WINDOW_S = 0.5
FLEET = {
    "eu-west": ("eu", ["eu"], ["A", "B"]),
    "eu-central": ("eu", ["eu"], ["A"]),
    "us-east": ("us", [], ["A", "B"]),
}
SPILL = {"enabled": True, "queue_depth": 1, "latency_budget_ms": 100.0}


def _controller(etcd: EtcdServer) -> ControllerSettings:
    return ControllerSettings(
        etcd={"endpoints": [etcd.url]},
        failover={
            "window_s": WINDOW_S, "strikes": 2, "min_hold_s": 0.0,
            "agent_heartbeat_s": 1.0, "status_stale_s": 3.0,
        },
        regions=[
            {"id": r, "geo": geo, "residency": residency}
            for r, (geo, residency, _) in FLEET.items()
        ],
    )  # type: ignore[arg-type]  # fmt: skip


def _region(etcd: EtcdServer, region: str, endpoint: str) -> dict[str, Any]:
    geo, residency, _ = FLEET[region]
    return {
        "id": region, "geo": geo, "residency": residency, "etcd": [etcd.url],
        "endpoints": [endpoint], "agent_id": f"{region}-a1",
        "lease_ttl_s": 2, "window_s": 1.0, "min_interval_s": 0.1, "load_min_interval_s": 0.5,
        "retry_base_s": 0.1, "retry_max_s": 0.5, "etcd_timeout_s": 1.0,
    }  # fmt: skip


@dataclass
class Fleet:
    agents: dict[str, AgentHandle]
    controller: asyncio.Task[None]


async def _plan_loop(store: meridian_etcd.Store, settings: ControllerSettings) -> None:
    while True:
        await windows.reconcile_once(store=store, fence=None, settings=settings, clock=WallClock())
        await asyncio.sleep(WINDOW_S)


async def _start(
    store: meridian_etcd.Store,
    etcd: EtcdServer,
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    *,
    endpoints: dict[str, str] | None = None,
    queues: dict[str, dict[str, Any]] | None = None,
) -> Fleet:
    """The three regions, each agent publishing its own address (unless ``endpoints`` names
    another), and the controller's window passes running in the background until every agent
    has a plan that knows every region."""
    agents = {}
    for region, (_, _, models) in FLEET.items():
        port = free_port()
        endpoint = (endpoints or {}).get(region, f"http://127.0.0.1:{port}")
        nodes = [await sim_node(model=m, seed=i, time_scale=10.0) for i, m in enumerate(models)]
        agents[region] = await start_agent(
            nodes,
            port=port,
            region=_region(etcd, region, endpoint),
            spill=SPILL,
            queue=(queues or {}).get(region, {}),
        )
    task = asyncio.create_task(_plan_loop(store, _controller(etcd)))
    west = agents["eu-west"].edge.spill
    for _ in range(200):
        spills = [a.edge.spill for a in agents.values()]
        if all(s is not None and all(s.knows(r) for r in FLEET) for s in spills) and (
            west is not None
            and west.choose("A", tags=frozenset(), home_wait_ms=float("inf"), now=0.0).targets
        ):
            break
        await asyncio.sleep(0.1)
    else:
        task.cancel()
        raise AssertionError("the agents never read a plan naming every region")
    return Fleet(agents=agents, controller=task)


@pytest.fixture
async def fleet(
    store: meridian_etcd.Store, etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> AsyncIterator[Fleet]:
    # eu-west: one slot per node and room for one waiting request: eight at once saturate it
    started = await _start(
        store,
        etcd,
        sim_node,
        start_agent,
        queues={"eu-west": {"slots_per_node": 1, "max_depth": 1}},
    )
    yield started
    started.controller.cancel()


async def _chat(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    *,
    stream: bool = False,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello from a saturated region"}],
        "max_tokens": 24,
        "stream": stream,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.text()


async def test_eu_west_saturated_on_a_spills_to_eu_central_with_no_429(
    fleet: Fleet, store: meridian_etcd.Store
) -> None:
    west, central, east = (fleet.agents[r] for r in ("eu-west", "eu-central", "us-east"))
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(_chat(session, west.url, "A") for _ in range(8)))
        streamed = await asyncio.gather(
            *(_chat(session, west.url, "A", stream=True) for _ in range(6))
        )
    statuses = [status for status, _, _ in answers + streamed]
    assert statuses == [200] * 14, [text for _, _, text in answers + streamed]
    served_by = [h.get("X-Meridian-Spilled-To", "eu-west") for _, h, _ in answers + streamed]
    assert "eu-central" in served_by and "eu-west" in served_by
    assert set(served_by) <= {"eu-west", "eu-central"}  # never us-east: residency eu
    for _, headers, text in streamed:  # one stream per client, spilled or not
        assert headers["Content-Type"].startswith("text/event-stream")
        assert text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in text
    spilled = served_by.count("eu-central")
    assert (
        await metric(
            west.url,
            "meridian_agent_spills_total",
            to="eu-central",
            cause="queue",
            outcome="served",
        )
        == spilled
    )
    assert await metric(central.url, "meridian_agent_spilled_in_total", **{"from": "eu-west"}) == (
        spilled
    )
    assert await metric(east.url, "meridian_agent_spilled_in_total") == 0
    assert await metric(west.url, "meridian_agent_requests_total", status="429") == 0
    # eu-west's status says it spills, and the controller's window pass makes it an event
    for _ in range(100):
        events = [
            Event.model_validate_json(e.value)
            for e in (await store.get_prefix(keys.EVENTS)).entries
        ]
        spills = [e for e in events if e.kind == "spill" and e.region == "eu-west"]
        if spills:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("no spill event for eu-west")
    assert spills[0].data["spilling"] is True
    assert spills[0].reason.startswith("spilling ")
    assert not [e for e in events if e.kind == "spill" and e.region != "eu-west"]


async def test_without_spill_over_the_same_burst_gets_429s(
    store: meridian_etcd.Store, etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """The control: the same region and burst with spill-over off refuses most of it."""
    node = await sim_node(model="A", time_scale=10.0)
    west = await start_agent([node], queue={"slots_per_node": 1, "max_depth": 1})
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(_chat(session, west.url, "A") for _ in range(8)))
    assert sorted(status for status, _, _ in answers).count(429) >= 4


async def test_a_model_not_served_here_goes_to_a_region_that_serves_it(fleet: Fleet) -> None:
    central = fleet.agents["eu-central"]
    async with aiohttp.ClientSession() as session:
        status, headers, text = await _chat(session, central.url, "B")
        assert status == 200, text
        assert headers["X-Meridian-Spilled-To"] == "eu-west"  # not us-east: residency eu
        assert json.loads(text)["choices"][0]["message"]["content"]
        # one hop: a request already forwarded once is served here or refused, never sent on
        status, headers, text = await _chat(
            session, central.url, "B", headers={"X-Meridian-Spilled-From": "eu-west"}
        )
        assert status == 404 and "X-Meridian-Spilled-To" not in headers
        assert "does not exist" in json.loads(text)["error"]["message"]
        # a residency tag no region meets keeps the request here
        status, _, text = await _chat(
            session, central.url, "B", headers={"X-Meridian-Residency": "de"}
        )
        assert status == 404, text
        status, _, text = await _chat(
            session, central.url, "B", headers={"X-Meridian-Residency": "EU!"}
        )
        assert status == 400
        assert "X-Meridian-Residency" in json.loads(text)["error"]["message"]
    assert (
        await metric(
            central.url,
            "meridian_agent_spills_total",
            to="eu-west",
            cause="model",
            outcome="served",
        )
        == 1
    )
    assert (
        await metric(
            central.url, "meridian_agent_spills_total", to="none", cause="model", outcome="none"
        )
        == 1
    )


async def test_a_region_that_fails_forwards_is_ejected_and_requests_stay_home(
    store: meridian_etcd.Store, etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """eu-west publishes an endpoint nothing listens on (a broken load balancer): eu-central's
    forwards of B fail to connect, count against eu-west, and eject it after three."""
    dead = f"http://127.0.0.1:{free_port()}"
    started = await _start(store, etcd, sim_node, start_agent, endpoints={"eu-west": dead})
    try:
        central = started.agents["eu-central"]
        async with aiohttp.ClientSession() as session:
            for _ in range(4):
                status, _, text = await _chat(session, central.url, "B")
                assert status == 404, text  # the forward failed: the client gets home's answer
        assert (
            await metric(central.url, "meridian_agent_spills_total", to="eu-west", outcome="failed")
            == 3
        )
        spill = central.edge.spill
        assert spill is not None
        assert spill.states(central.edge.clock.now()) == {"eu-west": "ejected"}
        assert (
            await metric(
                central.url, "meridian_agent_spills_total", to="none", cause="model", outcome="none"
            )
            == 1
        )  # the fourth: eu-west ejected, nowhere else serves B in the eu
    finally:
        started.controller.cancel()


async def test_a_client_that_leaves_a_spilled_stream_cancels_it_in_the_other_region(
    fleet: Fleet,
) -> None:
    """Cancellation crosses the hop: closing the client's stream closes the forward, which the
    other region's agent sees as a client gone (499) and passes on to its node."""
    central, west = fleet.agents["eu-central"], fleet.agents["eu-west"]
    body = {
        "model": "B",
        "messages": [{"role": "user", "content": "a long answer, please"}],
        "max_tokens": 400,
        "stream": True,
    }
    url = f"{central.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
        assert r.status == 200
        assert r.headers["X-Meridian-Spilled-To"] == "eu-west"
        assert (await r.content.readline()).startswith(b"data: ")
    # leaving the block closed the connection mid-stream
    for _ in range(100):
        if await metric(west.url, "meridian_agent_requests_total", status="499") == 1:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("eu-west never saw the forwarded stream cancelled")
    assert await metric(central.url, "meridian_agent_requests_total", status="499") == 1
