"""The agent end to end: simulated nodes behind a real agent, driven by the ``openai`` client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest
from aiohttp import web

from policies import routing
from tests.agent.conftest import ADMIN, AgentFactory, AgentHandle, SimProcess
from tests.conftest import NodeFactory
from tests.support.agent import admin_nodes
from tests.support.agent import metric as _metric
from tests.support.agent import openai_client as _client

MODEL = "tiny-model"
LONG_PROMPT = " ".join(f"word{i % 50} alpha beta gamma" for i in range(80))  # 400 tokens


async def _nodes(sim_node: NodeFactory, n: int, **kw: object) -> list[str]:
    return [await sim_node(profile_name="cpu-tiny", seed=i, **kw) for i in range(n)]


async def _admin_nodes(handle: AgentHandle) -> dict[str, dict[str, object]]:
    return await admin_nodes(handle.url, ADMIN)


@pytest.mark.parametrize("policy", routing.NAMES)
async def test_every_policy_serves_streaming_and_not(
    sim_node: NodeFactory, start_agent: AgentFactory, policy: str
) -> None:
    handle = await start_agent(await _nodes(sim_node, 4), policy=policy)
    async with _client(handle.url) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            extra_headers={"X-Session-ID": "s1"},
        )
        assert reply.choices[0].message.content
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        usage = None
        async for chunk in stream:
            tokens += sum(1 for c in chunk.choices if c.delta.content)
            usage = chunk.usage or usage
        assert tokens == 6
        assert usage is not None and usage.completion_tokens == 6
        completion = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
        assert completion.choices[0].text
    nodes = await _admin_nodes(handle)
    assert sum(int(n["requests_total"]) for n in nodes.values()) == 3  # type: ignore[call-overload]
    assert all(n["in_flight"] == 0 for n in nodes.values())


async def test_streaming_is_relayed_byte_for_byte(start_agent: AgentFactory) -> None:
    """A backend with awkward chunking: comments, split lines, multi-line events."""
    payload = [
        b": keep-alive comment\n\n",
        b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"te',
        b'xt":"a","finish_reason":null}]}\n\ndata: {"id":"x","object":"text_completion",',
        b'"choices":[{"index":0,"text":" \\u00e9\\n","finish_reason":"length"}]}\n\n',
        b"data: [DONE]\n\n",
    ]

    async def complete(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in payload:
            await response.write(piece)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    runner = await _backend(complete)
    try:
        handle = await start_agent([_runner_url(runner)], policy="round_robin")
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{handle.url}/v1/completions",
                json={"model": MODEL, "prompt": "x", "stream": True},
            ) as r,
        ):
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            received = await r.read()
        assert received == b"".join(payload)
    finally:
        await runner.cleanup()


async def _backend(
    complete: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> web.AppRunner:
    """A node of the test's own on loopback: it lists the model, is healthy (``/health`` and
    ``/metrics`` answer 200, empty) and answers ``/v1/completions`` with ``complete``."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def ok(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def _garbage_backend() -> web.AppRunner:
    """A node that lists the model and is healthy but answers completions with garbage."""

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(body=b'{"choices": [tru', content_type="application/json")

    return await _backend(garbage)


def _runner_url(runner: web.AppRunner) -> str:
    site = next(iter(runner.sites))
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def test_a_node_answering_garbage_is_penalised_and_the_client_gets_a_clean_answer(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    runner = await _garbage_backend()
    try:
        bad = _runner_url(runner)
        good = await sim_node(profile_name="cpu-tiny")
        handle = await start_agent([bad, good], policy="round_robin")
        async with _client(handle.url) as client:
            for _ in range(4):  # retried on the good node, before any byte reached the client
                reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
                assert reply.choices[0].text
        nodes = await _admin_nodes(handle)
        assert int(nodes[bad]["errors_total"]) >= 2  # type: ignore[call-overload]
        alone = await start_agent([bad], policy="round_robin")
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{alone.url}/v1/completions", json={"model": MODEL, "prompt": "x"}) as r,
        ):
            assert r.status == 502
            assert "malformed JSON" in (await r.json())["error"]["message"]
    finally:
        await runner.cleanup()


