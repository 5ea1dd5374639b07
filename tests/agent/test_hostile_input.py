"""The agent against input an attacker would send: every malformed request gets a 4xx with an
OpenAI-style body that says what to fix, the agent keeps serving everyone else, and no request
can stall its event loop or flood its log.

Real components on loopback: simulated nodes (in process, or ``meridian-sim`` processes where
the test stalls the loop or loads the nodes), in-process agents, and a ``meridian-agent``
process where what the test counts is its log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.agent.conftest import AgentFactory, SimProcess
from tests.conftest import NodeFactory
from tests.support.agent import metric
from tests.support.ports import free_port
from tests.support.process import ServerProcess
from tests.support.waits import answered

MODEL = "tiny-model"  # the cpu-tiny profile's
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}


async def _refused(
    url: str, path: str, body: bytes, *, status: int = 400, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """POST ``body``; assert an OpenAI-style error with ``status``; return its ``error``."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}{path}", data=body, headers={**JSON, **(headers or {})}) as r,
    ):
        text = await r.text()
        assert r.status == status, text
        error: dict[str, Any] = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and error["message"], error
    return error


async def _serves(url: str) -> None:
    """A normal request right after: the agent still serves everyone else."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(f"{url}{CHAT}", json=body) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["message"]["content"]


async def _agent(sim_node: NodeFactory, start_agent: AgentFactory, **groups: Any) -> str:
    return (await start_agent([await sim_node()], **groups)).url


# -- 1. lone surrogates ---------------------------------------------------------------------------


def _chat(content: object, **extra: object) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return json.dumps(body).encode()  # ensure_ascii: "\ud800" goes out as the escape \ud800


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, _chat("hi \ud800"), "messages[0].content"),
        (CHAT, _chat([{"type": "text", "text": "a"}, {"type": "text", "text": "\udfff"}]),
         "messages[0].content[1].text"),
        (COMPLETIONS, json.dumps({"model": MODEL, "prompt": "x\ud83d"}).encode(), "prompt"),
        (COMPLETIONS, json.dumps({"model": MODEL, "prompt": ["\ud800"]}).encode(), "prompt[0]"),
        (CHAT, _chat("hi", user="\udcff"), "user"),  # the session key is hashed as UTF-8
    ],
)  # fmt: skip
async def test_a_lone_surrogate_is_a_400_naming_the_field(
    sim_node: NodeFactory, start_agent: AgentFactory, path: str, body: bytes, field: str
) -> None:
    url = await _agent(sim_node, start_agent, policy="session")
    error = await _refused(url, path, body)
    assert error["message"].startswith(f"{field} contains a lone surrogate"), error
    assert "UTF-8" in error["message"] and error["type"] == "BadRequestError"
    await _serves(url)


async def test_a_session_header_that_is_not_utf8_is_a_400(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """aiohttp decodes header bytes that are not UTF-8 to lone surrogates (surrogateescape)."""
    url = await _agent(sim_node, start_agent, policy="session")
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
        b"X-Session-ID: caf\xe9\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert b"the X-Session-ID header is not UTF-8 text" in payload, payload
    await _serves(url)


# -- 2. deep nesting and JSON's non-standard constants --------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_deeply_nested_json_is_a_400_not_a_recursion_error(
    sim_node: NodeFactory, start_agent: AgentFactory, path: str
) -> None:
    url = await _agent(sim_node, start_agent)
    for body in (b"[" * 100_000, b'{"model": "tiny-model", "x": ' + b"[" * 50_000 + b"]" * 50_000):
        error = await _refused(url, path, body)
        assert "nested too deeply" in error["message"], error
    await _serves(url)


@pytest.mark.parametrize(
    ("path", "extra", "field", "text"),
    [
        (CHAT, b'"temperature": NaN', "temperature", "NaN"),
        (CHAT, b'"top_p": Infinity', "top_p", "Infinity"),
        (COMPLETIONS, b'"temperature": -Infinity', "temperature", "-Infinity"),
        (COMPLETIONS, b'"temperature": 1e999', "temperature", "1e999"),  # a double's infinity
        (CHAT, b'"logit_bias": {"50256": NaN}', "logit_bias.50256", "NaN"),
        (CHAT, b'"stop": ["a", [1, NaN]]', "stop[1][1]", "NaN"),
    ],
)
async def test_nan_and_infinity_are_refused_naming_the_field(
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    path: str,
    extra: bytes,
    field: str,
    text: str,
) -> None:
    """Python's json takes NaN and Infinity (JSON does not) and 1e999 as inf; the agent used to
    forward them to the nodes as they were."""
    url = await _agent(sim_node, start_agent)
    what = b'"messages": [{"role": "user", "content": "x"}]' if path == CHAT else b'"prompt": "x"'
    body = b'{"model": "tiny-model", ' + what + b", " + extra + b"}"
    error = await _refused(url, path, body)
    assert error["param"] == field, error
    assert error["message"] == (
        f"{field}: {text} is not a JSON number; send a finite number (JSON has no NaN or Infinity)"
    )
    await _serves(url)


async def test_an_integer_too_long_for_python_is_a_400(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    url = await _agent(sim_node, start_agent)
    body = b'{"model": "tiny-model", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    error = await _refused(url, COMPLETIONS, body)
    assert "integer of more than 4300 digits" in error["message"], error
    await _serves(url)


@pytest.mark.parametrize("ids", [[-1] * 16, [2**32] * 16, [1, 2, 10**30]])
async def test_token_ids_outside_32_bits_are_a_400(
    sim_node: NodeFactory, start_agent: AgentFactory, ids: list[int]
) -> None:
    """Block hashes pack token ids in 4 bytes: 2**32 used to raise OverflowError (a 500)."""
    url = await _agent(sim_node, start_agent)
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode()
    error = await _refused(url, COMPLETIONS, body)
    assert error["param"] == "prompt" and "from 0 to 4294967295" in error["message"], error
    await _serves(url)


# -- 3. a model that is not a string --------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        (5, "'model' must be a string naming one of the models from /v1/models, got 5"),
        ("", "'model' must be a string naming one of the models from /v1/models, got \"\""),
        ([MODEL], "'model' must be a string naming one of the models from /v1/models, got an arr"),
        (None, "'model' is required: name one of the models from /v1/models"),
    ],
)
async def test_a_model_that_is_not_a_string_is_named_as_such(
    sim_node: NodeFactory, start_agent: AgentFactory, model: object, needle: str
) -> None:
    url = await _agent(sim_node, start_agent)
    body: dict[str, object] = {"messages": [{"role": "user", "content": "x"}]}
    if model is not None:
        body["model"] = model
    error = await _refused(url, CHAT, json.dumps(body).encode())
    assert error["message"].startswith(needle) and error["param"] == "model", error
    await _serves(url)


# -- 4. a client that hangs up mid-stream ---------------------------------------------------------


async def test_a_client_hanging_up_mid_stream_is_a_499_and_the_node_aborts(
    sim_processes: Callable[..., list[SimProcess]],
    start_agent: AgentFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client reads the first event and closes its connection while the agent's loop is
    busy (a blocking sleep here, as a loaded agent would be): the node's next chunk and the
    client's FIN arrive in one poll of the loop, so the agent writes to a connection the loop
    already knows is closing, and aiohttp raises ClientConnectionResetError from the write
    before it cancels the handler.  That is the client going away, like a cancel: status 499
    in the metrics, the upstream closed so the node aborts, nothing logged at ERROR."""
    (node,) = sim_processes(1, time_scale=2.0)  # a separate process: it streams while we block
    handle = await start_agent([node.url])
    port = int(handle.url.rsplit(":", 1)[1])
    body = json.dumps(
        {"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    ).encode()
    hang_ups = 3
    with caplog.at_level(logging.WARNING):
        for _ in range(hang_ups):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await reader.readuntil(b"data: ")  # the first event has reached the client
            time.sleep(0.3)  # noqa: ASYNC251 (on purpose: the loop stalls, the node streams on)
            writer.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.3)
        for _ in range(100):
            aborted = await metric(node.url, "vllm:request_success_total", finished_reason="abort")
            if aborted == hang_ups:
                break
            await asyncio.sleep(0.1)
    assert aborted == hang_ups  # every hang-up reached the node
    assert await metric(node.url, "vllm:num_requests_running") == 0
    statuses = {
        s: await metric(handle.url, "meridian_agent_requests_total", status=s)
        for s in ("200", "499", "500")
    }
    assert statuses == {"200": 0, "499": hang_ups, "500": 0}, statuses
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]
    await _serves_through(handle.url)


