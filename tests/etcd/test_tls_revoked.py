"""An agent whose etcd client certificate is revoked or expired fails static, against real etcd.

A TLS etcd with ``--client-cert-auth`` and auth enabled (by the real ``meridian-controller etcd
bootstrap``), a real agent of eu-west and a controller reaching it with their own certificates;
the region is judged healthy.  Then the CA revokes the agent's certificate and etcd restarts
with the CRL (``--client-crl-file``: etcd reads it at start), as a member restarted after a
revocation, or an expired certificate at its next handshake, would refuse it.  The agent keeps
routing every request, says at ERROR why etcd refuses it and which setting to renew, and the
controller, whose certificate is still good, sees eu-west's liveness lapse and fails it as it
would a dead region.  An agent started with an expired certificate serves as well, and says
so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

import meridian_etcd
from controlplane.app import CONTROLLER, create_app
from controlplane.settings import ControllerSettings
from meridian_wire import keys
from meridian_wire.models import RegionHealth
from tests.support import until
from tests.support.agent import AgentFactory
from tests.support.etcd import (
    EtcdCerts,
    EtcdServer,
    expired,
    make_certs,
    relaunch,
    revoke,
    start_etcd_tls,
)
from tests.support.etcd import client as etcd_client

CONTROLLER_BIN = Path(sys.executable).with_name("meridian-controller")
REGION = {"id": "eu-west", "geo": "eu", "residency": ["eu"]}
CHAT = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Etcd:
    """The module's TLS etcd, bootstrapped; ``restart`` kills it and starts it again with more
    flags. Requested before the agent and controller fixtures, so that it outlives them."""

    server: EtcdServer
    certs: EtcdCerts
    stack: contextlib.ExitStack

    def restart(self, *extra_args: str) -> None:
        self.server.process.kill()
        self.server = relaunch(self.server, extra_args=extra_args)
        self.stack.callback(self.server.process.stop)


@pytest.fixture
def etcd_tls(tmp_path: Path) -> Iterator[Etcd]:
    certs = make_certs(tmp_path / "pki", clients=["agent-eu-west", "meridian-controller", "root"])
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_etcd_tls(tmp_path, certs, health_cn="root"))
        config = tmp_path / "bootstrap.toml"
        config.write_text(
            f'[etcd]\nendpoints = ["{server.url}"]\nca_file = "{certs.ca}"\n'
            f'cert_file = "{certs.cert("root")}"\nkey_file = "{certs.key("root")}"\n'
            '[[regions]]\nid = "eu-west"\ngeo = "eu"\nresidency = ["eu"]\n'
        )
        done = subprocess.run(
            [str(CONTROLLER_BIN), "etcd", "bootstrap", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        yield Etcd(server=server, certs=certs, stack=stack)


@pytest.fixture
async def controller_runner() -> AsyncIterator[list[web.AppRunner]]:
    runners: list[web.AppRunner] = []
    yield runners
    for runner in runners:
        await runner.cleanup()


async def _chat(http: httpx.AsyncClient, url: str) -> int:
    response = await http.post(f"{url}/v1/chat/completions", json=CHAT)
    return response.status_code


async def test_a_revoked_agent_certificate_fails_static_and_the_region_lapses(
    etcd_tls: Etcd,
    sim_node: Any,
    start_agent: AgentFactory,
    controller_runner: list[web.AppRunner],
    caplog: pytest.LogCaptureFixture,
) -> None:
    certs, url = etcd_tls.certs, etcd_tls.server.url
    node = await sim_node()
    agent = await start_agent(
        [node],
        region={
            **REGION, "agent_id": "crl-a1", "etcd": [url], "etcd_ca_file": certs.ca,
            "etcd_cert_file": certs.cert("agent-eu-west"),
            "etcd_key_file": certs.key("agent-eu-west"),
            "lease_ttl_s": 2, "window_s": 1.0, "min_interval_s": 0.2, "etcd_timeout_s": 2.0,
            "retry_base_s": 0.1, "retry_max_s": 0.5,
        },
    )  # fmt: skip
    settings = ControllerSettings(
        etcd={"endpoints": [url], "timeout_s": 2.0, "ca_file": certs.ca,
              "cert_file": certs.cert("meridian-controller"),
              "key_file": certs.key("meridian-controller")},
        election={"id": "ctl-crl", "lease_ttl_s": 2},
        failover={"window_s": 0.4, "status_stale_s": 3.0, "agent_heartbeat_s": 1.0,
                  "min_hold_s": 0.0},
        regions=[REGION],
        server={"port": 0},
    )  # fmt: skip
    app = create_app(settings)
    runner = web.AppRunner(app)
    await runner.setup()
    controller_runner.append(runner)
    controller = app[CONTROLLER]
    reader = etcd_client(url, timeout_s=2.0, **certs.access("meridian-controller"))

    async def state() -> str | None:
        with contextlib.suppress(meridian_etcd.EtcdError):
            entry = await reader.get(keys.health("eu-west"))
            if entry is not None:
                return RegionHealth.model_validate_json(entry.value).state
        return None

    try:
        await until(lambda: controller.election.leading, 15, "the controller to lead")
        deadline = time.monotonic() + 20
        while await state() != "healthy":
            assert time.monotonic() < deadline, "eu-west never judged healthy over TLS"
            await asyncio.sleep(0.1)
        publisher = agent.publisher
        assert publisher is not None and publisher.link.up is True
        assert publisher.link.refused is None

        # the CA revokes the agent's certificate; etcd restarts with the CRL
        caplog.set_level(logging.WARNING, logger="regional_agent")
        etcd_tls.restart(f"--client-crl-file={revoke(certs, 'agent-eu-west')}")

        statuses: list[int] = []
        async with httpx.AsyncClient(timeout=10) as http:
            deadline = time.monotonic() + 30
            while (judged := await state()) != "failed":
                assert time.monotonic() < deadline, f"eu-west still {judged} after 30 s"
                statuses.append(await _chat(http, agent.url))
                await asyncio.sleep(0.05)
            # the region lapsed, and the agent routed every request meanwhile ...
            assert statuses and set(statuses) == {200}, statuses
            assert publisher.link.up is False
            # ... and still does
            assert await _chat(http, agent.url) == 200
        # the agent says, loudly, why etcd refuses it and what to renew
        await until(lambda: publisher.link.refused is not None, 10, "the agent's diagnosis")
        assert publisher.link.refused is not None and "revoked" in publisher.link.refused
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("region.etcd_cert_file" in m for m in errors), errors
        # the controller's own certificate still works: it is the one that judged
        assert controller.election.leading and controller.etcd_ok
    finally:
        await reader.close()


async def test_an_agent_with_an_expired_certificate_serves_and_says_why(
    etcd_tls: Etcd, sim_node: Any, start_agent: AgentFactory, caplog: pytest.LogCaptureFixture
) -> None:
    certs = etcd_tls.certs
    cert, key = expired(certs, "agent-eu-west")
    caplog.set_level(logging.WARNING, logger="regional_agent")
    agent = await start_agent(
        [await sim_node()],
        region={
            **REGION, "agent_id": "old-a1", "etcd": [etcd_tls.server.url],
            "etcd_ca_file": certs.ca, "etcd_cert_file": cert, "etcd_key_file": key,
            "lease_ttl_s": 2, "etcd_timeout_s": 2.0, "retry_base_s": 0.1, "retry_max_s": 0.5,
        },
    )  # fmt: skip
    publisher = agent.publisher
    assert publisher is not None
    await until(lambda: publisher.link.refused is not None, 15, "the agent's diagnosis")
    assert publisher.link.up is False
    assert "certificate" in (publisher.link.refused or ""), publisher.link.refused
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("region.etcd_cert_file" in m for m in errors), errors
    async with httpx.AsyncClient(timeout=10) as http:
        assert [await _chat(http, agent.url) for _ in range(5)] == [200] * 5
    # etcd holds nothing of it: the certificate never got a call through
    reader = etcd_client(etcd_tls.server.url, timeout_s=2.0, **certs.access("meridian-controller"))
    try:
        assert await reader.get(keys.agent_alive("eu-west", "old-a1")) is None
    finally:
        await reader.close()
