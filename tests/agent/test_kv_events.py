"""The precise prefix index fed by the nodes' own KV events: simulated nodes publishing as
vLLM does (real ZeroMQ sockets on loopback), the agent subscribed to them.

What a test checks against is the simulated engine's own cache: the index must hold exactly
the blocks the engine holds (the simulator hashes blocks as the agent does, so the agent's key
of a block is the engine's hash), follow its evictions, survive restarts and gaps, and route
to where the engine really holds a prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from meridian_sim import node, profile
from meridian_sim.kv_publisher import KvEventsConfig
from meridian_wire import kv_events
from policies.kv_index import PreciseIndex
from policies.model import NodeId
from regional_agent.app import KV_EVENTS
from regional_agent.kv_events import KvEvents
from tests.support.agent import ADMIN, AgentFactory, AgentHandle, admin_nodes, metric
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
ERRORS = "meridian_agent_kv_event_errors_total"


@dataclass
class EventNode:
    url: str
    events: str
    replay: str | None
    runner: web.AppRunner
    port: int

    @property
    def state(self) -> node.NodeState:
        return self.runner.app[node.STATE]

    def cached(self) -> set[int]:
        """The block hashes the simulated engine holds now."""
        return set(self.state.engine.kv._by_hash)

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, "kv_events_endpoint": self.events}
        if self.replay is not None:
            out["kv_events_replay_endpoint"] = self.replay
        return out


NodeStarter = Callable[..., Awaitable[EventNode]]


@pytest.fixture
async def event_node() -> AsyncIterator[NodeStarter]:
    """Simulated H100 nodes publishing KV events on free loopback ports (``blocks`` overrides
    the cache size, ``events``/``replay`` the endpoints, ``port`` the HTTP port)."""
    nodes: list[EventNode] = []

    async def start(
        *,
        blocks: int | None = None,
        replay: bool = True,
        events: str = "tcp://127.0.0.1:*",
        replay_endpoint: str = "tcp://127.0.0.1:*",
        port: int = 0,
        time_scale: float = 50.0,
    ) -> EventNode:
        prof = profile.load("h100-llama3-8b")
        if blocks is not None:
            prof = dataclasses.replace(prof, num_gpu_blocks=blocks)
        config = node.NodeConfig(
            profile=prof,
            model=prof.model,
            time_scale=time_scale,
            kv_events=KvEventsConfig(
                endpoint=events, replay_endpoint=replay_endpoint if replay else None
            ),
        )
        runner, bound = await node.start(node.create_app(config), port=port)
        publisher = runner.app[node.STATE].kv_publisher
        assert publisher is not None
        started = EventNode(
            url=f"http://127.0.0.1:{bound}",
            events=publisher.endpoint,
            replay=publisher.replay_endpoint,
            runner=runner,
            port=bound,
        )
        nodes.append(started)
        return started

    yield start
    for n in nodes:
        await n.runner.cleanup()


def _kv(agent: AgentHandle) -> KvEvents:
    return agent.app[KV_EVENTS]


def _index(agent: AgentHandle) -> PreciseIndex:
    return _kv(agent).index


async def _precise(agent: AgentHandle, *nodes: EventNode) -> None:
    index = _index(agent)
    await until(
        lambda: all(index.is_precise(NodeId(n.url.removeprefix("http://"))) for n in nodes),
        10.0,
        "every node in sync",
    )


def _id(n: EventNode) -> NodeId:
    return NodeId(n.url.removeprefix("http://"))


async def _chat(url: str, text: str, *, max_tokens: int = 4) -> dict[str, Any]:
    body = {
        "model": "meta-llama/Meta-Llama-3-8B-Instruct",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def _routed(agent: AgentHandle, text: str) -> NodeId:
    """The node the agent sent ``text`` to."""
    before = {n.node_id: n.requests_total for n in agent.edge.pool}
    await _chat(agent.url, text)
    moved = [n.node_id for n in agent.edge.pool if n.requests_total != before.get(n.node_id)]
    assert len(moved) == 1, moved
    return moved[0]


def _agent_settings(*nodes: EventNode, **extra: Any) -> dict[str, Any]:
    return {
        "nodes": [n.settings() for n in nodes],
        "routing": {"prefix_block_tokens": BLOCK},
        "kv_events": {"retry_interval_s": 0.5, "replay_timeout_s": 1.0, **extra},
    }


def _words(seed: int, n: int = 300) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n))


async def test_the_index_holds_exactly_what_the_engine_caches(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    sim = await event_node()
    agent = await start_agent([], policy="meridian", **_agent_settings(sim))
    await _precise(agent, sim)
    await _chat(agent.url, _words(1))
    index = _index(agent)
    await until(lambda: index.blocks(_id(sim)) > 0, 10.0, "the index to hold blocks")
    await until(lambda: index.keys(_id(sim)) == sim.cached(), 10.0, "the index to equal the cache")
    assert len(sim.cached()) >= 300 // BLOCK  # the prompt's blocks, at least
    assert await metric(agent.url, "meridian_agent_kv_events_total", kind="stored") >= 1
    assert await metric(agent.url, "meridian_agent_kv_events_in_sync", node=_id(sim)) == 1
    assert await metric(agent.url, "meridian_agent_kv_index_blocks", node=_id(sim)) == len(
        sim.cached()
    )
    shown = (await admin_nodes(agent.url, ADMIN))[sim.url]["kv_events"]
    assert shown["endpoint"] == sim.events and shown["replay_endpoint"] == sim.replay
    assert shown["connected"] and shown["in_sync"] and shown["blocks"] == len(sim.cached())
    assert shown["last_seq"] >= 0


async def test_evictions_leave_the_index(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    """A cache of 64 blocks filled by prompts of ~25 blocks each: from the third on, every new
    prompt evicts older blocks, and the index follows (within milliseconds; 2 s allowed for a
    loaded machine)."""
    sim = await event_node(blocks=64)
    agent = await start_agent([], policy="meridian", **_agent_settings(sim))
    await _precise(agent, sim)
    index = _index(agent)
    first_blocks: set[int] = set()
    for i in range(5):
        await _chat(agent.url, _words(100 + i, 100))
        if i == 0:
            await until(lambda: index.blocks(_id(sim)) > 0, 10.0, "the first prompt indexed")
            first_blocks = index.keys(_id(sim))
        await until(lambda: index.keys(_id(sim)) == sim.cached(), 2, "the index to equal the cache")
    assert first_blocks and not first_blocks & index.keys(_id(sim))  # evicted, and gone here
    assert await metric(agent.url, "meridian_agent_kv_events_total", kind="removed") >= 1


async def test_routing_follows_the_engines_cache_not_the_agents_guess(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    """Prompts sent to node B behind the agent's back: the approximate index cannot know, the
    events do, and the agent sends each prompt's next turn to B (by chance, with two idle
    nodes, all six would go there once in 64 runs)."""
    a, b = await event_node(), await event_node()
    agent = await start_agent([], policy="meridian", **_agent_settings(a, b))
    await _precise(agent, a, b)
    systems = [_words(700 + i, 200) for i in range(6)]
    for system in systems:
        await _chat(b.url, system)  # straight to the node
    index = _index(agent)
    await until(lambda: index.keys(_id(b)) == b.cached(), 10.0, "B's blocks indexed")
    for turn, system in enumerate(systems):
        went = await _routed(agent, f"{system} and then {turn}")
        assert went == _id(b), f"turn {turn} went to {went}"


async def test_an_agent_started_later_catches_up_through_replay(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    sim = await event_node()
    await _chat(sim.url, _words(3))
    await _chat(sim.url, _words(4))
    cached = sim.cached()
    assert cached
    agent = await start_agent([], policy="meridian", **_agent_settings(sim))
    await _precise(agent, sim)
    assert _index(agent).keys(_id(sim)) == cached  # from the replay alone


async def test_without_replay_the_stream_starts_empty_and_fills(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    sim = await event_node(replay=False)
    await _chat(sim.url, _words(5))
    agent = await start_agent([], policy="meridian", **_agent_settings(sim))
    await _precise(agent, sim)
    index = _index(agent)
    assert index.blocks(_id(sim)) == 0  # what came before the subscription is unknown
    for seed in range(6, 26):  # until ZeroMQ's subscription has reached the publisher
        await _chat(agent.url, _words(seed))
        await asyncio.sleep(0.1)
        if index.blocks(_id(sim)):
            break
    assert index.blocks(_id(sim)) > 0
    assert index.keys(_id(sim)) <= sim.cached()


async def test_a_restarted_engine_clears_the_nodes_blocks(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    sim = await event_node()
    agent = await start_agent([], policy="meridian", **_agent_settings(sim))
    await _precise(agent, sim)
    index = _index(agent)
    await _chat(agent.url, _words(8))
    await until(lambda: index.blocks(_id(sim)) > 0, 10.0, "blocks indexed")
    old = index.keys(_id(sim))
    await sim.runner.cleanup()  # the engine dies: its cache with it
    await until(lambda: not index.is_precise(_id(sim)), 10.0, "out of sync")
    again = await event_node(events=sim.events, replay_endpoint=sim.replay or "", port=sim.port)
    await _precise(agent, again)
    await until(lambda: not index.keys(_id(sim)) & old, 10.0, "the old blocks cleared")
    await _chat(agent.url, _words(9))
    await until(lambda: index.keys(_id(sim)) == again.cached(), 10.0, "the new engine's blocks")
    assert (
        await metric(agent.url, "meridian_agent_kv_event_errors_total", kind="resync_cleared") >= 1
    )


async def test_an_endpoint_that_does_not_answer_leaves_the_node_approximate(
    event_node: NodeStarter, start_agent: AgentFactory, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await event_node()
    silent = dataclasses.replace(sim, events="tcp://127.0.0.1:9", replay="tcp://127.0.0.1:9")
    caplog.set_level(logging.WARNING, logger="regional_agent.kv_events.subscriber")
    agent = await start_agent([], policy="meridian", **_agent_settings(silent))
    await until(lambda: "kv events endpoint does not answer" in caplog.text, 5, "a warning")
    assert not _index(agent).is_precise(_id(sim))
    assert await _routed(agent, _words(10)) == _id(sim)  # routed all the same
    await asyncio.sleep(1.2)  # two more retry intervals: one warning an interval, not a flood
    assert caplog.text.count("kv events endpoint does not answer") <= 4


class _FakeEngine:
    """A publisher the test drives by hand: sequence numbers, gaps and garbage at will."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.replays = 0
        self.lose_once: set[int] = set()  # batches the next replay leaves out (a full pipe)
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            lost, self.lose_once = self.lose_once, set()
            for seq, payload in self.buffer:
                if seq >= first and seq not in lost:
                    await self.router.send_multipart(
                        [client, b"", b"", kv_events.encode_seq(seq), payload]
                    )
            await self.router.send_multipart([client, b"", b"", kv_events.END_SEQ, b""])

    async def send(self, seq: int, payload: bytes, *, publish: bool = True) -> None:
        self.buffer.append((seq, payload))
        if publish:
            await self.pub.send_multipart([b"", kv_events.encode_seq(seq), payload])

    async def close(self) -> None:
        self._task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def _stored(
    tokens: list[int], *, parent: int | None = None, first: int = 0, extra: list[Any] | None = None
) -> bytes:
    n = len(tokens) // BLOCK
    return kv_events.encode_batch(
        kv_events.EventBatch(
            ts=0.0,
            events=[
                kv_events.BlockStored(
                    block_hashes=list(range(first, first + n)),
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=BLOCK,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=extra,
                )
            ],
        )
    )


