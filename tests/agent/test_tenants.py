"""API keys, tenants and rate limits on the data plane, through a real agent in front of
simulated nodes, driven by the official ``openai`` client (docs/agent.md, "Tenants, keys and
rate limits").

Measured here: a valid key is served and a wrong or missing one is 401 naming nothing; a
forbidden model is 403; past its RPM a tenant gets 429 with every ``x-ratelimit-*`` header;
tokens are reserved as prompt + max_tokens and settled with the real usage (non-streamed: the
``usage`` field; streamed: the usage chunk, else the prompt plus one token per text chunk); keys
rotate on a file change and on SIGHUP, and a bad file keeps the old ones; two replicas of a
region each enforce their share of its limit (5 and 4 of 9), recomputed as replicas come and
go; under a full queue a high-priority request sheds the newest low one instead of being
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from meridian_wire import keys as etcd_keys
from policies import ratelimit
from regional_agent import cli
from regional_agent.tenants import new_key
from tests.agent import publishing
from tests.conftest import NodeFactory
from tests.faults.harness import AgentProc, NodeProc
from tests.support import EtcdServer
from tests.support.agent import AgentFactory, AgentHandle, metric
from tests.support.ports import free_port

MODEL = "tiny-model"
MESSAGES: list[Any] = [{"role": "user", "content": "hello there"}]
DURATION = re.compile(r"^(\d+h)?(\d+m)?\d+(\.\d+)?(ms|s)$")
LIMIT_HEADERS = [
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
]


# -- helpers ------------------------------------------------------------------------------------


def tenant(name: str, *hashes: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "keys": [{"sha256": h} for h in hashes], **fields}


def write_keys(path: Path, tenants: list[dict[str, Any]]) -> Path:
    """The keys file, written as an operator should: a new file renamed over the old one."""
    lines: list[str] = []
    for t in tenants:
        lines.append("[[tenants]]")
        for field, value in t.items():
            if field == "keys":
                continue
            if isinstance(value, bool):
                lines.append(f"{field} = {'true' if value else 'false'}")
            elif isinstance(value, int):
                lines.append(f"{field} = {value}")
            elif isinstance(value, list):
                lines.append(f"{field} = [{', '.join(repr(v) for v in value)}]")
            else:
                lines.append(f'{field} = "{value}"')
        for key in t["keys"]:
            lines += ["[[tenants.keys]]", f'sha256 = "{key["sha256"]}"']
    write_raw(path, "\n".join(lines) + "\n")
    return path


def write_raw(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.asynccontextmanager
async def client(url: str, key: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as c:
        yield c


async def chat(url: str, key: str, **kw: Any) -> Any:
    """A chat completion's raw response (headers and the parsed completion)."""
    async with client(url, key) as c:
        return await c.chat.completions.with_raw_response.create(
            model=kw.pop("model", MODEL),
            messages=MESSAGES,
            max_tokens=kw.pop("max_tokens", 4),
            **kw,
        )


async def served(url: str, key: str, **kw: Any) -> bool:
    try:
        await chat(url, key, **kw)
    except openai.AuthenticationError:
        return False
    return True


