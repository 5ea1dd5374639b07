"""An in-process regional agent on a free loopback port, in front of whatever nodes a test names.

The ``start_agent`` fixture (tests/conftest.py) wraps :class:`AgentStarter`; tests against
simulated nodes (tests/agent/) and against real vLLM (tests/real_vllm/) share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from meridian_service import hygiene
from regional_agent.app import PUBLISHER, create_app
from regional_agent.autoscaler import AUTOSCALER, Autoscaler
from regional_agent.edge import EDGE, Edge
from regional_agent.publisher import Publisher
from regional_agent.settings import Settings

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# Fast loops for tests; every other setting is the default.
FAST: dict[str, Any] = {
    "telemetry": {"scrape_interval_s": 0.1, "stale_after_s": 1.0, "models_refresh_s": 1.0},
    # unhealthy_after 2 (the default is 3): tests that wait for a node to go down stay quick
    "health": {"probe_interval_s": 0.2, "probe_timeout_s": 0.5, "unhealthy_after": 2},
}


@dataclass
class AgentHandle:
    url: str
    app: web.Application
    runner: hygiene.Runner

    @property
    def connections(self) -> hygiene.Connections:
        """The agent's open connections by client address, and what its limits did."""
        return self.runner.connections

    @property
    def edge(self) -> Edge:
        """What the agent's handlers work with: pool, dispatcher, roster, ..."""
        return self.app[EDGE]

    @property
    def publisher(self) -> Publisher | None:
        return self.app.get(PUBLISHER)

    @property
    def autoscaler(self) -> Autoscaler | None:
        return self.app.get(AUTOSCALER)


AgentFactory = Callable[..., Awaitable[AgentHandle]]


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``extra``, nested dicts merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


class AgentStarter:
    """``handle = await starter(node_urls, policy="prefix_aware", queue={...})``; ``close()``
    stops every agent it started, newest first."""

    def __init__(self) -> None:
        self._runners: list[hygiene.Runner] = []

    async def __call__(
        self, node_urls: list[str], *, policy: str = "meridian", port: int = 0, **groups: Any
    ) -> AgentHandle:
        """``port``: 0 for a free one, or one a test reserved (``ports.free_port``) because
        the agent's settings must name its own address (``region.endpoints``)."""
        values = merge(
            FAST,
            {
                "nodes": [{"url": u} for u in node_urls],
                "routing": {"policy": policy},
                "admin": {"token_sha256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()},
            },
        )
        settings = Settings(**merge(values, groups))
        app = create_app(settings, seed=0)
        # as meridian-agent serves it: the connection limits of settings.server
        runner = hygiene.runner(
            app, settings.server.limits(), handler_cancellation=True, access_log=None
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        self._runners.append(runner)
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return AgentHandle(url=f"http://127.0.0.1:{port}", app=app, runner=runner)

    async def close(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()


def openai_client(url: str, **kw: Any) -> openai.AsyncOpenAI:
    """The official client pointed at an agent or node, without its own retries."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **kw)


async def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def admin_nodes(url: str, headers: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The agent's ``GET /admin/nodes``, keyed by node URL."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/admin/nodes", headers=headers) as r:
        assert r.status == 200
        body = await r.json()
    return {n["url"]: n for n in body["nodes"]}