async def test_a_cookie_a_node_sets_never_rides_on_another_request(
    start_agent: AgentFactory,
) -> None:
    """The agent keeps no cookie jar: what one answer's Set-Cookie says is not sent to the node
    with the next client's request (nor does the client's answer need it)."""
    seen: list[str | None] = []

    async def complete(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        answer = web.json_response({"choices": [{"text": "x", "index": 0}]})
        answer.set_cookie("session", "secret-of-another-client")
        return answer

    runner = await _backend(complete)
    try:
        # by host name: aiohttp's default cookie jar ignores cookies of bare IP addresses
        node_url = _runner_url(runner).replace("127.0.0.1", "localhost")
        handle = await start_agent([node_url], policy="round_robin")
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
            for _ in range(3):
                body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
                async with s.post(f"{handle.url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
        assert seen == [None, None, None]
    finally:
        await runner.cleanup()


async def test_same_long_prompt_lands_on_one_node_and_its_cache_proves_it(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 4)
    handle = await start_agent(urls, policy="prefix_aware")
    async with _client(handle.url) as client:
        for _ in range(8):
            await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    hits = {u: await _metric(u, "vllm:prefix_cache_hits_total") for u in urls}
    served = {u: await _metric(u, "vllm:request_success_total") for u in urls}
    (home,) = [u for u, n in served.items() if n > 0]
    assert served[home] == 8
    assert hits[home] == 7 * (400 - 1) // 128 * 128  # every repeat hits 3 whole CPU blocks
    assert all(hits[u] == 0 for u in urls if u != home)


async def test_meridian_policy_keeps_prefix_affinity_too(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 4)
    handle = await start_agent(urls, policy="meridian")
    async with _client(handle.url) as client:
        for _ in range(6):
            await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    hits = [await _metric(u, "vllm:prefix_cache_hits_total") for u in urls]
    assert max(hits) == 5 * 384
    assert sorted(hits)[:-1] == [0.0, 0.0, 0.0]


async def test_sessions_stick(sim_node: NodeFactory, start_agent: AgentFactory) -> None:
    urls = await _nodes(sim_node, 4)
    handle = await start_agent(urls, policy="session")
    async with _client(handle.url) as client:
        for session in ("alice", "bob", "carol"):
            for i in range(4):
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"turn {i}"}],
                    max_tokens=2,
                    extra_headers={"X-Session-ID": session},
                )
        # the body's `user` field is a session key too
        for _ in range(3):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1, user="dave")
    nodes = await _admin_nodes(handle)
    per_node = sorted(int(n["requests_total"]) for n in nodes.values())  # type: ignore[call-overload]
    # each session's requests all went to one node: every count is a sum of whole sessions
    assert sum(per_node) == 15
    for n in nodes.values():
        reasons = [str(r) for r in n["recent_decisions"]]  # type: ignore[attr-defined]
        assert all("session" in r for r in reasons), reasons
    assert all(c in (0, 3, 4, 7, 8, 11, 12, 15) for c in per_node)


async def test_a_full_queue_answers_429_with_retry_after(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 2)
    handle = await start_agent(
        urls, policy="least_connections", queue={"slots_per_node": 1, "max_depth": 1}
    )
    async with aiohttp.ClientSession() as s:
        for url in urls:
            await s.post(f"{url}/admin/faults", json={"hang": True})
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        pending = [
            asyncio.ensure_future(s.post(f"{handle.url}/v1/completions", json=body))
            for _ in range(3)
        ]
        await asyncio.sleep(0.3)  # two hold the slots, one waits
        async with s.post(f"{handle.url}/v1/completions", json=body) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "1"
            error = (await r.json())["error"]
            assert error["type"] == "RateLimitError" and "queue" in error["message"]
        for url in urls:
            await s.delete(f"{url}/admin/faults")
        for response in await asyncio.gather(*pending):
            assert response.status == 200
            response.release()


async def test_queue_deadline_answers_504(sim_node: NodeFactory, start_agent: AgentFactory) -> None:
    (url,) = await _nodes(sim_node, 1)
    handle = await start_agent([url], queue={"slots_per_node": 1, "deadline_s": 0.3})
    async with aiohttp.ClientSession() as s:
        await s.post(f"{url}/admin/faults", json={"hang": True})
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        first = asyncio.ensure_future(s.post(f"{handle.url}/v1/completions", json=body))
        await asyncio.sleep(0.1)
        async with s.post(f"{handle.url}/v1/completions", json=body) as r:
            assert r.status == 504
            assert "queue" in (await r.json())["error"]["message"]
        await s.delete(f"{url}/admin/faults")
        (await first).release()