async def eventually(check: Any, *, what: str, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def used_tokens(handle: AgentHandle, name: str) -> int:
    limiter = handle.edge.tenants.limiter(name)
    assert limiter is not None
    return limiter.tokens.used(now=handle.edge.clock.now())


# -- keys ---------------------------------------------------------------------------------------


async def test_a_valid_key_is_served_a_wrong_one_is_401_and_a_forbidden_model_403(
    sim_node: NodeFactory, start_agent: AgentFactory, tmp_path: Path
) -> None:
    url = await sim_node()
    alpha, alpha_hash = new_key()
    beta, beta_hash = new_key()
    path = write_keys(
        tmp_path / "keys.toml",
        [
            tenant("alpha", alpha_hash, models=[MODEL]),
            tenant("beta", beta_hash, models=["other-model"]),
        ],
    )
    handle = await start_agent([url], tenants={"keys_file": str(path)})

    raw = await chat(handle.url, alpha)
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].message.content is not None
    async with client(handle.url, alpha) as c:
        assert [m.id async for m in c.models.list()] == [MODEL]

    messages = set()
    for key in ("mk-not-a-key", alpha + "x", alpha_hash):  # the hash is not the key
        with pytest.raises(openai.AuthenticationError) as caught:
            await chat(handle.url, key)
        assert caught.value.status_code == 401
        error = caught.value.response.json()["error"]
        assert error["type"] == "AuthenticationError"
        messages.add(error["message"])
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": f"Basic {alpha}"}, {"Authorization": "Bearer"}):
            body = {"model": MODEL, "messages": MESSAGES}
            async with s.post(f"{handle.url}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 401
                messages.add((await r.json())["error"]["message"])
        async with s.get(f"{handle.url}/v1/models") as r:
            assert r.status == 401
    (message,) = messages  # one answer, whatever was wrong
    for secret in ("alpha", "beta", alpha_hash[:8], beta_hash[:8]):
        assert secret not in message

    with pytest.raises(openai.PermissionDeniedError) as denied:
        await chat(handle.url, beta)
    assert denied.value.status_code == 403
    assert MODEL in denied.value.response.json()["error"]["message"]
    async with client(handle.url, beta) as c:
        assert [m.id async for m in c.models.list()] == []
    assert await metric(handle.url, "meridian_agent_tenant_refusals_total", cause="model") == 1
    assert (
        await metric(handle.url, "meridian_agent_tenant_refusals_total", cause="unauthenticated")
        >= 6
    )


def test_key_new_prints_a_key_and_its_hash(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["key", "new", "--tenant", "chat", "--name", "2026-03"]) == 0
    out = capsys.readouterr().out.splitlines()
    key = out[0]
    assert key.startswith("mk-") and len(key) > 40
    assert "chat" in out[1]
    assert out[2:] == [
        "[[tenants.keys]]",
        'name = "2026-03"',
        f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"',
    ]


# -- rate limits --------------------------------------------------------------------------------


async def test_past_its_rpm_a_tenant_gets_429_with_the_rate_limit_headers(
    sim_node: NodeFactory, start_agent: AgentFactory, tmp_path: Path
) -> None:
    url = await sim_node()
    key, digest = new_key()
    path = write_keys(tmp_path / "keys.toml", [tenant("team", digest, rpm=3, tpm=100_000)])
    handle = await start_agent([url], tenants={"keys_file": str(path)})
    for remaining in (2, 1, 0):
        raw = await chat(handle.url, key)
        headers = raw.http_response.headers
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert headers["x-ratelimit-remaining-requests"] == str(remaining)
        assert headers["x-ratelimit-limit-tokens"] == "100000"
        assert all(
            DURATION.match(headers[f"x-ratelimit-reset-{k}"]) for k in ("requests", "tokens")
        )
    with pytest.raises(openai.RateLimitError) as caught:
        await chat(handle.url, key)
    error = caught.value
    assert error.status_code == 429
    headers = error.response.headers
    assert all(name in headers for name in LIMIT_HEADERS)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["Retry-After"]) <= 61
    assert int(headers["retry-after-ms"]) <= 61_000
    assert DURATION.match(headers["x-ratelimit-reset-requests"])
    body = error.response.json()["error"]
    assert body["type"] == "RateLimitError"
    assert "requests per minute" in body["message"] and "team" in body["message"]
    # the refused request took nothing: still exactly three in the window
    limiter = handle.edge.tenants.limiter("team")
    assert limiter is not None and limiter.requests.used(now=handle.edge.clock.now()) == 3
    assert await metric(handle.url, "meridian_agent_tenant_refusals_total", cause="requests") == 1


async def test_tokens_are_reserved_at_admission_and_settled_with_the_usage(
    sim_node: NodeFactory, start_agent: AgentFactory, tmp_path: Path
) -> None:
    url = await sim_node()
    key, digest = new_key()
    path = write_keys(tmp_path / "keys.toml", [tenant("team", digest, tpm=600)])
    handle = await start_agent([url], tenants={"keys_file": str(path)})
    async with client(handle.url, key) as c:
        first = await c.completions.with_raw_response.create(
            model=MODEL, prompt="hello", max_tokens=300
        )
        usage = first.parse().usage
        assert usage is not None and usage.total_tokens < usage.prompt_tokens + 300
        reserved = usage.prompt_tokens + 300
        assert first.http_response.headers["x-ratelimit-remaining-tokens"] == str(600 - reserved)
        # settled: the window holds what it used, not what it reserved
        assert used_tokens(handle, "team") == usage.total_tokens
        # so a second request of the same size fits, which the reservation alone would refuse
        assert 2 * reserved > 600
        second = await c.completions.with_raw_response.create(
            model=MODEL, prompt="hello", max_tokens=300
        )
        left = 600 - usage.total_tokens - reserved
        assert second.http_response.headers["x-ratelimit-remaining-tokens"] == str(left)
        # a request that can never fit is told so
        with pytest.raises(openai.RateLimitError) as caught:
            await c.completions.create(model=MODEL, prompt="hello", max_tokens=700)
        body = caught.value.response.json()["error"]
        assert "Request too large" in body["message"] and "tokens per minute" in body["message"]
        assert "Retry-After" in caught.value.response.headers


