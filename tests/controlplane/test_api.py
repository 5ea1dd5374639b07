"""The admin API against a real controller and real etcd: reads, actions, auth, audit,
idempotency, forwarding to the leader, policies, TLS and bad input.

Stand-in agents publish three regions (``tests/meridianctl/stack.py``): eu-west and eu-north
(geography eu, residency eu) and us-east (geography us, no residency).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

import meridian_etcd
from controlplane import failover_policy
from controlplane.api import actions, routes
from controlplane.api import keys as api_keys
from controlplane.api.auth import Caller
from controlplane.api.problems import Unavailable
from controlplane.api.server import ADMIN_API, AdminApi
from controlplane.app import Controller
from controlplane.settings.api import ApiSettings
from meridian_wire import keys
from meridian_wire.models import FleetPlan, RegionHealth, RegionOverride
from tests.faults.harness import wait_http
from tests.meridianctl.stack import TOKENS, Stack
from tests.support import EtcdServer, until
from tests.support.certs import CertAuthority, serial
from tests.support.ports import free_port
from tests.support.process import ServerProcess

AUTH = {role: {"Authorization": f"Bearer {t}"} for role, t in TOKENS.items()}


@pytest.fixture
async def stack(etcd: EtcdServer) -> AsyncIterator[Stack]:
    s = Stack(etcd.url)
    s.start_agents()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def leader(stack: Stack) -> Controller:
    await stack.controller("ctl-a")
    return await stack.leader()


@pytest.fixture
async def client(stack: Stack, leader: Controller) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url("ctl-a"), timeout=10) as c:
        yield c


async def _audit(stack: Stack) -> list[dict[str, Any]]:
    entries = sorted((await stack.store.get_prefix(keys.AUDIT)).entries, key=lambda e: e.key)
    return [json.loads(e.value) for e in entries]


async def _health(stack: Stack, region: str) -> RegionHealth:
    entry = await stack.store.get(keys.health(region))
    assert entry is not None
    return RegionHealth.model_validate_json(entry.value)


async def _serving(stack: Stack) -> dict[str, dict[str, float]]:
    entry = await stack.store.get(keys.PLAN)
    assert entry is not None
    return FleetPlan.model_validate_json(entry.value).serving


def _problem(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = r.json()
    assert body["status"] == status and body["detail"] and body["title"]
    return body


# -- reads -------------------------------------------------------------------------------------


async def test_regions_lists_every_region_with_its_state(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/regions", headers=AUTH["viewer"])
    assert r.status_code == 200, r.text
    rows = {row["region"]: row for row in r.json()["regions"]}
    assert set(rows) == {"eu-west", "eu-north", "us-east"}
    west = rows["eu-west"]
    assert west["state"] == "healthy" and west["weight"] == 1.0 and west["capacity"] == 4.0
    assert west["backup"] == "eu-north" and rows["eu-north"]["floor"] >= 2.0
    one = await client.get("/v1/regions/eu-west", headers=AUTH["viewer"])
    assert one.status_code == 200 and one.json()["status"]["geo"] == "eu"
    body = _problem(await client.get("/v1/regions/mars-1", headers=AUTH["viewer"]), 404)
    assert "eu-west" in body["fix"]
    health = await client.get("/v1/health")
    assert health.status_code == 200 and health.json()["leading"] is True
    assert 0 < health.json()["pass_s"] < 5 and health.json()["pass_writes"] >= 1  # last pass
    dns = await client.get("/v1/dns", headers=AUTH["viewer"])
    assert dns.status_code == 200 and dns.json() == {"applied": None, "problem": None}


async def test_the_read_port_serves_the_same_reads_and_refuses_writes(
    stack: Stack, leader: Controller, client: httpx.AsyncClient
) -> None:
    """One resource, one handler: the read port (server.port) mounts the admin API's GET routes
    as they are (same roles, same shapes); a write there says where writes go."""
    runner = stack.runners["ctl-a"]
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as read:
            for path in ("/v1/regions", "/v1/regions/eu-west", "/v1/events", "/v1/policies"):
                here = await read.get(path, headers=AUTH["viewer"])
                there = await client.get(path, headers=AUTH["viewer"])
                assert here.status_code == there.status_code == 200, (path, here.text)
                assert set(here.json()) == set(there.json()), path
            detail = (await read.get("/v1/regions/eu-west", headers=AUTH["viewer"])).json()
            assert set(detail["agents"]) and set(detail["tables"]) == set()  # no group tables
            _problem(await read.get("/v1/regions"), 401)  # the same roles
            health = await read.get("/health")
            assert health.status_code == 200 and set(health.json()) == set(
                (await client.get("/v1/health")).json()
            )
            body = _problem(
                await read.post(
                    "/v1/regions/eu-west/drain", json={"reason": "x"}, headers=AUTH["operator"]
                ),
                405,
            )
            assert "read port" in body["detail"] and "--admin-port" in body["fix"]
            assert (await _health(stack, "eu-west")).state == "healthy"  # nothing changed
    finally:
        await site.stop()


async def test_openapi_document_covers_every_route(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/v1/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    for route in routes.ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        if route.body is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
    schema = doc["components"]["schemas"]["PoliciesUpdate"]
    assert schema["properties"]["strikes"]["anyOf"][0]["minimum"] == 1
    assert "Problem" in doc["components"]["schemas"]


# -- auth ----------------------------------------------------------------------------------------


async def test_unauthenticated_and_wrong_role_calls_are_refused(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    before = await stack.snapshot()
    for route in routes.ROUTES:
        if route.role is None:
            continue
        path = route.path.replace("{region}", "eu-west")
        body = {"reason": "test"} if route.body is not None else None
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            r = await client.request(route.method, path, headers=headers, json=body)
            problem = _problem(r, 401)
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert problem["fix"]
        too_low = {"operator": "viewer", "admin": "operator"}.get(route.role)
        if too_low is not None:
            r = await client.request(route.method, path, headers=AUTH[too_low], json=body)
            assert f"needs role {route.role}" in _problem(r, 403)["detail"]
    assert await stack.snapshot() == before
    assert await _audit(stack) == []


# -- actions -----------------------------------------------------------------------------------


async def test_failover_dry_run_then_apply_then_failback(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    before = await stack.snapshot()
    r = await client.post(
        "/v1/regions/eu-west/failover?dry_run=true",
        json={"reason": "test dry run"},
        headers=AUTH["operator"],
    )
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["dry_run"] is True and plan["applied"] is False
    assert plan["serving_after"]["eu"] == {"eu-north": 1.0}
    assert any(c["region"] == "eu-west" and c["state_after"] == "failed" for c in plan["changes"])
    assert await stack.snapshot() == before  # a dry run changes nothing
    assert (await _health(stack, "eu-west")).state == "healthy"

    r = await client.post(
        "/v1/regions/eu-west/failover", json={"reason": "bad deploy"}, headers=AUTH["operator"]
    )
    assert r.status_code == 200 and r.json()["applied"] is True, r.text
    health = await _health(stack, "eu-west")
    assert health.state == "failed" and health.manual and health.backup == "eu-north"
    assert (await _serving(stack))["eu"] == {"eu-north": 1.0}
    override = await stack.store.get(keys.override("eu-west"))
    assert override is not None
    assert RegionOverride.model_validate_json(override.value).by == "operator-user"
    await asyncio.sleep(3 * 0.5)  # windows pass: the manual failover holds
    assert (await _health(stack, "eu-west")).state == "failed"

    r = await client.post(
        "/v1/regions/eu-west/failback", json={"reason": "fixed"}, headers=AUTH["operator"]
    )
    assert r.status_code == 200, r.text
    assert await stack.store.get(keys.override("eu-west")) is None
    state = (await _health(stack, "eu-west")).state
    assert state in ("recovering", "healthy", "failed")  # ramps back from here
    for _ in range(100):
        if (await _health(stack, "eu-west")).state == "healthy":
            break
        await asyncio.sleep(0.1)
    assert (await _health(stack, "eu-west")).state == "healthy"

    audit = await _audit(stack)
    assert [(a["action"], a["result"]) for a in audit] == [
        ("failover", "dry-run"),
        ("failover", "applied"),
        ("failback", "applied"),
    ]
    for entry in audit:
        assert entry["who"] == "operator-user" and entry["role"] == "operator"
        assert entry["reason"] and entry["at"] > 0 and entry["controller"] == "ctl-a"
    assert audit[1]["reason"] == "bad deploy"
    ids = {a["id"] for a in audit}
    assert r.json()["audit_id"] in ids


async def test_drain_and_undrain_move_traffic(stack: Stack, client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/regions/us-east/drain", json={"reason": "maintenance"}, headers=AUTH["operator"]
    )
    # us-east has no region that meets... it has no residency: eu regions may back it up
    assert r.status_code == 200, r.text
    assert (await _health(stack, "us-east")).state == "drained"
    assert "us-east" not in (await _serving(stack))["us"]
    r = await client.post(
        "/v1/regions/us-east/drain", json={"reason": "again"}, headers=AUTH["operator"]
    )
    assert "undrain" in _problem(r, 409)["fix"]
    r = await client.post(
        "/v1/regions/us-east/undrain", json={"reason": "done"}, headers=AUTH["operator"]
    )
    assert r.status_code == 200, r.text
    assert await stack.store.get(keys.override("us-east")) is None
    assert [a["result"] for a in await _audit(stack)] == ["applied", "refused", "applied"]


async def test_bad_input_is_refused_with_what_to_do_and_nothing_changes(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    op = AUTH["operator"]
    # a drain that would leave geography eu with no region serving
    r = await client.post("/v1/regions/eu-north/drain", json={"reason": "a"}, headers=op)
    assert r.status_code == 200, r.text
    before = await stack.snapshot()
    body = _problem(
        await client.post("/v1/regions/eu-west/drain", json={"reason": "b"}, headers=op), 409
    )
    assert "no region serving" in body["detail"] and "undrain" in body["fix"]
    assert await stack.snapshot() == before
    await client.post("/v1/regions/eu-north/undrain", json={"reason": "c"}, headers=op)
    for _ in range(100):  # it ramps back; then the fleet is steady
        if (await _health(stack, "eu-north")).state == "healthy":
            break
        await asyncio.sleep(0.1)
    before = await stack.snapshot()
    cases: list[tuple[str, str, Any, int, str]] = [
        ("/v1/regions/mars-1/drain", "POST", {"reason": "x"}, 404, "known regions"),
        ("/v1/regions/eu-west/failover", "POST", {"reason": "x", "target": "us-east"}, 422,
         "eu-north"),
        ("/v1/regions/eu-west/failover", "POST", {"reason": "x", "target": "eu-west"}, 422, ""),
        ("/v1/regions/eu-west/failover", "POST", {"reason": "x", "target": "nope"}, 422, ""),
        ("/v1/regions/eu-west/drain", "POST", "{not json", 400, "JSON object"),
        ("/v1/regions/eu-west/drain", "POST", [1, 2], 400, "JSON object"),
        ("/v1/regions/eu-west/drain", "POST", {}, 422, "reason"),
        ("/v1/regions/eu-west/drain", "POST", {"reason": "x", "extra": 1}, 422, ""),
        ("/v1/regions/eu-west/failback", "POST", {"reason": "x"}, 409, "regions show"),
        ("/v1/regions/eu-west/undrain", "POST", {"reason": "x"}, 409, "drain"),
        ("/v1/regions/eu-west/drain?dry_run=maybe", "POST", {"reason": "x"}, 400, "true"),
        ("/v1/policies", "PUT", {"reason": "x", "strikes": 0}, 422, "greater than"),
        ("/v1/policies", "PUT", {"reason": "x", "prewarm_fraction": 1.5}, 422, ""),
        ("/v1/policies", "PUT", {"reason": "x", "ramp": [0.5, 0.2, 1.0]}, 422, ""),
        ("/v1/policies", "PUT", {"reason": "x", "ramp": [0.5, 0.9]}, 422, ""),
        ("/v1/policies", "PUT", {"reason": "x", "window_s": -1}, 422, ""),
        ("/v1/policies", "PUT", {"reason": "x", "status_stale_s": 1.5}, 422,
         "at least twice failover.agent_heartbeat_s"),
        ("/v1/events?limit=zero", "GET", None, 400, "limit"),
        ("/v1/nowhere", "GET", None, 404, "openapi"),
    ]  # fmt: skip
    headers = {**AUTH["admin"], "Content-Type": "application/json"}
    for path, method, body, status, needle in cases:
        content = body if isinstance(body, str) else json.dumps(body) if body is not None else None
        r = await client.request(method, path, content=content, headers=headers)
        problem = _problem(r, status)
        assert needle in problem["detail"] + problem["fix"], (path, body, problem)
    residency = await client.post(
        "/v1/regions/eu-west/failover", json={"reason": "x", "target": "us-east"}, headers=op
    )
    assert "residency" in residency.json()["detail"]
    assert await stack.snapshot() == before


async def test_an_idempotency_key_answers_again_without_acting_twice(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    headers = {**AUTH["operator"], "Idempotency-Key": "k-1"}
    first = await client.post("/v1/regions/us-east/drain", json={"reason": "m"}, headers=headers)
    again = await client.post("/v1/regions/us-east/drain", json={"reason": "m"}, headers=headers)
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json() and again.headers["idempotent-replayed"] == "true"
    other = await client.post("/v1/regions/us-east/drain", json={"reason": "n"}, headers=headers)
    assert "Idempotency-Key" in _problem(other, 422)["detail"]
    audit = await _audit(stack)
    assert [(a["action"], a["result"], a["idempotency_key"]) for a in audit] == [
        ("drain", "applied", "k-1")
    ]


async def test_a_write_sent_to_a_follower_goes_through_the_leader(stack: Stack) -> None:
    await stack.controller("ctl-a")
    leader = await stack.leader()
    await stack.controller("ctl-b")
    follower = "ctl-b" if leader.election.identity == "ctl-a" else "ctl-a"
    await until(lambda: True, 0, "")
    async with httpx.AsyncClient(base_url=stack.url(follower), timeout=10) as c:
        for _ in range(50):  # the leader publishes its admin URL within a moment
            r = await c.post(
                "/v1/regions/us-east/drain?dry_run=true",
                json={"reason": "via follower"},
                headers=AUTH["operator"],
            )
            if r.status_code != 503:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 200, r.text
        r = await c.post(
            "/v1/regions/us-east/drain", json={"reason": "via follower"}, headers=AUTH["operator"]
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-meridian-leader"] == leader.election.identity
        reads = await c.get("/v1/regions", headers=AUTH["viewer"])
        assert reads.status_code == 200
    audit = await _audit(stack)
    assert audit[-1]["received_by"] == follower
    assert audit[-1]["controller"] == leader.election.identity
    assert (await _health(stack, "us-east")).state == "drained"


async def test_policies_are_validated_stored_and_applied_at_the_next_window(
    stack: Stack, client: httpx.AsyncClient, leader: Controller
) -> None:
    r = await client.get("/v1/policies", headers=AUTH["viewer"])
    assert r.json()["source"] == "settings" and r.json()["values"]["strikes"] == 3
    r = await client.put(
        "/v1/policies",
        json={"reason": "slower windows", "window_s": 0.7, "strikes": 4, "ttft_check": False},
        headers=AUTH["admin"],
    )
    assert r.status_code == 200, r.text
    values = r.json()["values"]
    assert values["strikes"] == 4 and values["ttft_p99_slo_s"] is None
    assert r.json()["source"] == "etcd" and r.json()["by"] == "admin-user"
    assert await stack.store.get(failover_policy.KEY) is not None
    passes = leader.passes
    await until(lambda: leader.passes >= passes + 2, 10, "windows")
    assert leader.last_pass is not None and leader.last_pass.recheck_after_s == 0.7
    audit = await _audit(stack)
    assert audit[-1]["action"] == "policies" and '"strikes": 4' in audit[-1]["detail"]


def _self_signed(tmp: Path) -> dict[str, Path]:
    cert, key = tmp / "admin.crt", tmp / "admin.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return {"cert_file": cert, "key_file": key}


async def test_tls_from_the_configured_certificate_and_key(stack: Stack, tmp_path: Path) -> None:
    tls = _self_signed(tmp_path)
    await stack.controller("ctl-tls", tls=tls)
    await stack.leader()
    url = stack.url("ctl-tls")
    assert url.startswith("https://")
    trusted = ssl.create_default_context(cafile=str(tls["cert_file"]))
    async with httpx.AsyncClient(verify=trusted, timeout=10) as c:
        r = await c.get(url + "/v1/regions", headers=AUTH["viewer"])
        assert r.status_code == 200 and len(r.json()["regions"]) == 3
    async with httpx.AsyncClient(timeout=10) as c:  # not trusted by default
        with pytest.raises(httpx.ConnectError):
            await c.get(url + "/v1/health")
    async with httpx.AsyncClient(timeout=10) as c:  # plain HTTP on the TLS port
        plain = url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            await c.get(plain + "/v1/health")


async def _published(stack: Stack, leader: str) -> str:
    """The admin URL ``leader`` published under ``controller/admin``, once it has."""
    for _ in range(100):
        entry = await stack.store.get(api_keys.ADMIN)
        if entry is not None and json.loads(entry.value)["id"] == leader:
            return str(json.loads(entry.value)["url"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"{leader} never published its admin URL")


def _admin_api(stack: Stack, name: str) -> AdminApi:
    app = stack.runners[name].app
    assert app is not None
    return app[ADMIN_API]


def _accepted(stack: Stack, name: str) -> int:
    """Connections the replica's admin port has accepted (TLS handshakes completed), ever."""
    runner = _admin_api(stack, name).runner
    assert runner is not None
    return runner.connections.accepted


