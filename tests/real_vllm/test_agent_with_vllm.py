"""The agent in front of real vLLM on CPU: the same claims tests/agent makes against simulated
nodes, held against vLLM 0.32's own server, scheduler, prefix cache and ``/metrics``.

The two session nodes are shared by every test here, so each test reads counters as deltas and
uses prompts of its own. The tiny model's weights are random: its text is gibberish and it may
sample end-of-sequence at any step, so tests that count tokens send ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.agent import ADMIN, AgentFactory, AgentHandle, admin_nodes
from tests.support.agent import metric as _metric
from tests.support.agent import openai_client as _client
from tests.support.vllm import BLOCK_SIZE, MAX_MODEL_LEN, MODEL_NAME, NUM_BLOCKS, VllmServer

# Starting vLLM takes about half a minute and counts towards the first test's time.
pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

IGNORE_EOS: dict[str, Any] = {"ignore_eos": True}
# Probes a busy engine answers in time: vLLM's processes busy-poll this host's cores and the
# agent shares its loop with the test, so the tests' usual 0.5 s probes can mark a healthy
# node down and send a test's requests all to the other node.
PATIENT: dict[str, Any] = {"health": {"probe_timeout_s": 10.0, "unhealthy_after": 3}}


async def _admin_nodes(handle: AgentHandle) -> dict[str, dict[str, Any]]:
    return await admin_nodes(handle.url, ADMIN)


async def _dispatched(
    handle: AgentHandle, total: int, requests: Sequence[asyncio.Future[None]]
) -> dict[str, dict[str, Any]]:
    """The nodes once the agent has dispatched `total` requests in all (60 s at most)."""
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        nodes = await _admin_nodes(handle)
        if sum(n["requests_total"] for n in nodes.values()) >= total:
            return nodes
        assert asyncio.get_running_loop().time() < deadline, (
            f"{total} requests were not all dispatched in 60 s: nodes {nodes}, "
            f"requests {[r.exception() if r.done() else 'running' for r in requests]}"
        )
        await asyncio.sleep(0.02)


async def _token_count(url: str, text: str) -> int:
    """What vLLM's own tokenizer makes of ``text`` (its BPE, not the agent's tokenizer)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/tokenize", json={"model": MODEL_NAME, "prompt": text}) as r,
    ):
        assert r.status == 200
        count: int = (await r.json())["count"]
    return count


async def test_chat_and_completions_streaming_and_not(
    vllm_nodes: list[VllmServer], start_agent: AgentFactory
) -> None:
    urls = [n.url for n in vllm_nodes]
    before = [await _metric(u, "vllm:request_success_total") for u in urls]
    handle = await start_agent(urls, policy="round_robin", **PATIENT)
    async with _client(handle.url) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL_NAME]

        reply = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=5,
            extra_body=IGNORE_EOS,
        )
        assert reply.choices[0].finish_reason == "length"
        assert isinstance(reply.choices[0].message.content, str)
        assert reply.usage is not None and reply.usage.completion_tokens == 5

        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "stream to me"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        roles, finish, usage = [], [], None
        async for chunk in stream:
            roles += [c.delta.role for c in chunk.choices if c.delta.role]
            finish += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        assert roles == ["assistant"]
        assert finish == ["length"]
        assert usage is not None and usage.completion_tokens == 6

        completion = await client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=3, extra_body=IGNORE_EOS
        )
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and completion.usage.completion_tokens == 3

        streamed = await client.completions.create(
            model=MODEL_NAME,
            prompt="The node cache",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        finish, usage = [], None
        async for chunk in streamed:
            finish += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        assert finish == ["length"]
        assert usage is not None and usage.completion_tokens == 4

    nodes = await _admin_nodes(handle)
    assert [nodes[u]["requests_total"] for u in urls] == [2, 2]  # round robin over both
    assert all(nodes[u]["in_flight"] == 0 and nodes[u]["errors_total"] == 0 for u in urls)
    after = [await _metric(u, "vllm:request_success_total") for u in urls]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]