async def test_streamed_usage_settles_from_the_usage_chunk_or_the_chunks(
    sim_node: NodeFactory, start_agent: AgentFactory, tmp_path: Path
) -> None:
    url = await sim_node()
    key, digest = new_key()
    path = write_keys(tmp_path / "keys.toml", [tenant("team", digest, tpm=5000)])
    handle = await start_agent([url], tenants={"keys_file": str(path)})
    async with client(handle.url, key) as c:
        stream = await c.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
        final = None
        async for chunk in stream:
            final = chunk.usage or final
        assert final is not None
        assert used_tokens(handle, "team") == final.total_tokens
        before = used_tokens(handle, "team")
        text_chunks = 0
        async for chunk in await c.completions.create(
            model=MODEL, prompt="hello", max_tokens=40, stream=True
        ):
            text_chunks += sum(1 for choice in chunk.choices if choice.text)
        assert text_chunks > 0
        # no usage chunk: the prompt as the agent counted it plus a token per text chunk
        assert used_tokens(handle, "team") - before == final.prompt_tokens + text_chunks
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{handle.url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True},
            headers={"Authorization": f"Bearer {key}"},
        ) as r,
    ):
        assert r.status == 200
        assert r.headers["x-ratelimit-limit-tokens"] == "5000"
        await r.read()


# -- rotation -----------------------------------------------------------------------------------