async def _serves_through(url: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(f"{url}{COMPLETIONS}", json=body) as r:
        assert r.status == 200, await r.text()


# -- 5. 405 says what is allowed ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", CHAT, "POST"),
        ("PUT", COMPLETIONS, "POST"),
        ("POST", "/health", "GET, HEAD"),
        ("DELETE", "/v1/models", "GET, HEAD"),
    ],
)
async def test_405_carries_allow(
    sim_node: NodeFactory, start_agent: AgentFactory, method: str, path: str, allow: str
) -> None:
    url = await _agent(sim_node, start_agent)
    async with aiohttp.ClientSession() as s, s.request(method, f"{url}{path}") as r:
        assert r.status == 405
        assert r.headers.get("Allow") == allow
        error = (await r.json())["error"]
    assert error["code"] == 405
    assert (
        error["message"] == f"{method} is not allowed on {path}; use {allow.replace(', ', ' or ')}"
    )
    await _serves(url)


# -- 6. malformed HTTP does not flood the log -----------------------------------------------------


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[Callable[[str], tuple[str, ServerProcess]]]:
    """``url, process = start(node_url)``: a real ``meridian-agent``, its output in a file."""
    started: list[ServerProcess] = []

    def start(node_url: str) -> tuple[str, ServerProcess]:
        port = free_port()
        argv = [sys.executable, "-m", "regional_agent.cli", "--host", "127.0.0.1",
                "--port", str(port), "--node", node_url, "--log-level", "INFO"]  # fmt: skip
        process = ServerProcess(argv, log_path=tmp_path / f"agent-{port}.log")
        started.append(process)
        return f"http://127.0.0.1:{port}", process

    yield start
    for process in started:
        process.stop()


