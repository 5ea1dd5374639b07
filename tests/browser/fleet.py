"""A live fleet for the fleet page: real etcd, a real BIND9 with two views, one simulated node per
region behind a real ``meridian-agent`` process (so a region dies by ``kill -9``), and a real
controller (``create_app``: election, window loop, DNS steering, the admin API on a free port).

Regions as in tests/meridianctl/stack.py: eu-west (backup eu-north) and eu-north (geography and
residency eu), us-east (geography us).  The BIND fixture's view ``geo-a`` (clients from
127.0.0.2) serves eu, ``default`` (127.0.0.1) serves us.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from controlplane.api.server import ADMIN_API
from controlplane.app import CONTROLLER, Controller, create_app
from controlplane.settings import ControllerSettings
from tests.controlplane.dns_helpers import dns_settings
from tests.faults.harness import AgentProc, fast_agent_toml
from tests.meridianctl.stack import REGIONS, token_settings
from tests.support import BindServer
from tests.support.ports import free_port

WINDOW_S, STRIKES = 1.0, 3
AGENT_TTL_S, HEARTBEAT_S = 2, 1.0
ADDRESSES = {"eu-west": "192.0.2.11", "eu-north": "192.0.2.12", "us-east": "198.51.100.13"}


def agent_toml(region: dict[str, Any], node_url: str, etcd_url: str) -> str:
    return fast_agent_toml(
        region=region["id"], geo=region["geo"], residency=region["residency"],
        endpoint=f"https://{ADDRESSES[region['id']]}", etcd=[etcd_url], nodes=[node_url],
        lease_ttl_s=AGENT_TTL_S, window_s=HEARTBEAT_S, probe_timeout_s=1.0,
    )  # fmt: skip


class Fleet:
    def __init__(self, etcd_url: str, bind: BindServer, logs: Path) -> None:
        self.etcd_url = etcd_url
        self.bind = bind
        self.logs = logs
        self.agents: dict[str, AgentProc] = {}
        self.runner: web.AppRunner | None = None

    async def start(self, node_urls: dict[str, str]) -> Fleet:
        for region in REGIONS:
            config = agent_toml(region, node_urls[region["id"]], self.etcd_url)
            self.agents[region["id"]] = AgentProc(
                port=free_port(), log_dir=self.logs, config=config
            )
        # AgentProc.start waits for /health with blocking calls: in threads, all at once
        await asyncio.gather(*(asyncio.to_thread(a.start) for a in self.agents.values()))
        settings = ControllerSettings(
            etcd={"endpoints": [self.etcd_url], "timeout_s": 1.0},
            election={"id": "ctl-a", "lease_ttl_s": 2},
            failover={
                "window_s": WINDOW_S,
                "strikes": STRIKES,
                "status_stale_s": 3 * HEARTBEAT_S,
                "agent_heartbeat_s": HEARTBEAT_S,
                "min_hold_s": 0.0,
            },
            regions=list(REGIONS),
            server={"port": 0},
            api={"port": 0, "tokens": token_settings()},
            dns=dns_settings(self.bind),
        )
        self.runner = web.AppRunner(create_app(settings))
        await self.runner.setup()
        return self

    @property
    def controller(self) -> Controller:
        assert self.runner is not None and self.runner.app is not None
        return self.runner.app[CONTROLLER]

    @property
    def url(self) -> str:
        assert self.runner is not None and self.runner.app is not None
        url = self.runner.app[ADMIN_API].url
        assert url is not None
        return url

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        await asyncio.gather(*(asyncio.to_thread(a.stop) for a in self.agents.values()))