async def test_keys_rotate_when_the_file_changes_and_a_bad_file_keeps_them(
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = await sim_node()
    old, old_hash = new_key()
    new, new_hash = new_key()
    path = write_keys(tmp_path / "keys.toml", [tenant("team", old_hash)])
    handle = await start_agent([url], tenants={"keys_file": str(path), "reload_interval_s": 0.1})
    assert await served(handle.url, old)
    assert not await served(handle.url, new)
    # rotation: both keys for a while, then only the new one
    write_keys(path, [tenant("team", old_hash, new_hash)])
    await eventually(lambda: served(handle.url, new), what="the new key to work")
    assert await served(handle.url, old)
    write_keys(path, [tenant("team", new_hash)])

    async def old_refused() -> bool:
        return not await served(handle.url, old)

    await eventually(old_refused, what="the old key to be refused")
    caplog.set_level(logging.INFO, logger="regional_agent.tenants")
    for bad in ("[[tenants]\nname = ", '[[tenants]]\nname = "team"\n'):  # broken TOML, no keys
        failed = handle.edge.tenants.failed_reloads
        write_raw(path, bad)

        async def rejected(before: int = failed) -> bool:
            return handle.edge.tenants.failed_reloads > before

        await eventually(rejected, what="the bad file to be rejected")
        assert await served(handle.url, new)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not valid TOML" in w and "keeping the keys in force" in w for w in warnings)
    assert any("no keys" in w for w in warnings)
    assert not any(new_hash in r.getMessage() for r in caplog.records)


@pytest.fixture
def node_process(tmp_path: Path) -> Iterator[NodeProc]:
    node = NodeProc(port=free_port(), log_dir=tmp_path, time_scale=20.0).start()
    yield node
    node.stop()


async def test_sighup_reloads_the_keys_of_a_running_meridian_agent(
    node_process: NodeProc, tmp_path: Path
) -> None:
    old, old_hash = new_key()
    new, new_hash = new_key()
    path = write_keys(tmp_path / "keys.toml", [tenant("team", old_hash)])
    config = (
        f'[[nodes]]\nurl = "{node_process.url}"\n'
        f'[tenants]\nkeys_file = "{path}"\nreload_interval_s = 3600.0\n'  # only SIGHUP reloads
    )
    agent = AgentProc(port=free_port(), log_dir=tmp_path, config=config)
    await asyncio.to_thread(agent.start)
    try:
        await eventually(lambda: served(agent.url, old), what="the agent to serve the old key")
        write_keys(path, [tenant("team", new_hash)])
        await asyncio.sleep(0.3)
        assert await served(agent.url, old)  # no reload without the signal
        assert agent.process is not None
        os.kill(agent.process.pid, signal.SIGHUP)
        await eventually(lambda: served(agent.url, new), what="the new key after SIGHUP")
        assert not await served(agent.url, old)
        write_raw(path, "not toml at all [")
        os.kill(agent.process.pid, signal.SIGHUP)
        await eventually(
            lambda: _logged(agent, "API keys not reloaded (SIGHUP)"), what="the bad reload"
        )
        assert await served(agent.url, new)
        assert agent.process.exit_code() is None
        log = agent.process.log_path.read_text()
        assert "API keys reloaded (SIGHUP)" in log
        assert new not in log and new_hash not in log
    finally:
        agent.stop()


async def _logged(agent: AgentProc, needle: str) -> bool:
    assert agent.process is not None
    return needle in agent.process.log_path.read_text()


# -- replicas -----------------------------------------------------------------------------------


async def test_two_replicas_of_a_region_each_enforce_their_share_of_its_limit(
    sim_node: NodeFactory, start_agent: AgentFactory, etcd: EtcdServer, tmp_path: Path
) -> None:
    url = await sim_node()
    key, digest = new_key()
    path = write_keys(tmp_path / "keys.toml", [tenant("team", digest, rpm=9)])
    agents = [
        await start_agent(
            [url],
            tenants={"keys_file": str(path)},
            region=publishing.region(etcd, agent_id=agent_id),
        )
        for agent_id in ("a1", "a2")
    ]

    async def replicas(n: int) -> bool:
        return all(a.edge.tenants.replicas == n for a in agents)

    await eventually(lambda: replicas(2), what="both agents to see two replicas")
    admitted = []
    for handle in agents:
        ok = 0
        for _ in range(8):
            try:
                raw = await chat(handle.url, key, max_tokens=1)
            except openai.RateLimitError as exc:
                limit = exc.response.headers["x-ratelimit-limit-requests"]
            else:
                ok += 1
                limit = raw.http_response.headers["x-ratelimit-limit-requests"]
        admitted.append((ok, limit))
    assert admitted == [(5, "5"), (4, "4")]  # 9 split 5 + 4: never more than the region's 9

    # a third replica appears (its alive key), then goes: the shares follow
    async with publishing.client(etcd) as c:
        await c.put(etcd_keys.agent_alive(publishing.REGION, "a3").encode(), b"")
        await eventually(lambda: replicas(3), what="three replicas")
        team = agents[0].edge.tenants.tenant("team")
        assert team is not None
        assert [a.edge.tenants.shares(team).requests for a in agents] == [3, 3]
        await c.delete(etcd_keys.agent_alive(publishing.REGION, "a3").encode())
        await eventually(lambda: replicas(2), what="two replicas again")
    assert [a.edge.tenants.shares(team).requests for a in agents] == [5, 4]


async def test_without_a_region_the_replica_enforces_the_whole_limit(
    sim_node: NodeFactory, start_agent: AgentFactory, tmp_path: Path
) -> None:
    url = await sim_node()
    _, digest = new_key()
    path = write_keys(tmp_path / "keys.toml", [tenant("team", digest, rpm=9, tpm=1000)])
    handle = await start_agent([url], tenants={"keys_file": str(path)})
    team = handle.edge.tenants.tenant("team")
    assert team is not None
    assert handle.edge.tenants.shares(team) == ratelimit.Limits(requests=9, tokens=1000)


# -- priority and shedding ----------------------------------------------------------------------


async def _hang(s: aiohttp.ClientSession, url: str, on: bool) -> None:
    if on:
        async with s.post(f"{url}/admin/faults", json={"hang": True}) as r:
            assert r.status < 300
    else:
        async with s.delete(f"{url}/admin/faults") as r:
            assert r.status < 300


async def test_a_burst_of_low_priority_requests_cannot_push_a_high_one_into_429(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    url = await sim_node()
    handle = await start_agent(
        [url], policy="least_connections", queue={"slots_per_node": 1, "max_depth": 3}
    )
    statuses: dict[str, list[int]] = {"low": [], "high": []}
    async with aiohttp.ClientSession() as s:
        await _hang(s, url, True)  # the node holds whatever it gets: a slow, full region

        async def send(priority: str) -> None:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            async with s.post(
                f"{handle.url}/v1/completions", json=body, headers={"X-Priority": priority}
            ) as r:
                await r.read()
                statuses[priority].append(r.status)

        low = [asyncio.ensure_future(send("low")) for _ in range(8)]  # 1 runs, 3 wait, 4 refused
        await _until(lambda: len(statuses["low"]) == 4)
        assert statuses["low"] == [429] * 4
        high = asyncio.ensure_future(send("high"))
        await _until(lambda: len(statuses["low"]) == 5)  # the newest low one was shed for it
        assert handle.edge.dispatcher.stats.rejected["shed"] == 1
        await _hang(s, url, False)
        await asyncio.gather(high, *low)
    assert statuses["high"] == [200]
    assert sorted(statuses["low"]) == [200] * 3 + [429] * 5


async def test_with_keys_the_priority_is_the_tenants_and_sheds_the_lowest_first(
    sim_node: NodeFactory, start_agent: AgentFactory, tmp_path: Path
) -> None:
    """batch (low) fills the queue; its own X-Priority: high and X-Tenant: chat change nothing
    (429, queue full); ops (normal, trusted) with X-Priority: high and chat (high) each shed
    the newest batch request."""
    url = await sim_node()
    batch, batch_hash = new_key()
    ops, ops_hash = new_key()
    chat_key, chat_hash = new_key()
    path = write_keys(
        tmp_path / "keys.toml",
        [
            tenant("batch", batch_hash, priority="low"),
            tenant("ops", ops_hash, priority="normal", trust_priority=True),
            tenant("chat", chat_hash, priority="high"),
        ],
    )
    handle = await start_agent(
        [url],
        policy="least_connections",
        queue={"slots_per_node": 1, "max_depth": 2, "tenant_priority": {"chat": "high"}},
        tenants={"keys_file": str(path)},
    )
    results: dict[str, list[int]] = {}
    async with aiohttp.ClientSession() as s:
        await _hang(s, url, True)

        async def send(tag: str, key: str, **headers: str) -> None:
            body = {"model": MODEL, "prompt": tag, "max_tokens": 2}
            async with s.post(
                f"{handle.url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}", **headers},
            ) as r:
                await r.read()
                results.setdefault(tag, []).append(r.status)

        waiting = [asyncio.ensure_future(send(f"batch{i}", batch)) for i in range(3)]
        await _until(lambda: handle.edge.dispatcher.depth(MODEL) == 2)  # 1 runs, 2 wait
        await send("batch-says-high", batch, **{"X-Priority": "high", "X-Tenant": "chat"})
        await send("batch-says-nonsense", batch, **{"X-Priority": "urgent"})
        assert results["batch-says-high"] == [429] and results["batch-says-nonsense"] == [429]
        trusted = asyncio.ensure_future(send("ops", ops, **{"X-Priority": "high"}))
        await _until(lambda: handle.edge.dispatcher.stats.rejected["shed"] == 1)
        high = asyncio.ensure_future(send("chat", chat_key))
        await _until(lambda: handle.edge.dispatcher.stats.rejected["shed"] == 2)
        await _hang(s, url, False)
        await asyncio.gather(trusted, high, *waiting)
    assert results["ops"] == [200] and results["chat"] == [200]
    batch_statuses = sorted(results[f"batch{i}"][0] for i in range(3))
    assert batch_statuses == [200, 429, 429]  # the one running finished; both waiting shed


async def _until(check: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


# -- open mode ----------------------------------------------------------------------------------


async def _recording_node(seen: list[dict[str, str]]) -> tuple[web.AppRunner, str]:
    """A node that records the headers of each completion it serves."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def ok(_: web.Request) -> web.Response:
        return web.Response()

    async def complete(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_open_mode_serves_everyone_as_before_and_warns(
    start_agent: AgentFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[dict[str, str]] = []
    runner, url = await _recording_node(seen)
    try:
        caplog.set_level(logging.WARNING, logger="regional_agent.app")
        handle = await start_agent([url])
        assert any(
            r.levelno == logging.WARNING and "data plane is open" in r.getMessage()
            for r in caplog.records
        )
        async with client(handle.url, "whatever-the-node-wants") as c:
            raw = await c.completions.with_raw_response.create(
                model=MODEL, prompt="x", extra_headers={"X-Priority": "high"}
            )
        assert raw.http_response.status_code == 200
        assert "x-ratelimit-limit-requests" not in raw.http_response.headers
        assert seen[-1]["Authorization"] == "Bearer whatever-the-node-wants"  # forwarded

        # with keys the client's key stays at the agent
        key, digest = new_key()
        path = write_keys(tmp_path / "keys.toml", [tenant("team", digest)])
        caplog.clear()
        keyed = await start_agent([url], tenants={"keys_file": str(path)})
        assert not any("data plane is open" in r.getMessage() for r in caplog.records)
        async with client(keyed.url, key) as c:
            await c.completions.create(model=MODEL, prompt="x")
        assert "Authorization" not in seen[-1]
    finally:
        await runner.cleanup()


def test_a_bad_keys_file_stops_the_agent_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.toml"
    write_raw(path, '[[tenants]]\nname = "team"\n[[tenants.keys]]\nsha256 = "mk-plain-key"\n')
    config = tmp_path / "agent.toml"
    config.write_text(f'[[nodes]]\nurl = "http://127.0.0.1:1"\n[tenants]\nkeys_file = "{path}"\n')
    assert cli.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "tenants.keys_file" in err and "64 hex digits" in err
    assert "mk-plain-key" not in err