GARBAGE = [
    b"GARBAGE\r\n\r\n",  # not HTTP (aiohttp logs this one at DEBUG on a first request)
    b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",  # a header line without a colon
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",  # too long a line
]


async def test_a_flood_of_malformed_requests_is_a_few_short_log_lines(
    sim_node: NodeFactory, agent_process: Callable[[str], tuple[str, ServerProcess]]
) -> None:
    """aiohttp logs each request it cannot parse with the parser's traceback (about 30 lines);
    the agent makes it one INFO line, at most one per client address a minute, with a count of
    what it left out."""
    url, process = agent_process(await sim_node())
    await answered(f"{url}/ready", process, "meridian-agent")
    port = int(url.rsplit(":", 1)[1])
    before = process.log_tail(1_000_000).count("\n")
    for i in range(200):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GARBAGE[i % len(GARBAGE)])
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await reader.readuntil(b"never")  # answered 400 (or cut), then closed
        writer.close()
        await writer.wait_closed()
    await _serves_through(url)  # and it still serves
    await asyncio.sleep(0.5)  # let it write its log
    log = process.log_tail(1_000_000)
    lines = log.splitlines()[before:]
    assert "Traceback" not in log, log[-3000:]
    malformed = [line for line in lines if "malformed HTTP request" in line]
    assert 1 <= len(malformed) <= 3 and len(lines) <= 10, "\n".join(lines)
    assert "from 127.0.0.1 (" in malformed[0] and " INFO aiohttp.server " in malformed[0]
    # the next line from this address comes a minute later and says how many it left out
    assert all(len(line) < 400 for line in lines), lines


# -- 7. large prompts do not stall the event loop -------------------------------------------------


@pytest.fixture
async def niced_nodes(tmp_path: Path) -> AsyncIterator[Callable[[int], Any]]:
    """``urls = await start(n)``: ``meridian-sim`` processes at the lowest CPU priority, so
    that their own work on a huge prompt (they tokenise all of it) does not take the CPU from
    the agent under test."""
    started: list[ServerProcess] = []

    async def start(n: int) -> list[str]:
        ports = [free_port() for _ in range(n)]
        for i, port in enumerate(ports):
            argv = ["nice", "-n", "19", sys.executable, "-m", "meridian_sim.cli", "node",
                    "--host", "127.0.0.1", "--port", str(port), "--profile", "cpu-tiny",
                    "--time-scale", "20", "--seed", str(i), "--log-level", "WARNING"]  # fmt: skip
            started.append(ServerProcess(argv, log_path=tmp_path / f"node-{port}.log"))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, process in zip(urls, started[-n:], strict=True):
            await answered(f"{url}/health", process, "meridian-sim")
        return urls

    yield start
    for process in started:
        process.kill()  # one busy tokenising a huge prompt would not see SIGTERM for a while