async def test_garbage_and_gaps_are_counted_and_survived(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    """Malformed frames and payloads are skipped; a gap is repaired from the replay buffer;
    a block size other than the agent's is refused by name.  The stream keeps going."""
    sim = await event_node()  # a real node to route to; its events come from the fake engine
    fake = _FakeEngine()
    try:
        endpoints = {
            "kv_events_endpoint": fake.endpoint,
            "kv_events_replay_endpoint": fake.replay_endpoint,
        }
        agent = await start_agent(
            [],
            policy="meridian",
            nodes=[{"url": sim.url, **endpoints}],
            routing={"prefix_block_tokens": BLOCK},
            kv_events={"retry_interval_s": 0.5, "replay_timeout_s": 1.0},
        )
        index = _index(agent)
        node_id = _id(sim)
        await until(lambda: index.is_precise(node_id), 10.0, "in sync")
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        await fake.send(0, _stored(list(range(32))))
        await until(lambda: index.blocks(node_id) == 2, 10.0, "seq 0 applied")
        await fake.pub.send_multipart([b"one frame"])
        await fake.pub.send_multipart([b"", b"\x00", b"short seq"])
        await fake.send(1, b"\xc1 not msgpack")
        await fake.send(2, msgspec.msgpack.encode([0.0, [{"type": "BlockEaten"}]]))
        wrong_size = kv_events.encode_batch(
            kv_events.EventBatch(
                ts=0.0,
                events=[
                    kv_events.BlockStored(
                        block_hashes=[99],
                        parent_block_hash=None,
                        token_ids=list(range(128)),
                        block_size=128,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                ],
            )
        )
        await fake.send(3, wrong_size)
        await fake.send(4, _stored([2**40, *range(15)], first=50))  # not a token id
        await fake.send(5, _stored(list(range(16)), first=60, extra=[["salt"]]))  # a salted block
        await fake.send(6, _stored(list(range(32, 48)), parent=1, first=2), publish=False)  # lost
        fake.lose_once = {7}  # and the replay that repairs the gap loses one more (a full pipe)
        await fake.send(7, _stored(list(range(48, 64)), parent=2, first=3), publish=False)
        await fake.send(8, _stored(list(range(64, 80)), parent=3, first=4))  # the gap shows
        await until(lambda: index.blocks(node_id) == 5, 10.0, "the gaps repaired from replay")
        assert index.is_precise(node_id)
        assert await metric(agent.url, ERRORS, kind="malformed") >= 5
        assert await metric(agent.url, ERRORS, kind="refused") == 1
        assert await metric(agent.url, ERRORS, kind="gap") == 2  # the stream's, the replay's
        assert await metric(agent.url, "meridian_agent_kv_events_total", kind="ignored") == 1
        assert fake.replays >= 3  # the first sync, the gap, the replay's own hole
        await _chat(agent.url, "still serving")
    finally:
        await fake.close()


async def test_two_agents_hold_the_same_index_and_route_alike(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    """Two replicas, nothing shared but the engines' events: after traffic through one of them
    and straight to the nodes, both hold the same index and choose the same nodes."""
    nodes = [await event_node() for _ in range(3)]
    one = await start_agent([], policy="meridian", **_agent_settings(*nodes))
    two = await start_agent([], policy="meridian", **_agent_settings(*nodes))
    await _precise(one, *nodes)
    await _precise(two, *nodes)
    prompts = [_words(200 + i, 400) for i in range(6)]
    for i, text in enumerate(prompts):
        if i % 2:
            await _chat(nodes[i % 3].url, text)
        else:
            await _chat(one.url, text)
    for n in nodes:
        await until(
            lambda n=n: _index(one).keys(_id(n)) == _index(two).keys(_id(n)) == n.cached(),
            10.0,
            "both indexes equal the engine",
        )
    await asyncio.sleep(2.5)  # past precise_pending_s: only the events count in either agent
    for text in prompts:
        first, second = await _routed(one, f"{text} more"), await _routed(two, f"{text} more")
        assert first == second


async def test_a_reset_of_an_idle_engine_clears_its_blocks(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    """POST /reset_prefix_cache with nothing in flight: the engine sends AllBlocksCleared (as
    vLLM does), and the node's blocks leave the index."""
    sim = await event_node()
    agent = await start_agent([], policy="meridian", **_agent_settings(sim))
    await _precise(agent, sim)
    index = _index(agent)
    await _chat(agent.url, _words(11))
    await until(lambda: index.blocks(_id(sim)) > 0, 10.0, "blocks indexed")
    async with aiohttp.ClientSession() as s, s.post(f"{sim.url}/reset_prefix_cache") as r:
        assert r.status == 200
    await until(lambda: index.blocks(_id(sim)) == 0, 10.0, "the blocks cleared")
    assert not sim.cached()
    assert await metric(agent.url, "meridian_agent_kv_events_total", kind="cleared") == 1


async def test_a_node_on_an_ipv6_address(
    event_node: NodeStarter, start_agent: AgentFactory
) -> None:
    """An engine publishing on [::1], found by the endpoint template on its URL's host."""
    sim = await event_node(events="tcp://[::1]:*", replay_endpoint="tcp://[::1]:*")
    port = sim.events.rsplit(":", 1)[1]
    replay_port = (sim.replay or "").rsplit(":", 1)[1]
    agent = await start_agent(
        [],
        policy="meridian",
        nodes=[{"url": f"http://[::1]:{sim.port}"}],
        routing={"prefix_block_tokens": BLOCK},
        kv_events={
            "endpoint": f"tcp://{{host}}:{port}",
            "replay_endpoint": f"tcp://{{host}}:{replay_port}",
            "retry_interval_s": 0.5,
        },
    )
    index = _index(agent)
    node_id = NodeId(f"::1:{sim.port}")
    await until(lambda: index.is_precise(node_id), 10.0, "in sync over IPv6")
    assert _kv(agent).describe(node_id)["endpoint"] == f"tcp://[::1]:{port}"  # type: ignore[index]


async def test_every_worker_follows_the_events_and_routes_alike(
    event_node: NodeStarter, tmp_path: Path
) -> None:
    """``meridian-agent --workers 2``: each worker subscribes by itself, both hold every block
    the engines report, and a prompt cached behind the agent's back is followed by whichever
    worker a connection lands on."""
    a, b = await event_node(), await event_node()
    nodes = [a.settings(), b.settings()]
    env = {
        **os.environ,
        "MERIDIAN_AGENT_NODES": json.dumps(nodes),
        "MERIDIAN_AGENT_ROUTING__PREFIX_BLOCK_TOKENS": str(BLOCK),
        "MERIDIAN_AGENT_ADMIN__TOKEN": "t",
    }
    log = tmp_path / "agent.log"
    with log.open("w") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "regional_agent.cli", "--port", "0", "--workers", "2",
            stdout=asyncio.subprocess.PIPE, stderr=err, env=env,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("READY "), (line, log.read_text())
        url = line.split()[1]
        systems = [_words(900 + i, 200) for i in range(6)]
        for system in systems:
            await _chat(b.url, system)  # straight to the node
        want = len(b.cached())

        async def blocks_by_worker() -> dict[str, float]:
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.get(f"{url}/metrics") as r,
            ):
                text = await r.text()
            out: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "meridian_agent_kv_index_blocks" and sample.labels.get(
                        "node"
                    ) == _id(b):
                        out[sample.labels["worker"]] = sample.value
            return out

        deadline = time.monotonic() + 20
        while (seen := await blocks_by_worker()) != {"0": want, "1": want}:
            assert time.monotonic() < deadline, (seen, want, log.read_text()[-3000:])
            await asyncio.sleep(0.2)
        before = await metric(b.url, "vllm:request_success_total")
        for turn, system in enumerate(systems):  # a new connection each: both workers route
            body = {
                "model": "meta-llama/Meta-Llama-3-8B-Instruct",
                "messages": [{"role": "user", "content": f"{system} and then {turn}"}],
                "max_tokens": 2,
            }
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.post(f"{url}/v1/chat/completions", json=body) as r,
            ):
                assert r.status == 200, await r.text()
        assert await metric(b.url, "vllm:request_success_total") - before == len(systems)
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
