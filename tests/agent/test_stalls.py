"""Stall detection against simulated nodes whose engine stops stepping (``hang``), the failure
``/health`` cannot see: a stream's first token overdue (cut, retried elsewhere, a node failure),
a stream gone silent mid-way (an error event naming the limit), and the generation probe."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from policies.model import Health, NodeId
from tests.conftest import NodeFactory
from tests.support.agent import AgentFactory, AgentHandle

MODEL = "tiny-model"


async def _faults(url: str, body: dict[str, object]) -> None:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/admin/faults", json=body) as r:
        assert r.status == 200


def _node(handle: AgentHandle, url: str) -> tuple[NodeId, int]:
    node = next(n for n in handle.edge.pool if n.url == url)
    return node.node_id, node.errors_total


async def _stream(url: str, *, max_tokens: int = 8) -> tuple[int, list[bytes]]:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/chat/completions", json=body) as r,
    ):
        return r.status, [line async for line in r.content if line.strip()]


async def test_a_stream_whose_first_token_is_overdue_is_retried_on_another_node(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    hung, good = [await sim_node(profile_name="cpu-tiny", time_scale=20, seed=i) for i in (0, 1)]
    handle = await start_agent(
        [hung, good], policy="round_robin", stall={"first_token_s": 0.5, "inter_token_s": 5.0}
    )
    await _faults(hung, {"hang": True})
    hung_id, errors_before = _node(handle, hung)
    started = time.monotonic()
    results = await asyncio.gather(*(_stream(handle.url) for _ in range(4)))
    took_s = time.monotonic() - started
    for status, lines in results:
        assert status == 200
        assert lines[-1] == b"data: [DONE]\n" and not any(b'"error"' in x for x in lines)
    _, errors_after = _node(handle, hung)
    assert errors_after > errors_before  # each cut counted against the hung node
    assert took_s < 5.0  # cut after first_token_s, not after upstream.first_byte_timeout_s
    decisions = next(n for n in handle.edge.pool if n.node_id == hung_id).decisions
    assert decisions  # requests were sent there, then retried


async def test_a_stream_silent_mid_way_ends_with_an_error_event_naming_the_limit(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    url = await sim_node(profile_name="cpu-tiny", time_scale=1, seed=0)  # slow: ~real CPU speed
    handle = await start_agent([url], stall={"first_token_s": 10.0, "inter_token_s": 0.5})
    body = {"model": MODEL, "stream": True, "max_tokens": 400,
            "messages": [{"role": "user", "content": "tell me a long story"}]}  # fmt: skip
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{handle.url}/v1/chat/completions", json={**body, "ignore_eos": True}) as r,
    ):
        assert r.status == 200
        first = await r.content.readline()
        assert first.startswith(b"data: {")
        await _faults(url, {"hang": True})  # the engine stops mid-generation
        began = time.monotonic()
        rest = [line async for line in r.content if line.strip()]
    silent_s = time.monotonic() - began
    errors = [x for x in rest if b'"error"' in x]
    assert errors and b"stall.inter_token_s" in errors[-1], rest[-3:]
    assert silent_s < 5.0
    node_id, _ = _node(handle, url)
    described = handle.edge.health.describe(node_id, now=handle.edge.clock.now())
    assert described["consecutive_failures"] == 1  # a node failure for passive health


async def test_the_generation_probe_catches_an_engine_that_answers_health(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = [await sim_node(profile_name="cpu-tiny", time_scale=20, seed=i) for i in (0, 1)]
    probing = await start_agent(
        urls, health={"probe_generate": True, "probe_generate_timeout_s": 0.5}
    )
    plain = await start_agent(urls)
    await _faults(urls[0], {"hang": True})
    hung_id = NodeId(next(n.node_id for n in probing.edge.pool if n.url == urls[0]))
    end = time.monotonic() + 10
    while probing.edge.health.state(hung_id, now=probing.edge.clock.now()) is Health.HEALTHY:
        assert time.monotonic() < end, "the generation probe did not take the node out"
        await asyncio.sleep(0.05)
    described = probing.edge.health.describe(hung_id, now=probing.edge.clock.now())
    assert "generation probe" in str(described["reason"])
    # /health alone still passes: the agent without generation probes sees nothing wrong
    assert plain.edge.health.state(hung_id, now=plain.edge.clock.now()) is Health.HEALTHY
