"""Fixtures for agent tests: an in-process agent in front of simulated nodes, and simulated
nodes as separate processes (for tests that kill one)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
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


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture
async def start_agent() -> AsyncIterator[AgentFactory]:
    """``handle = await start_agent(node_urls, policy="prefix_aware", queue={...})``."""
    runners: list[web.AppRunner] = []

    async def start(
        node_urls: list[str], *, policy: str = "meridian", **groups: Any
    ) -> AgentHandle:
        values = _merge(
            FAST,
            {
                "nodes": [{"url": u} for u in node_urls],
                "routing": {"policy": policy},
                "admin": {"token": ADMIN_TOKEN},
            },
        )
        settings = Settings(**_merge(values, groups))
        app = create_app(settings, seed=0)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return AgentHandle(url=f"http://127.0.0.1:{port}", app=app)

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@dataclass
class SimProcess:
    url: str
    proc: subprocess.Popen[str]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def sim_processes() -> Iterator[Callable[..., list[SimProcess]]]:
    """``nodes = sim_processes(4, profile="cpu-tiny")``: real meridian-sim processes."""
    started: list[SimProcess] = []

    def start(n: int, *, profile: str = "cpu-tiny", time_scale: float = 5.0) -> list[SimProcess]:
        out = []
        for i in range(n):
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "simulator.cli",
                    "node",
                    "--port",
                    "0",
                    "--profile",
                    profile,
                    "--time-scale",
                    str(time_scale),
                    "--seed",
                    str(i),
                    "--log-level",
                    "WARNING",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("READY "):
                proc.kill()
                raise RuntimeError(f"meridian-sim did not start: {line!r}")
            sim = SimProcess(url=line.split()[1], proc=proc)
            started.append(sim)
            out.append(sim)
        return out

    yield start
    for sim in started:
        if sim.proc.poll() is None:
            sim.proc.terminate()
            try:
                sim.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sim.proc.kill()
                sim.proc.wait()
        if sim.proc.stdout is not None:
            sim.proc.stdout.close()
