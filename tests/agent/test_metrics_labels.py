"""The agent's ``/metrics`` labels and the series on call needs: region and model on the
request series, tokens, queue wait by priority class, node health states and ejections,
retries, build info; a model a client makes up never becomes a series.  Real agents in front
of simulated nodes; the exposition is parsed with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from meridian_service import version
from meridian_sim import node, profile
from tests.conftest import NodeFactory
from tests.support.agent import ADMIN, AgentFactory, AgentHandle, admin_nodes
from tests.support.agent import metric as node_metric
from tests.support.metrics import (
    ROOT,
    Scrape,
    base,
    check_documented,
    documented,
    instrument_names,
    zeros,
)

MODEL = "tiny-model"
REGION = {"id": "eu-west", "geo": "eu"}


async def scrape(url: str) -> Scrape:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        return Scrape(await r.text())


async def until(check: Callable[[], Any], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def ready(handle: AgentHandle, nodes: int) -> None:
    """Until every node is routable with its model known (the model label needs it)."""

    async def check() -> bool:
        async with aiohttp.ClientSession() as s, s.get(f"{handle.url}/ready") as r:
            body = await r.json()
        return bool(body["routable_nodes"] == nodes)

    await until(check, 10, "the agent ready")


async def post(
    handle: AgentHandle, path: str, body: dict[str, Any], **headers: str
) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{handle.url}{path}", json=body, headers=headers) as r,
    ):
        return r.status, await r.read()


@pytest.fixture
async def killable() -> AsyncIterator[Callable[[], Any]]:
    """Simulated nodes whose runner the test holds, so that it can kill one."""
    runners: list[web.AppRunner] = []

    async def start() -> tuple[str, web.AppRunner]:
        prof = profile.load("cpu-tiny")
        config = node.NodeConfig(profile=prof, model=prof.model, time_scale=20.0, seed=0)
        runner, port = await node.start(node.create_app(config))
        runners.append(runner)
        return f"http://127.0.0.1:{port}", runner

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_request_series_carry_region_and_model_and_count_tokens(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    url = await sim_node(profile_name="cpu-tiny")
    handle = await start_agent([url], region=REGION)
    await ready(handle, 1)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
    # a stream without usage (counted), one with usage in its last chunk, one not streamed
    status, _ = await post(
        handle, "/v1/chat/completions", {**chat, "max_tokens": 6, "stream": True}
    )
    assert status == 200
    with_usage = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, raw = await post(handle, "/v1/completions", with_usage)
    assert status == 200
    events = [json.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert events[-1]["usage"]["completion_tokens"] > 0
    status, raw = await post(
        handle, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4}
    )
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] > 0

    m = await scrape(handle.url)
    labels = {"region": "eu-west", "model": MODEL}
    assert m.value("meridian_agent_time_to_first_token_seconds_count", **labels) == 2
    assert m.value("meridian_agent_request_duration_seconds_count", **labels) == 3
    assert m.value("meridian_agent_queue_wait_seconds_count", region="eu-west",
                   priority="normal") == 3  # fmt: skip
    # the node's own counters are the truth: usage where it reported it, counted otherwise
    generated = await node_metric(url, "vllm:generation_tokens_total")
    prompt = await node_metric(url, "vllm:prompt_tokens_total")
    assert generated > 0 and prompt > 0
    assert m.value("meridian_agent_generated_tokens_total", **labels) == generated
    assert m.value("meridian_agent_prompt_tokens_total", **labels) == prompt
    assert m.value("meridian_agent_build_info", version=version.version(), region="eu-west") == 1
    # no series of these without the two labels
    for name in (
        "meridian_agent_time_to_first_token_seconds_count",
        "meridian_agent_request_duration_seconds_count",
        "meridian_agent_generated_tokens_total",
    ):
        assert {tuple(sorted(s.labels)) for s in m.find(name)} == {("model", "region")}, name
    check_documented(m, "meridian_agent_")


async def test_a_model_no_node_serves_makes_no_series(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await start_agent([await sim_node(profile_name="cpu-tiny")])
    await ready(handle, 1)
    made_up = "gpt-made-up-by-a-client"
    for stream in (False, True):
        body = {"model": made_up, "prompt": "x", "max_tokens": 2, "stream": stream}
        status, _ = await post(handle, "/v1/completions", body)
        assert status == 404
    status, _ = await post(
        handle, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}
    )
    assert status == 200
    m = await scrape(handle.url)
    assert all(made_up not in s.labels.values() for s in m.samples)
    assert m.value("meridian_agent_request_duration_seconds_count", model="other") == 2
    assert m.value("meridian_agent_request_duration_seconds_count", model=MODEL) == 1
    assert m.find("meridian_agent_prompt_tokens_total", model="other") == []  # nothing served
    # no region set: no region label anywhere
    assert all("region" not in s.labels for s in m.samples)


async def test_queue_wait_by_priority_class(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await start_agent([await sim_node(profile_name="cpu-tiny")])
    await ready(handle, 1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for priority in ("high", "low", "low"):
        status, _ = await post(handle, "/v1/completions", body, **{"X-Priority": priority})
        assert status == 200
    m = await scrape(handle.url)
    waits = {
        s.labels["priority"]: s.value for s in m.find("meridian_agent_queue_wait_seconds_count")
    }
    assert waits == {"high": 1, "low": 2}


async def test_a_killed_node_flips_its_state_and_is_counted_as_ejected(
    killable: Callable[[], Any], start_agent: AgentFactory
) -> None:
    (dead_url, dead), (live_url, _) = await killable(), await killable()
    handle = await start_agent(
        [dead_url, live_url],
        policy="round_robin",
        # one failed request ejects; probes too slow to mark it unhealthy first
        health={"eject_consecutive_errors": 1, "probe_interval_s": 60.0},
    )
    await ready(handle, 2)
    ids = {u: n["id"] for u, n in (await admin_nodes(handle.url, ADMIN)).items()}
    m = await scrape(handle.url)
    for url in (dead_url, live_url):
        states = {
            s.labels["state"]: s.value for s in m.find("meridian_agent_node_state", node=ids[url])
        }
        assert states == {"healthy": 1, "probation": 0, "ejected": 0, "unhealthy": 0}
    assert zeros(m.find("meridian_agent_node_ejections_total"))
    assert m.find("meridian_agent_retries_total") == []

    await dead.cleanup()  # the node dies: its requests are refused, retried on the other
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for _ in range(4):
        status, _ = await post(handle, "/v1/completions", body)
        assert status == 200

    m = await scrape(handle.url)
    assert m.value("meridian_agent_node_state", node=ids[dead_url], state="ejected") == 1
    assert m.value("meridian_agent_node_state", node=ids[dead_url], state="healthy") == 0
    assert m.value("meridian_agent_node_state", node=ids[live_url], state="healthy") == 1
    assert m.value("meridian_agent_node_ejections_total", cause="errors") == 1
    assert sum(s.value for s in m.find("meridian_agent_node_ejections_total")) == 1
    assert m.value("meridian_agent_retries_total", cause="UpstreamUnavailable") == 1
    assert m.value("meridian_agent_requests_total", node=ids[live_url], status="200") == 4
    check_documented(m, "meridian_agent_")


def test_the_reference_documents_exactly_the_agents_series() -> None:
    """docs/observability.md's agent table against the names regional_agent/observability.py
    creates, and those the workers' merged /metrics adds (workers/runtime.py); the scrapes
    above check types and labels of those they see."""
    rows = {base(name) for name in documented("meridian_agent_")}
    sources = [ROOT / "regional_agent" / "observability.py"]
    sources.append(ROOT / "regional_agent" / "workers" / "runtime.py")
    assert rows == set().union(*(instrument_names(s, "meridian_agent_") for s in sources))