def _big_chat(nbytes: int, seed: int) -> bytes:
    """A chat request of ``nbytes`` of prose, under server.max_body_bytes (4 MiB)."""
    words = ("alpha", "beta", "gamma", "routing", "prefix", "cache", "the", "of", "tokenizer")
    text = " ".join(f"{words[(i * 7 + seed) % len(words)]}{i % 97}" for i in range(nbytes // 8))
    body = {"model": MODEL, "messages": [{"role": "user", "content": text[:nbytes]}]}
    return json.dumps(body).encode()


# aiohttp's client warns (ResourceWarning, ignored by default outside tests) when it sends more
# than 1 MiB of bytes at once, as this test's own client does (the agent forwards such a body as
# a stream, upstream/client.py).
@pytest.mark.filterwarnings("ignore:Sending a large body directly:ResourceWarning")
async def test_three_maximum_size_prompts_do_not_stall_health_or_other_clients(
    niced_nodes: Callable[[int], Any], start_agent: AgentFactory
) -> None:
    """Three 3.8 MB chat prompts (the body limit is 4 MiB) used to block the agent's event
    loop for seconds each (JSON, chat rendering, the pure-Python tokeniser and block hashing
    of 800k tokens, on the loop).  Now they are parsed on parse threads and only their first
    routing.prefix_max_tokens tokens are tokenised: /health answers within 100 ms throughout,
    and another client's small chat request is served."""
    urls = await niced_nodes(4)  # three may each be busy with a huge prompt; one stays free
    handle = await start_agent(urls)
    bodies = [_big_chat(3_800_000, seed) for seed in range(3)]
    assert all(3_700_000 < len(b) < handle.edge.settings.server.max_body_bytes for b in bodies)

    async def big(session: aiohttp.ClientSession, body: bytes) -> None:
        async with session.post(f"{handle.url}{CHAT}", data=body, headers=JSON) as r:
            await r.read()

    def forwarded() -> int:
        return sum(node.in_flight for node in handle.edge.pool)

    async with aiohttp.ClientSession() as clients, aiohttp.ClientSession() as probe:
        async with probe.get(f"{handle.url}/health") as r:  # a warm connection for the probes
            assert r.status == 200
        tasks = [asyncio.create_task(big(clients, body)) for body in bodies]
        latencies: list[float] = []
        small_ok = asyncio.create_task(_serves(handle.url))
        deadline = time.monotonic() + 60
        # Poll every 10 ms until all three are parsed (sent to a node, or answered), at least
        # 50 times.  A poll's latency counts from when it was due: this client shares the
        # agent's loop, so a stall that falls in its sleep delays the poll as it would delay
        # a request that arrived then from anyone else.
        due = time.perf_counter()
        while forwarded() + sum(t.done() for t in tasks) < 3 or len(latencies) < 50:
            assert time.monotonic() < deadline, f"only {forwarded()} of 3 forwarded in 60 s"
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            async with probe.get(f"{handle.url}/health") as r:
                assert r.status == 200
                await r.read()
            done = time.perf_counter()
            latencies.append(done - due)
            due = done + 0.01
        await asyncio.wait_for(small_ok, timeout=30)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    worst = max(latencies)
    assert worst < 0.100, (
        f"GET /health took {worst * 1000:.0f} ms at worst (of {len(latencies)} polls, median "
        f"{sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms) while three 3.8 MB prompts "
        "were parsed: the bound is 100 ms"
    )


@pytest.mark.parametrize("before", [0.005, 0.0001])
async def test_the_first_large_body_lowers_the_gil_switch_interval_and_never_raises_it(
    sim_node: NodeFactory, start_agent: AgentFactory, before: float
) -> None:
    """The parse thread starts with the first body of parse.offload_min_bytes or more, and with
    it the switch interval drops to 0.2 ms (regional_agent/edge.py), so the loop waits at most
    that long for the GIL after each syscall while the thread tokenises; a lower interval set
    by the process is kept."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(before)
    try:
        # the simulated node's context is 512 tokens: a lower threshold, not a longer body
        url = await _agent(sim_node, start_agent, parse={"offload_min_bytes": 300})
        await _serves(url)  # a small body: parsed on the loop, no thread yet
        assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": "word " * 60}]}  # fmt: skip
        async with aiohttp.ClientSession() as s, s.post(f"{url}{CHAT}", json=body) as r:
            assert r.status == 200, await r.text()
        assert sys.getswitchinterval() == pytest.approx(min(before, 0.0002), abs=2e-6)
    finally:
        sys.setswitchinterval(saved)


async def test_a_prompt_past_prefix_max_tokens_routes_on_its_head_and_is_forwarded_whole(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """With routing.prefix_max_tokens at 64, a 400-token prompt is hashed on its first 64
    tokens (4 blocks): repeats still find the node that has it cached, and the node gets the
    whole prompt (its own count is the full 400 tokens)."""
    urls = [await sim_node(seed=i) for i in range(3)]
    handle = await start_agent(urls, policy="prefix_aware", routing={"prefix_max_tokens": 64})
    long_prompt = " ".join(f"word{i % 50} alpha beta gamma" for i in range(80))  # 400 tokens
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 1, "echo": False}
            async with s.post(f"{handle.url}{COMPLETIONS}", json=body) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            assert usage["prompt_tokens"] == 400  # forwarded unchanged
    served = {u: await metric(u, "vllm:request_success_total") for u in urls}
    assert sorted(served.values()) == [0, 0, 4], served  # one home, found from the head alone
