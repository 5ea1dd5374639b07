"""DNS node discovery against a real BIND9 (tests/support/bind.py) and real simulated nodes:
records changed by RFC 2136 updates (signed with TSIG, as the controller writes them) come and
go from the agent's pool, a leaving node drains, and a DNS server that is down, or an empty
answer, changes nothing.

A records give one port for every address, so those nodes listen on 127.0.0.2, 127.0.0.3, ...
at one port (Linux routes all of 127.0.0.0/8 to lo); SRV nodes listen on 127.0.0.1 at ports of
their own.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import dns.asyncquery
import dns.rcode
import dns.update
import pydantic
import pytest

from meridian_sim import node as sim
from meridian_sim import profile
from policies.discovery import endpoint
from regional_agent.app import DISCOVERY
from regional_agent.discovery import Discovery
from regional_agent.settings import NodeSettings, Settings
from tests.conftest import NodeFactory
from tests.support import BindServer, relaunch_bind, until
from tests.support.agent import ADMIN, AgentFactory, AgentHandle, metric, openai_client

MODEL = "tiny-model"
LOGGER = "regional_agent.discovery"
SimAt = Callable[..., Awaitable[int]]


# -- helpers --------------------------------------------------------------------------------------


def _name(bind: BindServer, prefix: str = "llm") -> str:
    """A name of this test's own in the zone (the session's named is shared)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}.{bind.zone}"


async def _update(bind: BindServer, *changes: tuple[str, str, str, str | None]) -> None:
    """One RFC 2136 update of the default view, signed with its TSIG key: ``("add", name,
    rdtype, rdata)`` or ``("delete", name, rdtype, rdata or None for the whole set)``."""
    key = bind.view("default").key.tsig_key()
    update = dns.update.UpdateMessage(bind.zone, keyring={key.name: key})
    for op, name, rdtype, rdata in changes:
        if op == "add":
            assert rdata is not None
            update.add(name, 1, rdtype, rdata)
        elif rdata is None:
            update.delete(name, rdtype)
        else:
            update.delete(name, rdtype, rdata)
    response = await dns.asyncquery.tcp(update, bind.host, port=bind.port, timeout=5)
    assert response.rcode() == dns.rcode.NOERROR, dns.rcode.to_text(response.rcode())


def _source(bind: BindServer, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "nameservers": [f"{bind.host}:{bind.port}"],
        "interval_s": 0.2,
        "timeout_s": 0.5,
        **extra,
    }


async def _nodes(agent: AgentHandle) -> dict[str, dict[str, Any]]:
    """``GET /admin/nodes`` keyed by node id."""
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{agent.url}/admin/nodes", headers=ADMIN) as r,
    ):
        assert r.status == 200
        body = await r.json()
    return {n["id"]: n for n in body["nodes"]}


