"""A live local stack for the admin API and meridianctl tests: real etcd, real controller
replicas (``create_app``: election, window loop, admin API on a free port), and stand-in
agents that publish their regions into etcd the way an agent does (``meridian_wire`` keys and
models).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from controlplane.api import keys as api_keys
from controlplane.api.server import ADMIN_API
from controlplane.app import CONTROLLER, Controller, create_app
from controlplane.settings import ControllerSettings
from meridian_wire import keys
from meridian_wire.models import RegionLoad, RegionStatus
from tests.support import cancel_all, until
from tests.support.etcd import client as etcd_client

WINDOW_S = 0.5
TOKENS = {"viewer": "viewer-secret-token", "operator": "operator-secret-token",
          "admin": "admin-secret-token"}  # fmt: skip
REGIONS: tuple[dict[str, Any], ...] = (
    {"id": "eu-west", "geo": "eu", "residency": ["eu"], "backups": ["eu-north"]},
    {"id": "eu-north", "geo": "eu", "residency": ["eu"]},
    {"id": "us-east", "geo": "us", "residency": []},
)


def token_settings() -> list[dict[str, str]]:
    return [
        {"name": f"{role}-user", "role": role, "sha256": hashlib.sha256(t.encode()).hexdigest()}
        for role, t in TOKENS.items()
    ]


def settings(
    etcd_url: str,
    name: str,
    *,
    tls: dict[str, Path] | None = None,
    probe: dict[str, Any] | None = None,
    **failover: Any,
) -> ControllerSettings:
    api: dict[str, Any] = {"port": 0, "tokens": token_settings()}
    if tls is not None:
        api["tls"] = tls
    return ControllerSettings(
        etcd={"endpoints": [etcd_url], "timeout_s": 1.0},
        election={"id": name, "lease_ttl_s": 2},
        failover={
            "window_s": WINDOW_S,
            "status_stale_s": 5.0,
            "agent_heartbeat_s": 1.0,
            "min_hold_s": 0.0,
            **failover,
        },
        regions=list(REGIONS),
        server={"port": 0},
        api=api,
        probe=probe or {},
    )


class Stack:
    """Controllers and stand-in agents; ``close()`` stops everything."""

    def __init__(
        self,
        etcd_url: str,
        *,
        endpoints: dict[str, str] | None = None,
        models: dict[str, dict[str, float]] | None = None,
    ) -> None:
        """``endpoints``: what a stand-in agent publishes as its region's endpoint (default
        ``http://<region>.example:8080``); ``models``: its capacity per model (default none
        published)."""
        self.etcd_url = etcd_url
        self.endpoints = endpoints or {}
        self.models = models or {}
        self.runners: dict[str, web.AppRunner] = {}
        self.agents: list[asyncio.Task[None]] = []
        self.up = {r["id"]: True for r in REGIONS}
        self.store = etcd_client(etcd_url, timeout_s=1.0)

    async def controller(self, name: str, **kwargs: Any) -> Controller:
        app = create_app(settings(self.etcd_url, name, **kwargs))
        runner = web.AppRunner(app)
        await runner.setup()
        self.runners[name] = runner
        return app[CONTROLLER]

    def url(self, name: str) -> str:
        app = self.runners[name].app
        assert app is not None
        url = app[ADMIN_API].url
        assert url is not None
        return url

    async def leader(self) -> Controller:
        def leading() -> bool:
            return any(r.app[CONTROLLER].election.leading for r in self.runners.values() if r.app)

        await until(leading, 10, "a leader")
        for r in self.runners.values():
            assert r.app is not None
            c = r.app[CONTROLLER]
            if c.election.leading:
                await until(lambda c=c: c.passes >= 2, 10, "two passes")  # type: ignore[misc]
                return c
        raise AssertionError("no leader")

    def start_agents(self) -> None:
        for region in self.up:
            self.agents.append(asyncio.create_task(self._agent(region)))

    async def _agent(self, region: str) -> None:
        info = next(r for r in REGIONS if r["id"] == region)
        store = etcd_client(self.etcd_url, timeout_s=1.0)
        try:
            while True:
                if self.up[region]:
                    status = RegionStatus(
                        region=region,
                        geo=info["geo"],
                        residency=info["residency"],
                        endpoints=[self.endpoints.get(region, f"http://{region}.example:8080")],
                        nodes_healthy=4,
                        nodes_total=4,
                        capacity=4.0,
                        models=self.models.get(region),
                        load=RegionLoad(kv_util=0.25, requests_per_s=10.0, in_flight=3),
                        updated_at=time.time(),
                    )
                    with contextlib.suppress(Exception):
                        await store.put(keys.status(region), status.model_dump_json().encode())
                        await store.put(keys.alive(region), b"")
                await asyncio.sleep(0.2)
        finally:
            await store.close()

    async def snapshot(self) -> dict[str, bytes]:
        """Every key the fleet's state lives in, except bookkeeping (audit, events, answers to
        idempotency keys) and what agents write: for 'nothing changed' checks."""
        skip = (keys.AUDIT, keys.EVENTS, keys.PLAN, keys.LEADER, api_keys.IDEMPOTENCY)
        out = {}
        for e in (await self.store.get_prefix(keys.PREFIX)).entries:
            if e.key.startswith(skip) or e.key.endswith(("/status", "/alive")):
                continue
            out[e.key] = e.value
        return out

    async def close(self) -> None:
        await cancel_all(self.agents)
        for runner in list(self.runners.values()):
            await runner.cleanup()
        await self.store.close()


@contextlib.asynccontextmanager
async def leading(
    etcd_url: str,
    *,
    endpoints: dict[str, str] | None = None,
    models: dict[str, dict[str, float]] | None = None,
    **controller: Any,
) -> AsyncIterator[Stack]:
    """A stack whose agents publish and whose one controller, ``ctl-a``, leads; closed after.
    ``controller``: more settings of ``ctl-a`` (``probe={...}``, failover fields)."""
    s = Stack(etcd_url, endpoints=endpoints, models=models)
    s.start_agents()
    await s.controller("ctl-a", **controller)
    await s.leader()
    try:
        yield s
    finally:
        await s.close()