async def test_a_tls_follower_never_forwards_a_token_to_a_plain_http_leader(
    stack: Stack, tmp_path: Path
) -> None:
    await stack.controller("ctl-a")  # plain HTTP
    leader = await stack.leader()
    assert leader.election.identity == "ctl-a"
    tls = _self_signed(tmp_path)
    await stack.controller("ctl-b", tls=tls)
    leader_url = await _published(stack, "ctl-a")
    assert leader_url.startswith("http://")
    accepted, audit = _accepted(stack, "ctl-a"), await _audit(stack)
    trusted = ssl.create_default_context(cafile=str(tls["cert_file"]))
    async with httpx.AsyncClient(base_url=stack.url("ctl-b"), verify=trusted, timeout=10) as c:
        for path in ("/v1/regions/us-east/drain", "/v1/regions/us-east/drain?dry_run=true"):
            r = await c.post(path, json={"reason": "via tls follower"}, headers=AUTH["operator"])
            body = _problem(r, 503)
            assert "plain-HTTP admin URL" in body["detail"] and leader_url in body["detail"]
            assert "nothing was sent" in body["detail"] and "api.tls" in body["fix"]
    assert _accepted(stack, "ctl-a") == accepted  # not one connection reached the leader
    assert await _audit(stack) == audit
    assert (await _health(stack, "us-east")).state != "drained"
    async with httpx.AsyncClient(timeout=10) as c:  # the counter does count a request that comes
        r = await c.post(
            f"{leader_url}/v1/regions/us-east/drain?dry_run=true",
            json={"reason": "direct"},
            headers=AUTH["operator"],
        )
        assert r.status_code == 200, r.text
    assert _accepted(stack, "ctl-a") == accepted + 1