async def test_telemetry_reads_both_nodes_real_metrics(
    vllm_nodes: list[VllmServer], start_agent: AgentFactory
) -> None:
    urls = [n.url for n in vllm_nodes]
    handle = await start_agent(urls, policy="least_connections", **PATIENT)
    async with _client(handle.url) as client:
        for i in range(4):
            await client.completions.create(
                model=MODEL_NAME, prompt=f"telemetry {i}", max_tokens=2, extra_body=IGNORE_EOS
            )
    # the nodes are idle now: a fresh scrape shows the counters as they stand.  vLLM's frontend
    # answers a request before it records the engine step's stats, so a scrape right after the
    # last answer can still show it running (a CI run saw running 1 with the counters already
    # final): wait for the idle gauges as well as the counters
    queries = {u: await _metric(u, "vllm:prefix_cache_queries_total") for u in urls}
    nodes: dict[str, dict[str, Any]] = {}
    for _ in range(100):  # scrapes run every 0.1 s; give them up to 10 s
        nodes = await _admin_nodes(handle)
        telemetry = {u: nodes[u]["telemetry"] for u in urls}
        if all(
            t["prefix_queries_total"] == queries[u]
            and not t["stale"]
            and t["running"] == 0
            and t["waiting"] == 0
            for u, t in telemetry.items()
        ):
            break
        await asyncio.sleep(0.1)
    own = {u: await _metric(u, "vllm:num_requests_running") for u in urls}
    for url in urls:
        telemetry = nodes[url]["telemetry"]
        assert telemetry["stale"] is False, telemetry
        assert telemetry["last_error"] is None, telemetry
        assert telemetry["block_size"] == BLOCK_SIZE
        assert telemetry["num_gpu_blocks"] == NUM_BLOCKS
        assert telemetry["running"] == 0 and telemetry["waiting"] == 0, (telemetry, own)
        assert 0.0 <= telemetry["kv_util"] <= 1.0
        assert telemetry["prefix_queries_total"] == queries[url] > 0
        assert telemetry["scrapes_total"] >= 1
        assert nodes[url]["health"]["state"] == "healthy"


async def test_repeats_of_a_long_prompt_go_to_one_node_and_its_vllm_counts_the_hits(
    vllm_nodes: list[VllmServer], start_agent: AgentFactory
) -> None:
    urls = [n.url for n in vllm_nodes]
    text = " ".join(f"prefix{i % 37} routing test {i}" for i in range(30))
    prompt_tokens = await _token_count(urls[0], text)
    max_tokens = 2
    # more than two whole blocks, and it fits the context with its output
    assert prompt_tokens - 1 > 2 * BLOCK_SIZE and prompt_tokens + max_tokens <= MAX_MODEL_LEN
    hit_per_repeat = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is computed

    async def counters(url: str) -> tuple[float, float, float]:
        return (
            await _metric(url, "vllm:request_success_total"),
            await _metric(url, "vllm:prefix_cache_queries_total"),
            await _metric(url, "vllm:prefix_cache_hits_total"),
        )

    before = {u: await counters(u) for u in urls}
    handle = await start_agent(urls, policy="prefix_aware", **PATIENT)
    repeats = 6
    async with _client(handle.url) as client:
        for _ in range(repeats):
            reply = await client.completions.create(
                model=MODEL_NAME, prompt=text, max_tokens=max_tokens, extra_body=IGNORE_EOS
            )
            assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens
    delta = {
        u: tuple(a - b for a, b in zip(await counters(u), before[u], strict=True)) for u in urls
    }
    (home,) = [u for u in urls if delta[u][0] > 0]
    (other,) = [u for u in urls if u != home]
    assert delta[home] == (repeats, repeats * prompt_tokens, (repeats - 1) * hit_per_repeat)
    assert delta[other] == (0, 0, 0)
    assert hit_per_repeat % BLOCK_SIZE == 0 and hit_per_repeat >= 2 * BLOCK_SIZE