async def test_priority_high_overtakes_low_in_the_queue(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    (url,) = await _nodes(sim_node, 1)
    handle = await start_agent([url], queue={"slots_per_node": 1})
    order: list[str] = []
    async with aiohttp.ClientSession() as s:
        await s.post(f"{url}/admin/faults", json={"hang": True})

        async def send(tag: str, priority: str) -> None:
            body = {"model": MODEL, "prompt": tag, "max_tokens": 1}
            async with s.post(
                f"{handle.url}/v1/completions", json=body, headers={"X-Priority": priority}
            ) as r:
                assert r.status == 200
                order.append(tag)

        blocker = asyncio.ensure_future(send("blocker", "normal"))
        await asyncio.sleep(0.1)
        low = asyncio.ensure_future(send("low", "low"))
        await asyncio.sleep(0.05)
        high = asyncio.ensure_future(send("high", "high"))
        await asyncio.sleep(0.05)
        await s.delete(f"{url}/admin/faults")
        await asyncio.gather(blocker, low, high)
    assert order.index("high") < order.index("low")


@pytest.mark.parametrize(
    ("path", "data", "headers", "status", "needle"),
    [
        ("/v1/completions", b"{nope", {}, 400, "not valid JSON"),
        ("/v1/completions", b'{"prompt": "x"}', {}, 400, "'model' is required"),
        ("/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', {}, 404, "does not exist"),
        ("/v1/chat/completions", b'{"model": "tiny-model", "messages": "hi"}', {}, 400, "messages"),
        (
            "/v1/completions",
            b'{"model": "tiny-model", "prompt": "x", "max_tokens": -2}',
            {},
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            b'{"model": "tiny-model", "prompt": "x"}',
            {"X-Priority": "urgent"},
            400,
            "X-Priority",
        ),
        (
            "/v1/completions",
            b'{"model": "tiny-model", "prompt": "' + b"x" * 5000 + b'"}',
            {},
            413,
            "max_body_bytes",
        ),
    ],
)
async def test_bad_input_gets_a_clear_openai_error(
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    path: str,
    data: bytes,
    headers: dict[str, str],
    status: int,
    needle: str,
) -> None:
    handle = await start_agent(await _nodes(sim_node, 1), server={"max_body_bytes": 4096})
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{handle.url}{path}",
            data=data,
            headers={"Content-Type": "application/json", **headers},
        ) as r:
            assert r.status == status
            error = (await r.json())["error"]
        assert needle in error["message"]
        assert error["code"] == status
        async with s.post(
            f"{handle.url}/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 1}
        ) as r:
            assert r.status == 200


async def test_node_errors_are_relayed_when_they_are_the_clients_fault(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await start_agent(await _nodes(sim_node, 2))
    async with _client(handle.url) as client:
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    nodes = await _admin_nodes(handle)
    assert sum(int(n["requests_total"]) for n in nodes.values()) == 1  # type: ignore[call-overload]
    assert all(n["errors_total"] == 0 for n in nodes.values())  # not held against the node


async def test_5xx_is_retried_on_another_node_before_the_first_byte(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 2)
    handle = await start_agent(urls, policy="round_robin")
    async with aiohttp.ClientSession() as s:
        await s.post(f"{urls[0]}/admin/faults", json={"error_rate": 1.0, "error_status": 503})
    async with _client(handle.url) as client:
        for _ in range(4):
            reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert reply.choices[0].text
    assert await _metric(urls[1], "vllm:request_success_total") == 4
    assert await _metric(handle.url, "meridian_agent_retries_total") >= 1


async def test_client_disconnect_aborts_the_request_on_the_node(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    (url,) = await _nodes(sim_node, 1, time_scale=1)
    handle = await start_agent([url])
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{handle.url}/v1/completions", json=body) as r,
    ):
        await r.content.readline()  # the first event, then hang up
    for _ in range(50):
        if await _metric(url, "vllm:request_success_total", finished_reason="abort") == 1:
            break
        await asyncio.sleep(0.05)
    assert await _metric(url, "vllm:request_success_total", finished_reason="abort") == 1
    assert await _metric(url, "vllm:num_requests_running") == 0


async def test_unhealthy_node_gets_no_traffic(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 2)
    handle = await start_agent(urls, policy="round_robin")
    async with aiohttp.ClientSession() as s:
        await s.post(f"{urls[0]}/admin/faults", json={"fail_health": True})
    for _ in range(50):
        nodes = await _admin_nodes(handle)
        if nodes[urls[0]]["health"]["state"] == "unhealthy":  # type: ignore[index]
            break
        await asyncio.sleep(0.1)
    async with _client(handle.url) as client:
        for _ in range(6):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert await _metric(urls[0], "vllm:request_success_total") == 0
    assert await _metric(urls[1], "vllm:request_success_total") == 6


async def test_draining_under_load_loses_nothing(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 3)
    handle = await start_agent(urls, policy="least_connections")
    results: list[int] = []

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": MODEL, "prompt": f"req {i}", "max_tokens": 20, "ignore_eos": True}
        async with s.post(f"{handle.url}/v1/completions", json=body) as r:
            results.append(r.status)
            await r.read()

    async with aiohttp.ClientSession() as s:
        load = [asyncio.ensure_future(one(s, i)) for i in range(30)]
        await asyncio.sleep(0.05)
        node_id = (await _admin_nodes(handle))[urls[0]]["id"]
        async with s.post(f"{handle.url}/admin/nodes/{node_id}/drain", headers=ADMIN) as r:
            assert r.status == 200
        before = (await _admin_nodes(handle))[urls[0]]["requests_total"]
        more = [asyncio.ensure_future(one(s, 100 + i)) for i in range(15)]
        await asyncio.gather(*load, *more)
    assert results == [200] * 45
    after = await _admin_nodes(handle)
    assert after[urls[0]]["requests_total"] == before  # nothing new after the drain
    assert after[urls[0]]["admin"] == "drained"
    assert after[urls[0]]["in_flight"] == 0


async def test_killing_a_node_under_load_loses_no_request_that_had_not_started(
    sim_processes: Callable[..., list[SimProcess]], start_agent: AgentFactory
) -> None:
    sims = sim_processes(4, time_scale=5)
    handle = await start_agent([s.url for s in sims], policy="round_robin")
    outcomes: list[str] = []

    async def non_streaming(client: openai.AsyncOpenAI, i: int) -> None:
        reply = await client.completions.create(
            model=MODEL, prompt=f"n{i}", max_tokens=30, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 30
        outcomes.append("ok")

    async def streaming(client: openai.AsyncOpenAI, i: int) -> None:
        got = 0
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=f"s{i}",
                max_tokens=30,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                got += sum(1 for c in chunk.choices if c.text)
        except openai.APIError:
            assert got > 0, (
                "a stream failed before its first token: that one should have been retried"
            )
            outcomes.append("clean-error")
            return
        assert got == 30
        outcomes.append("ok")

    async with _client(handle.url, timeout=30) as client:
        tasks = [asyncio.ensure_future(non_streaming(client, i)) for i in range(24)]
        tasks += [asyncio.ensure_future(streaming(client, i)) for i in range(24)]
        await asyncio.sleep(0.15)
        sims[0].kill()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert len(outcomes) == 48
    assert outcomes.count("ok") >= 24  # every non-streaming request, at least


async def test_admin_api_needs_the_token_and_manages_nodes(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 2)
    # no slow start, so that the added node takes its full weighted share at once
    handle = await start_agent(urls[:1], health={"slow_start_s": 0})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{handle.url}/admin/nodes") as r:
            assert r.status == 401
        async with s.get(
            f"{handle.url}/admin/nodes", headers={"Authorization": "Bearer wrong"}
        ) as r:
            assert r.status == 401
        async with s.post(f"{handle.url}/admin/nodes", json={"url": "ftp://x"}, headers=ADMIN) as r:
            assert r.status == 400
            assert "url" in (await r.json())["error"]["message"]
        async with s.post(
            f"{handle.url}/admin/nodes", json={"url": urls[1], "weight": 2}, headers=ADMIN
        ) as r:
            assert r.status == 201
            added = await r.json()
            assert added["models"] == [MODEL] and added["weight"] == 2.0
        async with s.post(f"{handle.url}/admin/nodes", json={"url": urls[1]}, headers=ADMIN) as r:
            assert r.status == 409
        async with s.put(
            f"{handle.url}/admin/nodes/{added['id']}/weight", json={"weight": 0}, headers=ADMIN
        ) as r:
            assert r.status == 400
        async with s.put(f"{handle.url}/admin/policy", json={"policy": "nope"}, headers=ADMIN) as r:
            assert r.status == 400
        async with s.put(
            f"{handle.url}/admin/policy", json={"policy": "weighted"}, headers=ADMIN
        ) as r:
            assert (await r.json())["policy"] == "weighted"
        for _ in range(6):
            async with s.post(
                f"{handle.url}/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            ) as r:
                assert r.status == 200
        nodes = await _admin_nodes(handle)
        assert nodes[urls[1]]["requests_total"] == 4  # weight 2 of 3
        async with s.delete(f"{handle.url}/admin/nodes/{added['id']}", headers=ADMIN) as r:
            assert r.status == 200
        async with s.delete(f"{handle.url}/admin/nodes/{added['id']}", headers=ADMIN) as r:
            assert r.status == 404
        async with s.get(f"{handle.url}/admin/queue", headers=ADMIN) as r:
            assert (await r.json())["waiting"] == {MODEL: 0}


async def test_agent_metrics_ready_and_health(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await start_agent(await _nodes(sim_node, 2))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{handle.url}/health") as r:
            assert r.status == 200
        async with s.get(f"{handle.url}/ready") as r:
            assert r.status == 200
            assert (await r.json())["routable_nodes"] == 2
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
        async with s.post(f"{handle.url}/v1/completions", json=body) as r:
            await r.read()
    assert await _metric(handle.url, "meridian_agent_requests_total", status="200") == 1
    assert await _metric(handle.url, "meridian_agent_time_to_first_token_seconds_count") == 1
    assert (
        await _metric(handle.url, "meridian_agent_routing_decisions_total", policy="meridian") == 1
    )
    assert await _metric(handle.url, "meridian_agent_queue_depth", model=MODEL) == 0


async def test_no_routable_node_is_503_not_a_hang(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    (url,) = await _nodes(sim_node, 1)
    handle = await start_agent([url])
    async with aiohttp.ClientSession() as s:
        node_id = (await _admin_nodes(handle))[url]["id"]
        await s.post(f"{handle.url}/admin/nodes/{node_id}/drain", headers=ADMIN)
        async with s.post(
            f"{handle.url}/v1/completions", json={"model": MODEL, "prompt": "x"}
        ) as r:
            assert r.status == 503
            assert "drained" in (await r.json())["error"]["message"]
        async with s.get(f"{handle.url}/ready") as r:
            assert r.status == 503


async def test_requests_go_only_to_nodes_that_serve_their_model(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    tiny = [await sim_node(profile_name="cpu-tiny", seed=i) for i in range(2)]
    other = await sim_node(profile_name="cpu-tiny", model="other-model")
    handle = await start_agent([*tiny, other], policy="round_robin")
    async with _client(handle.url) as client:
        assert sorted(m.id for m in (await client.models.list()).data) == ["other-model", MODEL]
        for _ in range(4):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
            await client.completions.create(model="other-model", prompt="x", max_tokens=1)
    assert await _metric(other, "vllm:request_success_total") == 4
    assert sum([await _metric(u, "vllm:request_success_total") for u in tiny]) == 4


async def test_drain_timeout_cuts_a_stuck_request_and_retries_it_elsewhere(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    stuck, spare = await _nodes(sim_node, 2)
    handle = await start_agent([stuck], health={"drain_timeout_s": 0.3})
    async with aiohttp.ClientSession() as s:
        await s.post(f"{stuck}/admin/faults", json={"hang": True})
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        pending = asyncio.ensure_future(s.post(f"{handle.url}/v1/completions", json=body))
        await asyncio.sleep(0.2)
        async with s.post(f"{handle.url}/admin/nodes", json={"url": spare}, headers=ADMIN) as r:
            assert r.status == 201
        stuck_id = (await _admin_nodes(handle))[stuck]["id"]
        async with s.post(f"{handle.url}/admin/nodes/{stuck_id}/drain", headers=ADMIN) as r:
            assert (await r.json())["admin"] == "draining"
        response = await asyncio.wait_for(pending, timeout=5)
        assert response.status == 200  # cut after the drain timeout, served by the spare node
        response.release()
        nodes = await _admin_nodes(handle)
    assert nodes[stuck]["admin"] == "drained"
    assert nodes[spare]["requests_total"] == 1
    assert await _metric(spare, "vllm:request_success_total") == 1


async def test_drain_timeout_ends_a_stuck_stream_with_an_error_event(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """A stream whose first bytes reached the client cannot be retried: past the drain timeout
    it ends with an OpenAI-style error event naming the drain, and the node is drained."""
    (stuck,) = await _nodes(sim_node, 1)
    handle = await start_agent([stuck], health={"drain_timeout_s": 0.3})
    body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        await s.post(f"{stuck}/admin/faults", json={"latency_multiplier": 50.0})
        async with s.post(f"{handle.url}/v1/completions", json=body) as r:
            assert r.status == 200
            first = await r.content.readany()
            assert first.startswith(b"data:")
            await s.post(f"{stuck}/admin/faults", json={"hang": True})  # stops mid-stream
            stuck_id = (await _admin_nodes(handle))[stuck]["id"]
            async with s.post(f"{handle.url}/admin/nodes/{stuck_id}/drain", headers=ADMIN) as d:
                assert (await d.json())["admin"] == "draining"
            rest = await asyncio.wait_for(r.content.read(), timeout=5)
        assert b'"ServiceUnavailableError"' in rest and b"drain timeout" in rest, rest[-300:]
        nodes = await _admin_nodes(handle)
        await s.delete(f"{stuck}/admin/faults")
    assert nodes[stuck]["admin"] == "drained" and nodes[stuck]["in_flight"] == 0


async def test_prefill_ahead_is_counted_until_the_first_token(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """``prefill_tokens``: the uncached prompt of a request sent to a node is counted there
    until its first token (what the meridian policy weighs), then released."""
    (url,) = await _nodes(sim_node, 1)
    handle = await start_agent([url], policy="meridian")
    async with aiohttp.ClientSession() as s:
        await s.post(f"{url}/admin/faults", json={"latency_multiplier": 300.0})
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": LONG_PROMPT}],
            "max_tokens": 3,
            "stream": True,
            "ignore_eos": True,
        }
        first_byte = asyncio.Event()

        async def stream() -> None:
            async with s.post(f"{handle.url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                async for _ in r.content.iter_any():
                    first_byte.set()

        task = asyncio.create_task(stream())
        seen: dict[str, object] = {}
        while not first_byte.is_set() and not seen:
            (node,) = (await _admin_nodes(handle)).values()
            if node["in_flight"] == 1:
                seen = node
            await asyncio.sleep(0.01)
        assert int(seen["prefill_tokens"]) > 300  # type: ignore[call-overload]  # ~400 tokens
        await first_byte.wait()
        (node,) = (await _admin_nodes(handle)).values()
        assert node["prefill_tokens"] == 0  # first token in, the request still streaming
        await task
        await s.delete(f"{url}/admin/faults")
        async with s.post(f"{handle.url}/v1/chat/completions", json={**body, "stream": False}) as r:
            assert r.status == 200
    (node,) = (await _admin_nodes(handle)).values()
    assert (node["in_flight"], node["prefill_tokens"]) == (0, 0)


async def test_a_slow_first_token_is_not_cut_by_the_read_timeout(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """A long prefill on a loaded node is silence before the first token, not a dead stream:
    only ``first_byte_timeout_s`` bounds it; ``read_timeout_s`` is for silences after that."""
    (url,) = await _nodes(sim_node, 1)
    handle = await start_agent(
        [url], upstream={"first_byte_timeout_s": 20.0, "read_timeout_s": 0.2}
    )
    async with aiohttp.ClientSession() as s:
        await s.post(f"{url}/admin/faults", json={"latency_multiplier": 200.0})
        async with _client(handle.url, timeout=30) as client:
            started = asyncio.get_running_loop().time()
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": LONG_PROMPT}],
                max_tokens=1,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            text = ""
            async for chunk in stream:
                text += "".join(c.delta.content or "" for c in chunk.choices)
            took_s = asyncio.get_running_loop().time() - started
        await s.delete(f"{url}/admin/faults")
    assert text
    assert took_s > 0.4  # the first token really came after more than twice read_timeout_s