async def test_tls_replicas_forward_over_https_verifying_the_leader(
    stack: Stack, tmp_path: Path
) -> None:
    tls = _self_signed(tmp_path)  # one self-signed certificate, shared: each trusts it
    await stack.controller("ctl-a", tls=tls)
    assert (await stack.leader()).election.identity == "ctl-a"
    other = tmp_path / "other"
    other.mkdir()
    stranger = _self_signed(other)  # ctl-c trusts another certificate only
    await stack.controller("ctl-b", tls=tls)
    await stack.controller("ctl-c", tls={**tls, "ca_file": stranger["cert_file"]})
    assert (await _published(stack, "ctl-a")).startswith("https://")
    trusted = ssl.create_default_context(cafile=str(tls["cert_file"]))
    async with httpx.AsyncClient(base_url=stack.url("ctl-b"), verify=trusted, timeout=10) as c:
        r = await c.post(
            "/v1/regions/us-east/drain?dry_run=true",
            json={"reason": "via follower, https"},
            headers=AUTH["operator"],
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-meridian-leader"] == "ctl-a"
    assert (await _audit(stack))[-1]["received_by"] == "ctl-b"
    accepted, audit = _accepted(stack, "ctl-a"), await _audit(stack)
    async with httpx.AsyncClient(base_url=stack.url("ctl-c"), verify=trusted, timeout=10) as c:
        r = await c.post(
            "/v1/regions/us-east/drain?dry_run=true",
            json={"reason": "via a follower that does not trust the leader"},
            headers=AUTH["operator"],
        )
        body = _problem(r, 503)
        assert "could not reach the leader" in body["detail"]
    assert _accepted(stack, "ctl-a") == accepted  # the handshake failed: no request was read
    assert await _audit(stack) == audit


def test_a_tls_replica_may_not_advertise_a_plain_http_url(tmp_path: Path) -> None:
    tls = _self_signed(tmp_path)
    with pytest.raises(ValueError, match="advertise_url"):
        ApiSettings.model_validate({"port": 0, "tls": tls, "advertise_url": "http://10.0.0.1:8091"})
    assert ApiSettings.model_validate(
        {"port": 0, "tls": tls, "advertise_url": "https://ctl-a.example:8091"}
    )


async def test_policies_dry_run_answers_the_values_and_stores_nothing(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    r = await client.put(
        "/v1/policies?dry_run=true",
        json={"reason": "what if", "strikes": 5},
        headers=AUTH["admin"],
    )
    assert r.status_code == 200, r.text
    assert r.json()["values"]["strikes"] == 5
    assert await stack.store.get(failover_policy.KEY) is None  # nothing stored
    current = await client.get("/v1/policies", headers=AUTH["viewer"])
    assert current.json()["source"] == "settings" and current.json()["values"]["strikes"] == 3
    audit = await _audit(stack)
    assert [(a["action"], a["result"], a["dry_run"]) for a in audit] == [
        ("policies", "dry-run", True)
    ]


def _failing_request() -> actions.Request:
    return actions.Request(
        caller=Caller(name="operator-user", role="operator"), action="drain", region="eu-west",
        reason="INC-9", idempotency_key="key-1", fingerprint="f", received_by="ctl-a",
    )  # fmt: skip


async def test_an_action_that_fails_with_a_5xx_is_audited_as_an_error(
    stack: Stack, leader: Controller
) -> None:
    app = stack.runners["ctl-a"].app
    assert app is not None
    api = app[ADMIN_API]
    failures: list[Exception] = [
        meridian_etcd.Unavailable("etcd timed out during the commit"),
        Unavailable("the plan could not be written", fix="retry"),
    ]
    for failure in failures:

        async def work(
            fence: meridian_etcd.Fence, audit_id: str, failure: Exception = failure
        ) -> actions.Reply:
            raise failure

        with pytest.raises(type(failure)) as raised:
            await actions._run(api.leader, _failing_request(), work)
        assert raised.value is failure  # the original error, not masked
    audit = await _audit(stack)
    assert [(a["result"], a["status"], a["action"], a["who"]) for a in audit] == [
        ("error", 503, "drain", "operator-user")
    ] * 2
    assert "etcd timed out" in audit[0]["detail"] and "could not be written" in audit[1]["detail"]
    # no answer is kept for the key: a retry with it runs the action
    assert (await stack.store.get_prefix(api_keys.IDEMPOTENCY)).entries == ()


async def test_a_5xx_with_etcd_gone_is_raised_as_it_was(fresh_etcd: EtcdServer) -> None:
    stack = Stack(fresh_etcd.url)
    try:
        await stack.controller("ctl-a")
        await stack.leader()
        app = stack.runners["ctl-a"].app
        assert app is not None
        failure = Unavailable("the plan could not be written", fix="retry")

        async def work(fence: meridian_etcd.Fence, audit_id: str) -> actions.Reply:
            fresh_etcd.process.kill()
            raise failure

        with pytest.raises(Unavailable) as raised:
            await actions._run(app[ADMIN_API].leader, _failing_request(), work)
        assert raised.value is failure
    finally:
        await stack.close()


# -- hostile input -----------------------------------------------------------------------------


async def test_deep_nesting_nan_and_infinity_are_400s_naming_the_field(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    """Python's json raises RecursionError on deep nesting (a 500 before) and accepts NaN,
    Infinity and -Infinity (JSON has none; a double's overflow, 1e999, is one too)."""
    before = await stack.snapshot()
    headers = {**AUTH["admin"], "Content-Type": "application/json"}
    deep = b"[" * 60_000  # under the 64 KiB body cap
    for path, method in (("/v1/regions/eu-west/drain", "POST"), ("/v1/policies", "PUT")):
        problem = _problem(await client.request(method, path, content=deep, headers=headers), 400)
        assert (
            "nested too deeply" in problem["detail"] and "nothing was changed" in problem["detail"]
        )
        assert "for example" in problem["fix"]
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = '{"reason": "x", "prewarm_fraction": ' + literal + "}"
        problem = _problem(await client.put("/v1/policies", content=body, headers=headers), 400)
        assert problem["detail"] == (
            f"prewarm_fraction: {literal} is not a JSON number; nothing was changed"
        ), problem
        assert problem["errors"] == [f"prewarm_fraction: {literal} is not a JSON number"]
        assert "finite number" in problem["fix"]
    nested = '{"reason": "x", "ramp": [0.5, NaN, 1.0]}'
    problem = _problem(await client.put("/v1/policies", content=nested, headers=headers), 400)
    assert problem["detail"].startswith("ramp[1]: NaN is not a JSON number"), problem
    long_int = '{"reason": "x", "strikes": ' + "9" * 5000 + "}"
    problem = _problem(await client.put("/v1/policies", content=long_int, headers=headers), 400)
    assert "too long" in problem["detail"], problem
    assert await stack.snapshot() == before
    r = await client.get("/v1/regions", headers=AUTH["viewer"])  # and it serves the rest
    assert r.status_code == 200, r.text


async def test_405_carries_allow(
    stack: Stack, leader: Controller, client: httpx.AsyncClient
) -> None:
    """RFC 9110: a 405 lists the methods the resource allows, on both ports."""
    for method, path, allow in (
        ("DELETE", "/v1/regions", "GET"),
        ("GET", "/v1/regions/eu-west/drain", "POST"),
        ("POST", "/v1/policies", "GET, PUT"),
    ):
        r = await client.request(method, path, headers=AUTH["admin"])
        problem = _problem(r, 405)
        assert r.headers.get("allow") == allow, (method, path, r.headers)
        assert problem["detail"] == f"{method} is not allowed on {path}; it allows {allow}"
    runner = stack.runners["ctl-a"]  # the read port: writes are refused, reads allowed
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as read:
            r = await read.put("/v1/policies", json={"reason": "x"}, headers=AUTH["admin"])
            assert "read port" in _problem(r, 405)["detail"]
            assert r.headers.get("allow") == "GET"
            r = await read.post("/v1/regions/eu-west/drain", json={"reason": "x"})
            _problem(r, 405)
            assert r.headers.get("allow") == ""  # nothing is allowed there on this port
    finally:
        await site.stop()
    assert (await client.get("/v1/regions", headers=AUTH["viewer"])).status_code == 200


async def test_a_flood_of_malformed_requests_is_a_few_short_log_lines(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """A real meridian-controller: 200 requests that are not HTTP at its admin port write one
    short line to its log, not a traceback each, and it keeps answering."""
    read_port, admin_port = free_port(), free_port()
    config = tmp_path / "controller.toml"
    config.write_text(
        f'[etcd]\nendpoints = ["{etcd.url}"]\n[election]\nid = "ctl-flood"\n'
        f"[server]\nport = {read_port}\n[api]\nport = {admin_port}\n"
    )
    log = tmp_path / "controller.log"
    argv = [sys.executable, "-m", "controlplane.cli", "--config", str(config)]
    process = ServerProcess(argv, log_path=log)
    try:
        url = f"http://127.0.0.1:{admin_port}"
        async with httpx.AsyncClient(base_url=url, timeout=5) as c:
            for _ in range(300):
                if process.exit_code() is not None:
                    raise process.failure("meridian-controller exited")
                try:
                    if (await c.get("/v1/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            before = log.read_text().count("\n")
            garbage = (
                b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
                b"GARBAGE\r\n\r\n",
            )
            for i in range(200):
                reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
                writer.write(garbage[i % len(garbage)])
                await asyncio.wait_for(reader.read(), timeout=10)  # a 400, then closed
                writer.close()
                await writer.wait_closed()
            assert (await c.get("/v1/health")).status_code == 200
        await asyncio.sleep(0.5)
        text = log.read_text()
        lines = text.splitlines()[before:]
        assert "Traceback" not in text, text[-3000:]
        malformed = [line for line in lines if "malformed HTTP request from 127.0.0.1" in line]
        assert len(malformed) == 1 and " INFO aiohttp.server " in malformed[0], lines
        assert len(malformed[0]) < 400, malformed
    finally:
        process.stop()


def test_the_admin_port_reloads_its_certificate_on_sighup(etcd: EtcdServer, tmp_path: Path) -> None:
    """A real meridian-controller: SIGHUP reads api.tls's pair again (meridian_service.tls,
    as the agent's listener does); a kept connection stays on the old one."""
    ca = CertAuthority.create(tmp_path / "pki")
    first, second = ca.issue("first", serial=501), ca.issue("second", serial=502)
    cert, key = tmp_path / "admin.crt", tmp_path / "admin.key"
    cert.write_bytes(first.cert.read_bytes())
    key.write_bytes(first.key.read_bytes())
    read_port, admin_port = free_port(), free_port()
    config = tmp_path / "controller.toml"
    config.write_text(
        f'[etcd]\nendpoints = ["{etcd.url}"]\n[election]\nid = "ctl-hup"\n'
        f"[server]\nport = {read_port}\n[api]\nport = {admin_port}\n"
        f'[api.tls]\ncert_file = "{cert}"\nkey_file = "{key}"\nca_file = "{ca.cert}"\n'
    )
    argv = [sys.executable, "-m", "controlplane.cli", "--config", str(config)]
    process = ServerProcess(argv, log_path=tmp_path / "controller.log")

    def serial_now() -> int:
        with (
            socket.create_connection(("127.0.0.1", admin_port), timeout=5) as raw,
            ca.client().wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            return serial(tls.getpeercert())

    try:
        url = f"https://127.0.0.1:{admin_port}"
        wait_http(f"{url}/v1/health", what="the admin API", process=process, context=ca.client())
        with (
            socket.create_connection(("127.0.0.1", admin_port), timeout=5) as raw,
            ca.client().wrap_socket(raw, server_hostname="127.0.0.1") as kept,
        ):
            assert serial(kept.getpeercert()) == first.serial
            for source, target in ((second.cert, cert), (second.key, key)):
                target.with_suffix(".new").write_bytes(source.read_bytes())
                target.with_suffix(".new").replace(target)
            os.kill(process.pid, signal.SIGHUP)
            end = time.monotonic() + 10
            while serial_now() != second.serial:
                assert time.monotonic() < end, process.log_tail()
                time.sleep(0.05)
            kept.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert kept.recv(64).startswith(b"HTTP/1.1 200")
        assert process.exit_code() is None
        assert "TLS certificate reloaded" in process.log_tail()
    finally:
        process.stop()