async def test_a_node_killed_mid_stream_ends_streams_cleanly_and_retries_the_rest(
    vllm_nodes: list[VllmServer],
    vllm_extra: Callable[..., VllmServer],
    start_agent: AgentFactory,
) -> None:
    """A third vLLM process (the session's two are shared) is SIGKILLed, with its engine core,
    while streams and non-streaming requests are running on it."""
    doomed = vllm_extra(cpu="0")
    survivor = vllm_nodes[1]
    # three vLLM engines busy-poll the 2 cores here, and the agent's loop can wait seconds for
    # one: a retry's connect to the survivor once ran past the default 2 s and failed the test;
    # and a /health probe of a starved engine can take seconds: with the tests' 0.5 s probes the
    # doomed node went unhealthy before its streams were dispatched (a CI run), every stream went
    # to the survivor and no stream was cut.  Here a node leaves the pool only when it is dead
    handle = await start_agent(
        [doomed.url, survivor.url],
        policy="round_robin",
        upstream={"connect_timeout_s": 10.0},
        health={"probe_timeout_s": 10.0, "unhealthy_after": 3},
        telemetry={"scrape_timeout_s": 10.0, "stale_after_s": 30.0},
    )
    started = [asyncio.Event() for _ in range(4)]
    got = [0] * 4  # tokens each stream has brought the client so far
    outcomes: list[str] = []
    scene: dict[str, Any] = {"on_doomed": None, "frozen": False, "missed": []}

    def freeze_if_set() -> None:
        """SIGSTOP the doomed node the moment its two streams are past their first tokens,
        nothing awaited between the check and the signal: the tiny model can finish a stream
        while a test on a loaded host is still on its way to look (CI runs saw it).  Frozen, the
        node generates nothing more, so what the scene is can be read at leisure before the
        kill; the fault itself is still the SIGKILL."""
        on_doomed = scene["on_doomed"]
        if scene["frozen"] or on_doomed is None or not all(started[j].is_set() for j in on_doomed):
            return
        scene["frozen"] = True
        doomed.freeze()

    async def drained(on_doomed: list[int]) -> None:
        """Until what the frozen node sent before the SIGSTOP has reached the client (its
        streams' token counts stop moving for half a second; 20 s at most)."""
        last: list[int] = []
        for _ in range(40):
            now = [got[j] for j in on_doomed]
            if now == last:
                return
            last = now
            await asyncio.sleep(0.5)

    async def streaming(client: openai.AsyncOpenAI, i: int) -> None:
        first = started[i]
        try:
            stream = await client.completions.create(
                model=MODEL_NAME,
                prompt=f"stream {i}",
                max_tokens=480,
                stream=True,
                extra_body=IGNORE_EOS,
            )
            async for chunk in stream:
                got[i] += sum(1 for c in chunk.choices if c.text is not None)
                if not first.is_set():
                    first.set()
                    freeze_if_set()
        except openai.APIError as exc:
            assert got[i] > 0, f"a stream failed before its first byte, not retried: {exc}"
            assert "mid-stream" in str(exc)
            outcomes.append("clean-error")
            return
        assert got[i] > 0
        outcomes.append("ok")

    async def non_streaming(client: openai.AsyncOpenAI, i: int) -> None:
        reply = await client.completions.create(
            model=MODEL_NAME, prompt=f"whole {i}", max_tokens=480, extra_body=IGNORE_EOS
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 480
        outcomes.append("ok")

    async with _client(handle.url, timeout=120) as client:
        # Up to five tries at the scene the kill needs: two streams on the doomed node, each with
        # its first token and not yet ended.  A try that misses it (a stream ended before the
        # freeze) thaws the node, lets its requests finish and starts again.  Three tries all
        # missed once (a CI run of stop 40): the first doomed stream ended, 480 tokens, before
        # the second was dispatched.
        on_doomed: list[int] = []
        streams: list[asyncio.Future[None]] = []
        wholes_on_doomed = 0
        for _ in range(5):
            started[:] = [asyncio.Event() for _ in range(4)]
            got[:] = [0] * 4
            outcomes.clear()
            scene["on_doomed"] = None
            dispatched = sum(n["requests_total"] for n in (await _admin_nodes(handle)).values())
            # the non-streaming requests go first, so they are on both nodes, no byte sent, when
            # the kill comes.  Dispatches are counted, not requests in flight: on a fast host a
            # whole request finished before the fourth was seen in flight
            wholes = [asyncio.ensure_future(non_streaming(client, i)) for i in range(4)]
            await _dispatched(handle, dispatched + 4, wholes)
            # one stream at a time, each seen dispatched before the next is sent, so the node
            # whose count went up is the node that stream is on
            streams = []
            on_doomed = []
            for i in range(4):
                before = (await _admin_nodes(handle))[doomed.url]["requests_total"]
                streams.append(asyncio.ensure_future(streaming(client, i)))
                nodes = await _dispatched(handle, dispatched + 5 + i, streams)
                if nodes[doomed.url]["requests_total"] > before:
                    on_doomed.append(i)
            assert len(on_doomed) == 2, f"round robin put streams {on_doomed} on the doomed node"
            scene["on_doomed"] = on_doomed
            freeze_if_set()  # their first tokens may be out already
            if not scene["frozen"]:
                await asyncio.wait_for(
                    asyncio.gather(*(started[i].wait() for i in on_doomed)), timeout=60
                )  # the second first token freezes it (freeze_if_set)
            await drained(on_doomed)
            if not any(streams[j].done() for j in on_doomed):
                # whole requests still on the doomed node at the kill fail before their first
                # byte and are retried, which is what errors_total counts (on a slow host they
                # may all have finished: then there is nothing to count)
                node = next(n for n in handle.edge.pool if n.url == doomed.url)
                wholes_on_doomed = node.in_flight - len(on_doomed)
                assert wholes_on_doomed >= 0, (node.in_flight, on_doomed)
                doomed.kill()
                break
            scene["missed"].append(([streams[j].done() for j in on_doomed], list(got)))
            scene["frozen"] = False
            doomed.thaw()
            await asyncio.wait_for(asyncio.gather(*streams, *wholes), timeout=300)
        else:
            nodes = await _admin_nodes(handle)
            raise AssertionError(
                f"five tries, and the doomed node's streams ended first: {scene} {nodes}"
            )
        # a hang would fail here rather than at the test timeout
        await asyncio.wait_for(asyncio.gather(*streams, *wholes), timeout=300)
        after = await client.completions.create(
            model=MODEL_NAME, prompt="after the kill", max_tokens=2, extra_body=IGNORE_EOS
        )
        assert after.usage is not None and after.usage.completion_tokens == 2
    assert len(outcomes) == 8
    # the doomed node's two streams were mid-stream at the kill
    assert outcomes.count("clean-error") == len(on_doomed), outcomes
    nodes = await _admin_nodes(handle)
    assert nodes[doomed.url]["errors_total"] >= (1 if wholes_on_doomed > 0 else 0)
    assert all(n["in_flight"] == 0 for n in nodes.values())


async def test_a_client_that_hangs_up_makes_vllm_abort_the_request(
    vllm_nodes: list[VllmServer], start_agent: AgentFactory
) -> None:
    """vLLM 0.32 counts a request aborted by its API server (the connection closed) in no
    counter at all — not ``request_success_total{finished_reason="abort"}``, which only engine-side
    aborts reach — so the proof is its log line ``Request <id> aborted.`` (the session nodes run
    with ``--enable-log-requests``) and a request that never finished."""
    node = vllm_nodes[0]
    finished = "vllm:request_success_total"
    aborts_logged = node.log().count(" aborted.")
    before = await _metric(node.url, finished)
    generated = await _metric(node.url, "vllm:generation_tokens_total")
    handle = await start_agent([node.url])
    body = {"model": MODEL_NAME, "prompt": "hang up", "max_tokens": 480, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{handle.url}/v1/completions", json={**body, **IGNORE_EOS}) as r,
    ):
        assert r.status == 200
        await r.content.readline()  # the first event, then hang up
    # vLLM notices a closed connection between engine steps; on a loaded 2-core CI host that
    # took more than 10 s once.  Wait for the abort (or for the request to finish, which would
    # disprove it) with a deadline sized for a loaded host: the proof below is unchanged.
    deadline = asyncio.get_running_loop().time() + 60
    while asyncio.get_running_loop().time() < deadline:
        if node.log().count(" aborted.") > aborts_logged:
            break
        if await _metric(node.url, finished) > before:
            break  # it ran to the end: the assertions below say so
        await asyncio.sleep(0.2)
    assert node.log().count(" aborted.") == aborts_logged + 1
    # the log line comes as the frontend sends the abort; the engine drops the request between
    # steps and the gauge follows with the next step's stats
    end = asyncio.get_running_loop().time() + 30
    while (running := await _metric(node.url, "vllm:num_requests_running")) != 0:
        assert asyncio.get_running_loop().time() < end, f"vLLM still runs {running} after the abort"
        await asyncio.sleep(0.1)
    assert await _metric(node.url, finished) == before  # neither "length" nor any other reason
    assert await _metric(node.url, "vllm:generation_tokens_total") - generated < 480
