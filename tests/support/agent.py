"""An in-process regional agent on a free loopback port, in front of whatever nodes a test names.

The ``start_agent`` fixture (tests/conftest.py) wraps :class:`AgentStarter`; tests against
simulated nodes (tests/agent/) and against real vLLM (tests/real_vllm/) share it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from regional_agent.app import create_app
from regional_agent.app_state import AGENT, Agent
from regional_agent.settings import Settings

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# Fast loops for tests; every other setting is the default.
FAST: dict[str, Any] = {
    "telemetry": {"scrape_interval_s": 0.1, "stale_after_s": 1.0, "models_refresh_s": 1.0},
    "health": {"probe_interval_s": 0.2, "probe_timeout_s": 0.5},
}


@dataclass
class AgentHandle:
    url: str
    app: web.Application

    @property
    def agent(self) -> Agent:
        return self.app[AGENT]


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
        self._runners: list[web.AppRunner] = []

    async def __call__(
        self, node_urls: list[str], *, policy: str = "meridian", **groups: Any
    ) -> AgentHandle:
        values = merge(
            FAST,
            {
                "nodes": [{"url": u} for u in node_urls],
                "routing": {"policy": policy},
                "admin": {"token": ADMIN_TOKEN},
            },
        )
        settings = Settings(**merge(values, groups))
        app = create_app(settings, seed=0)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runners.append(runner)
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return AgentHandle(url=f"http://127.0.0.1:{port}", app=app)

    async def close(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