async def _until_nodes(
    agent: AgentHandle, want: Callable[[dict[str, dict[str, Any]]], bool], what: str
) -> dict[str, dict[str, Any]]:
    """Poll ``GET /admin/nodes`` until ``want`` holds (15 s)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 15.0
    while True:
        nodes = await _nodes(agent)
        if want(nodes):
            return nodes
        assert loop.time() < end, f"timed out waiting for {what}; nodes: {sorted(nodes)}"
        await asyncio.sleep(0.05)


def _routable(node_id: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    """The node is in the pool, active and knows its model."""
    return lambda nodes: node_id in nodes and nodes[node_id]["models"] == [MODEL]


async def _served(url: str) -> float:
    """Requests the node itself says it finished."""
    return await metric(url, "vllm:request_success_total")


def _discovery(agent: AgentHandle) -> Discovery:
    return agent.app[DISCOVERY]


async def _rounds_after(agent: AgentHandle, name: str, rounds: int) -> None:
    """Wait until the source has done ``rounds`` more resolutions than now."""
    found = _discovery(agent)
    target = found.resolutions(name.rstrip(".")) + rounds
    await until(lambda: found.resolutions(name.rstrip(".")) >= target, 15.0, f"{rounds} rounds")


@pytest.fixture
async def sim_at() -> AsyncIterator[SimAt]:
    """``port = await sim_at("127.0.0.2", port=0)``: a simulated node on that address."""
    runners = []

    async def start(host: str, port: int = 0, *, time_scale: float = 0.2) -> int:
        prof = profile.load("cpu-tiny")
        config = sim.NodeConfig(profile=prof, model=prof.model, time_scale=time_scale)
        runner, bound = await sim.start(sim.create_app(config), host=host, port=port)
        runners.append(runner)
        return bound

    yield start
    for runner in runners:
        await runner.cleanup()


async def _complete(agent: AgentHandle, n: int = 1) -> None:
    async with openai_client(agent.url) as client:
        for _ in range(n):
            reply = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert reply.choices[0].text


# -- A records: added, routed to, drained, removed ------------------------------------------------


async def test_a_records_come_in_take_traffic_and_a_leaving_node_drains_its_stream(
    bind_server: BindServer, start_agent: AgentFactory, sim_at: SimAt
) -> None:
    bind, name = bind_server, _name(bind_server)
    port = await sim_at("127.0.0.2")
    await sim_at("127.0.0.3", port)
    first, second = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    await _update(bind, ("add", name, "A", "127.0.0.2"))
    agent = await start_agent(
        [], policy="weighted", discovery={"dns": [_source(bind, name, port=port)]}
    )
    source = f"dns:{name.rstrip('.')}"

    nodes = await _until_nodes(agent, _routable(first), "the first answer's node")
    assert nodes[first]["source"] == source
    assert nodes[first]["url"] == f"http://127.0.0.2:{port}"
    assert nodes[first]["health"]["slow_start"] == 1.0  # the fleet as it was serving: warm

    await _update(bind, ("add", name, "A", "127.0.0.3"))
    nodes = await _until_nodes(agent, _routable(second), "the added record's node")
    assert nodes[second]["source"] == source
    assert nodes[second]["health"]["slow_start"] < 1.0  # a new node ramps up
    assert nodes[second]["health"]["reason"] == "new node, slow start"

    # requests reach the new node: it says so itself
    second_url = f"http://127.0.0.3:{port}"
    loop = asyncio.get_running_loop()
    end = loop.time() + 30.0
    while await _served(second_url) == 0:
        assert loop.time() < end, "no request reached the discovered node"
        await _complete(agent)

    # a long stream; the node it is on leaves DNS while it runs
    async with openai_client(agent.url) as client:
        stream = await client.completions.create(
            model=MODEL,
            prompt="a long story",
            max_tokens=150,
            stream=True,
            extra_body={"ignore_eos": True},  # all 150 tokens: about 4 s at this time scale
        )
        nodes = await _until_nodes(
            agent, lambda ns: any(n["in_flight"] == 1 for n in ns.values()), "the stream"
        )
        (busy,) = [i for i, n in nodes.items() if n["in_flight"] == 1]
        (idle,) = [i for i in nodes if i != busy]
        await _update(bind, ("delete", name, "A", busy.split(":")[0]))
        nodes = await _until_nodes(agent, lambda ns: ns[busy]["admin"] != "active", "the drain")
        assert nodes[busy]["admin"] == "draining"  # still running its stream, still listed
        assert nodes[busy]["in_flight"] == 1
        requests_before = nodes[busy]["requests_total"]
        await _complete(agent, 4)  # new requests: the other node only
        nodes = await _nodes(agent)
        assert nodes[busy]["requests_total"] == requests_before
        assert nodes[idle]["admin"] == "active"

        text, finish = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"  # the whole stream, not cut
    assert sum(1 for t in text if t) == 150

    nodes = await _until_nodes(agent, lambda ns: busy not in ns, "the drained node to leave")
    assert set(nodes) == {idle}
    assert await metric(agent.url, "meridian_agent_nodes", source=source) == 1
    await _complete(agent, 2)


# -- SRV ------------------------------------------------------------------------------------------


async def test_srv_targets_and_ports_are_nodes_and_a_removed_record_leaves(
    bind_server: BindServer, start_agent: AgentFactory, sim_node: NodeFactory
) -> None:
    bind, base = bind_server, _name(bind_server, "svc")
    service = f"_http._tcp.{base}"
    urls = [await sim_node(time_scale=20.0, seed=i) for i in range(2)]
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    await _update(
        bind,
        ("add", f"n1.{base}", "A", "127.0.0.1"),
        ("add", f"n2.{base}", "A", "127.0.0.1"),
        ("add", service, "SRV", f"0 0 {ports[0]} n1.{base}"),
        ("add", service, "SRV", f"0 0 {ports[1]} n2.{base}"),
        ("add", service, "SRV", f"0 0 9 gone.{base}"),  # a target without address: no node
        ("add", service, "SRV", f"0 0 0 n1.{base}"),  # port 0: no service there
    )
    agent = await start_agent([], discovery={"dns": [_source(bind, service, record="SRV")]})
    ids = [f"127.0.0.1:{p}" for p in ports]
    nodes = await _until_nodes(
        agent, lambda ns: all(_routable(i)(ns) for i in ids), "both SRV targets"
    )
    assert set(nodes) == set(ids)
    assert {n["source"] for n in nodes.values()} == {f"dns:{service.rstrip('.')}"}
    await _complete(agent, 3)

    await _update(bind, ("delete", service, "SRV", f"0 0 {ports[1]} n2.{base}"))
    nodes = await _until_nodes(agent, lambda ns: ids[1] not in ns, "the removed target to leave")
    assert set(nodes) == {ids[0]}
    served = await _served(urls[0])
    await _complete(agent, 2)
    assert await _served(urls[0]) == served + 2


# -- static nodes are never discovery's -----------------------------------------------------------


async def test_a_static_node_is_never_drained_or_removed_by_discovery(
    bind_server: BindServer, start_agent: AgentFactory, sim_at: SimAt
) -> None:
    bind, name = bind_server, _name(bind_server)
    port = await sim_at("127.0.0.2", time_scale=20.0)
    await sim_at("127.0.0.3", port, time_scale=20.0)
    await sim_at("127.0.0.4", port, time_scale=20.0)
    static, found, later = (f"127.0.0.{i}:{port}" for i in (2, 3, 4))
    await _update(bind, ("add", name, "A", "127.0.0.2"), ("add", name, "A", "127.0.0.3"))
    agent = await start_agent(
        [f"http://127.0.0.2:{port}"], discovery={"dns": [_source(bind, name, port=port)]}
    )
    nodes = await _until_nodes(agent, _routable(found), "the discovered node")
    assert nodes[static]["source"] == "static"  # the same address in DNS: still the static one

    # the static node's address leaves DNS, another comes in the same update
    await _update(bind, ("delete", name, "A", "127.0.0.2"), ("add", name, "A", "127.0.0.4"))
    nodes = await _until_nodes(agent, _routable(later), "the answer without the static node")
    await _rounds_after(agent, name, 2)
    nodes = await _nodes(agent)
    assert nodes[static]["admin"] == "active"
    assert nodes[static]["source"] == "static"
    assert {nodes[found]["source"], nodes[later]["source"]} == {f"dns:{name.rstrip('.')}"}


# -- fail static ----------------------------------------------------------------------------------


async def test_a_dead_dns_server_changes_nothing_and_is_counted_and_logged_once(
    bind: BindServer,
    start_agent: AgentFactory,
    sim_at: SimAt,
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = _name(bind)
    port = await sim_at("127.0.0.2", time_scale=20.0)
    await sim_at("127.0.0.3", port, time_scale=20.0)
    first, second = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    await _update(bind, ("add", name, "A", "127.0.0.2"))
    caplog.set_level(logging.INFO, logger=LOGGER)
    agent = await start_agent(
        [], discovery={"dns": [_source(bind, name, port=port, timeout_s=0.2)]}
    )
    await _until_nodes(agent, _routable(first), "the discovered node")
    source = f"dns:{name.rstrip('.')}"

    bind.process.kill()
    failures = "meridian_agent_discovery_failures_total"
    deadline = asyncio.get_running_loop().time() + 20.0
    while await metric(agent.url, failures, source=source, cause="timeout") < 4:
        assert asyncio.get_running_loop().time() < deadline, "no timeouts counted"
        await asyncio.sleep(0.1)
    nodes = await _nodes(agent)
    assert set(nodes) == {first}
    assert nodes[first]["admin"] == "active"
    await _complete(agent, 2)  # still served
    warnings = [
        r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]  # at most one a minute per name, however many rounds failed
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "cause=timeout" in warnings[0].getMessage()

    again = relaunch_bind(bind)  # same port, zone and journal
    try:
        await _update(again, ("add", name, "A", "127.0.0.3"))
        await _until_nodes(agent, _routable(second), "discovery to work again")
        assert first in await _nodes(agent)
    finally:
        again.process.stop()
    assert any("answering again" in r.getMessage() for r in caplog.records if r.name == LOGGER)


@pytest.mark.parametrize("empty", ["nxdomain", "nodata"])
async def test_an_empty_answer_keeps_the_nodes_unless_empty_after_says_otherwise(
    bind_server: BindServer, start_agent: AgentFactory, sim_at: SimAt, empty: str
) -> None:
    bind, name = bind_server, _name(bind_server)
    port = await sim_at("127.0.0.2", time_scale=20.0)
    node_id = f"127.0.0.2:{port}"
    await _update(bind, ("add", name, "A", "127.0.0.2"))
    if empty == "nodata":  # the name stays, with no A record: NOERROR and no answer
        await _update(bind, ("add", name, "TXT", '"kept"'))
    keeps = await start_agent([], discovery={"dns": [_source(bind, name, port=port)]})
    follows = await start_agent(
        [], discovery={"dns": [_source(bind, name, port=port, empty_after=2)]}
    )
    for agent in (keeps, follows):
        await _until_nodes(agent, _routable(node_id), "the discovered node")

    await _update(bind, ("delete", name, "A", None))
    await _until_nodes(follows, lambda ns: not ns, "empty_after=2: the node drained and removed")
    source = f"dns:{name.rstrip('.')}"
    deadline = asyncio.get_running_loop().time() + 15.0
    while await metric(keeps.url, "meridian_agent_discovery_failures_total", cause=empty) < 4:
        assert asyncio.get_running_loop().time() < deadline, f"no {empty} answers counted"
        await asyncio.sleep(0.1)
    nodes = await _nodes(keeps)  # the default: the last good set stays
    assert set(nodes) == {node_id}
    assert nodes[node_id]["admin"] == "active"
    assert await metric(keeps.url, "meridian_agent_nodes", source=source) == 1
    await _complete(keeps)


@pytest.mark.parametrize("address", ["10.0.0.5", "fd00::5"])
def test_a_discovered_endpoint_has_the_id_of_a_static_node_at_its_url(address: str) -> None:
    node_id, url = endpoint("http", address, 8000)
    assert node_id == NodeSettings(url=url).node_id  # so a static node wins over DNS


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "vllm.example.com"}, "port is required with record = 'A'"),
        ({"name": "_http._tcp.x.example", "record": "SRV", "port": 80}, "port is taken from"),
        ({"name": "a..b", "port": 80}, "is not a DNS name"),
        ({"name": "x.example", "port": 80, "nameservers": ["ns1.example"]}, "must be an IP"),
        ({"name": "x.example", "port": 80, "nameservers": ["[10.0.0.1]:53"]}, "must be an IP"),
        ({"name": "x.example", "port": 80, "interval_s": 0}, "greater than 0"),
        ({"name": "x.example", "port": 80, "record": "MX"}, "'A', 'AAAA' or 'SRV'"),
    ],
)
def test_bad_discovery_settings_are_refused_naming_the_field(
    entry: dict[str, Any], message: str
) -> None:
    with pytest.raises(pydantic.ValidationError, match=message) as caught:
        Settings(discovery={"dns": [entry]})
    assert caught.value.errors()[0]["loc"][:3] == ("discovery", "dns", 0)


def test_discovery_settings_from_toml_and_the_environment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from regional_agent.settings import load

    config = tmp_path / "agent.toml"
    config.write_text(
        "[[discovery.dns]]\n"
        'name = "vllm.inference.svc.cluster.local."\n'
        "port = 8000\n"
        'nameservers = ["10.96.0.10", "[fd00::a]:5353"]\n'
        "slots = 32\n"
    )
    settings = load(config_file=config)
    (entry,) = settings.discovery.dns
    assert entry.name == "vllm.inference.svc.cluster.local"
    assert entry.source == "dns:vllm.inference.svc.cluster.local"
    assert entry.servers() == [("10.96.0.10", 53), ("fd00::a", 5353)]
    assert (entry.record, entry.interval_s, entry.empty_after, entry.slots) == ("A", 5.0, 0, 32)
    monkeypatch.setenv(
        "MERIDIAN_AGENT_DISCOVERY__DNS",
        '[{"name": "_http._tcp.llm.example", "record": "SRV", "scheme": "https"}]',
    )
    (entry,) = load(config_file=config).discovery.dns
    assert (entry.name, entry.record, entry.scheme, entry.port) == (
        "_http._tcp.llm.example", "SRV", "https", None,
    )  # fmt: skip
    with pytest.raises(pydantic.ValidationError, match="given twice"):
        Settings(discovery={"dns": [{"name": "a.example", "port": 1}] * 2})
