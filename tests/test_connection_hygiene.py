"""Connection hygiene on both servers (meridian_service.hygiene), attacked with real sockets.

A ``meridian-agent`` process in front of a ``meridian-sim`` node process, and a
``meridian-controller`` process (read port and admin port) on a real etcd, each with 1-second
limits: slowloris headers, a dribbled body, the per-address cap (other loopback addresses,
127.0.0.x, are other clients), keep-alive, and a stream that outlasts every timeout.  The
agent's and the controller's server-side sockets are counted in ``/proc/<pid>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import NodeFactory
from tests.support import EtcdServer, free_port, until
from tests.support.agent import AgentFactory
from tests.support.process import ServerProcess

HEADER_S = 1.0
BODY_S = 1.0
KEEPALIVE_S = 1.5
MAX_REQUESTS = 5
MARGIN_S = 1.5  # two shared cores: a timer may fire late, never early
MODEL = "tiny-model"
OPERATOR_TOKEN = "hygiene-operator-token"


@dataclass
class Proc:
    process: ServerProcess
    port: int
    admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid


def _wait_answering(url: str, process: ServerProcess, timeout_s: float = 30.0) -> None:
    """Poll ``url`` until the server answers anything HTTP (stdlib: no event loop needed)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if process.exit_code() is not None:
            raise process.failure(f"{url} exited")
        try:
            with opener.open(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise process.failure(f"{url} did not answer within {timeout_s:g} s")


def _start(argv: list[str], log: Path, *urls: str) -> ServerProcess:
    process = ServerProcess(argv, log_path=log)
    try:
        for url in urls:
            _wait_answering(url, process)
    except BaseException:
        process.stop()
        raise
    return process


@pytest.fixture(scope="module")
def slow_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One cpu-tiny node at 1/100 speed: a token every ~0.5 s, the first after ~1.5 s."""
    port = free_port()
    argv = [sys.executable, "-m", "meridian_sim.cli", "node", "--port", str(port),
            "--profile", "cpu-tiny", "--time-scale", "0.01", "--log-level", "WARNING"]  # fmt: skip
    log = tmp_path_factory.mktemp("node") / "node.log"
    process = _start(argv, log, f"http://127.0.0.1:{port}/health")
    yield Proc(process=process, port=port)
    process.stop()


@pytest.fixture(scope="module")
def agent(slow_node: Proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    work = tmp_path_factory.mktemp("agent")
    config = work / "agent.toml"
    config.write_text(
        f"""
[server]
header_timeout_s = {HEADER_S}
body_timeout_s = {BODY_S}
keepalive_timeout_s = {KEEPALIVE_S}
max_requests_per_connection = {MAX_REQUESTS}

[telemetry]
scrape_interval_s = 0.2
models_refresh_s = 1.0

[[nodes]]
url = "{slow_node.url}"
"""
    )
    port = free_port()
    # one process: the tests count its descriptors and connections
    argv = [sys.executable, "-m", "regional_agent.cli", "--config", str(config), "--workers", "1",
            "--port", str(port), "--log-level", "INFO"]  # fmt: skip
    process = _start(argv, work / "agent.log", f"http://127.0.0.1:{port}/health")
    yield Proc(process=process, port=port)
    process.stop()


@pytest.fixture
def controller(etcd: EtcdServer, tmp_path: Path) -> Iterator[Proc]:
    config = tmp_path / "controller.toml"
    sha = hashlib.sha256(OPERATOR_TOKEN.encode()).hexdigest()
    limits = f"header_timeout_s = {HEADER_S}\nbody_timeout_s = {BODY_S}\nmax_connections_per_ip = 4"
    config.write_text(
        f"""
[server]
{limits}

[api]
{limits}
[[api.tokens]]
name = "hygiene"
role = "operator"
sha256 = "{sha}"

[[regions]]
id = "eu-west"
geo = "eu"
"""
    )
    port, admin = free_port(), free_port()
    argv = [sys.executable, "-m", "controlplane.cli", "--etcd", etcd.url,
            "--config", str(config), "--id", "ctl-hygiene", "--port", str(port),
            "--admin-port", str(admin), "--log-level", "INFO"]  # fmt: skip
    process = _start(
        argv,
        tmp_path / "controller.log",
        f"http://127.0.0.1:{port}/health",
        f"http://127.0.0.1:{admin}/v1/health",
    )
    yield Proc(process=process, port=port, admin_port=admin)
    process.stop()


# -- what a server holds ------------------------------------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connections_on(pid: int, port: int) -> int:
    """The server-side TCP connections process ``pid`` holds on its listening ``port``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if int(local.rsplit(":", 1)[1], 16) == port and state != "0A" and inode in inodes:
                    count += 1
    return count


# -- clients ------------------------------------------------------------------------------------


@dataclass
class Dribble:
    opened_at: float
    closed_after_s: float | None = None
    received: bytes = b""


async def dribble(
    port: int, first: bytes, *, drip: bytes, every_s: float = 0.2, source: str = "127.0.0.1",
    give_up_s: float = 10.0,
) -> Dribble:  # fmt: skip
    """Connect from ``source``, send ``first``, then ``drip`` every ``every_s`` until the server
    closes the connection; how long that took and what it said."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    out = Dribble(opened_at=time.monotonic())

    async def drips() -> None:
        with contextlib.suppress(OSError):
            writer.write(first)
            while True:
                await asyncio.sleep(every_s)
                writer.write(drip)
                await writer.drain()

    task = asyncio.create_task(drips())
    try:
        async with asyncio.timeout(give_up_s):
            with contextlib.suppress(OSError):
                while chunk := await reader.read(65536):
                    out.received += chunk
        out.closed_after_s = time.monotonic() - out.opened_at
    except TimeoutError:
        pass
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return out


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str
) -> tuple[int, dict[str, str], bytes]:
    """One GET on an open connection: status, headers (lowercased), body."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


async def closed_after(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> float:
    """Seconds until the server closes the connection (EOF or reset)."""
    start = time.monotonic()
    async with asyncio.timeout(timeout_s):
        with contextlib.suppress(OSError):
            while await reader.read(65536):
                pass
    return time.monotonic() - start


async def chat(url: str, *, max_tokens: int = 1) -> dict[str, object]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        reply: dict[str, object] = await r.json()
        return reply


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in "{ "
    )


async def settle(
    pid: int, port: int, *, at_most: int = 0, at_least: int = 0, timeout_s: float = 5.0
) -> int:
    """The connections ``pid`` holds on ``port`` once between ``at_least`` and ``at_most``
    (``at_most`` defaults to ``at_least``), or when ``timeout_s`` ran out."""
    at_most = max(at_most, at_least)
    for _ in range(int(timeout_s / 0.05)):
        held = connections_on(pid, port)
        if at_least <= held <= at_most:
            return held
        await asyncio.sleep(0.05)
    return connections_on(pid, port)


# -- the agent ----------------------------------------------------------------------------------

SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: agent\r\n"


async def test_slowloris_connections_are_closed_within_the_header_timeout(agent: Proc) -> None:
    await chat(agent.url)  # warm: the agent's pooled connection to the node exists
    assert await settle(agent.pid, agent.port) == 0
    fds_before = open_fds(agent.pid)
    n = 50
    attackers = [
        asyncio.create_task(dribble(agent.port, SLOW_HEAD, drip=b"X-Slow: 1\r\n")) for _ in range(n)
    ]
    await until(lambda: connections_on(agent.pid, agent.port) >= n, 5, f"{n} slow connections")
    fds_held = open_fds(agent.pid)
    started = time.monotonic()
    reply = await chat(agent.url)  # a normal client is served meanwhile
    assert reply["choices"]
    served_in_s = time.monotonic() - started
    results = await asyncio.gather(*attackers)
    closes = [r.closed_after_s for r in results]
    assert all(c is not None for c in closes), closes
    times = [c for c in closes if c is not None]
    assert min(times) >= HEADER_S - 0.1, times  # never early
    assert max(times) <= HEADER_S + MARGIN_S, times
    assert sum(r.received.startswith(b"HTTP/1.1 408 ") for r in results) >= n // 2
    assert await settle(agent.pid, agent.port) == 0
    fds_after = open_fds(agent.pid)
    print(
        f"\nslowloris: {n} connections, closed after {min(times):.2f}-{max(times):.2f} s "
        f"(header_timeout_s={HEADER_S:g}); fds {fds_before} -> {fds_held} -> {fds_after}; "
        f"a normal request took {served_in_s:.2f} s meanwhile"
    )
    assert fds_held >= fds_before + n
    assert fds_after <= fds_before + 2  # the agent's pool to the node may hold one more


async def test_a_dribbled_body_is_cut_and_nothing_reaches_the_node(
    agent: Proc, slow_node: Proc
) -> None:
    before = await metric(slow_node.url, "vllm:request_success_total")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 100}\r\n\r\n"
    ).encode()
    result = await dribble(agent.port, head + body.encode()[:10], drip=b" ", every_s=0.1)
    assert result.closed_after_s is not None
    assert BODY_S - 0.1 <= result.closed_after_s <= BODY_S + MARGIN_S, result.closed_after_s
    assert result.received.startswith(b"HTTP/1.1 408 "), result.received[:200]
    assert b"connection: close" in result.received.lower()
    await asyncio.sleep(0.5)
    assert await metric(slow_node.url, "vllm:request_success_total") == before
    assert await metric(slow_node.url, "vllm:num_requests_running") == 0
    assert await metric(slow_node.url, "vllm:num_requests_waiting") == 0
    assert await settle(agent.pid, agent.port) == 0


async def test_a_stream_that_outlasts_every_timeout_is_not_cut(agent: Proc) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 6, "ignore_eos": True}  # fmt: skip
    started = time.monotonic()
    chunks, gaps, last = 0, [], started
    done = False
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{agent.url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                chunks += 1
                now = time.monotonic()
                gaps.append(now - last)
                last = now
    lasted = time.monotonic() - started
    assert done and chunks >= 6
    assert lasted > 2 * max(HEADER_S, BODY_S, KEEPALIVE_S), lasted
    assert max(gaps) > max(HEADER_S, BODY_S), gaps  # silent longer than the read timeouts


async def test_keep_alive_idle_timeout_first_byte_and_request_cap(agent: Proc) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
    try:
        status, headers, _ = await exchange(reader, writer, "/health")
        assert status == 200 and headers.get("connection", "").lower() != "close"
        idle = await closed_after(reader)
        assert KEEPALIVE_S - 0.1 <= idle <= KEEPALIVE_S + MARGIN_S, idle
    finally:
        writer.close()

    # The header deadline of a kept-alive connection's next request runs from its first byte.
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
    try:
        await exchange(reader, writer, "/health")
        await asyncio.sleep(KEEPALIVE_S - 0.4)  # idle, past the header timeout
        writer.write(b"GET /health HTTP/1.1\r\n")
        cut = await closed_after(reader)
        assert HEADER_S - 0.1 <= cut <= HEADER_S + MARGIN_S, cut
    finally:
        writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
    try:
        for i in range(1, MAX_REQUESTS + 1):
            status, headers, _ = await exchange(reader, writer, "/health")
            assert status == 200
            assert (headers.get("connection", "").lower() == "close") == (i == MAX_REQUESTS)
        assert await closed_after(reader) < 0.5
    finally:
        writer.close()


async def test_the_per_address_cap(start_agent: AgentFactory, sim_node: NodeFactory) -> None:
    handle = await start_agent([await sim_node()], server={"max_connections_per_ip": 3})
    port = int(handle.url.rsplit(":", 1)[1])
    held = [
        await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
        for _ in range(3)
    ]
    try:
        await until(lambda: handle.connections.by_address.get("127.0.0.3") == 3, 5, "3 held")
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.3", 0)
        )
        assert await closed_after(reader, timeout_s=2) < 0.5  # the fourth: closed at once
        writer.close()
        assert handle.connections.refused == 1
        # another address is another client
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.2", 0)
        )
        status, _, _ = await exchange(reader, writer, "/health")
        assert status == 200
        writer.close()
        # and a held connection still works; once one closes, the address may connect again
        status, _, _ = await exchange(*held[0], "/health")
        assert status == 200
        held.pop()[1].close()
        await until(lambda: handle.connections.by_address.get("127.0.0.3") == 2, 5, "2 held")
        held.append(await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0)))
        status, _, _ = await exchange(*held[-1], "/health")
        assert status == 200
    finally:
        for _, w in held:
            w.close()


# -- the controller's two ports -----------------------------------------------------------------


async def test_the_controller_ports_close_slowloris_and_cap_an_address(controller: Proc) -> None:
    assert controller.admin_port is not None
    ports = {"read": controller.port, "admin": controller.admin_port}
    for port in ports.values():
        assert await settle(controller.pid, port) == 0
    fds_before = open_fds(controller.pid)
    head = b"GET /v1/health HTTP/1.1\r\nHost: controller\r\n"
    # 3 slow clients per port from each of 127.0.0.{10..13}: the cap (4 per address) holds them
    attackers = [
        asyncio.create_task(dribble(port, head, drip=b"X-Slow: 1\r\n", source=f"127.0.0.{10 + i}"))
        for port in ports.values()
        for i in range(4)
        for _ in range(3)
    ]
    await until(
        lambda: all(connections_on(controller.pid, p) >= 12 for p in ports.values()),
        5,
        "12 slow connections on each port",
    )
    async with aiohttp.ClientSession() as s:
        for port in ports.values():
            async with s.get(f"http://127.0.0.1:{port}/v1/health") as r:
                assert r.status == 200
    times = [r.closed_after_s for r in await asyncio.gather(*attackers)]
    assert all(t is not None and HEADER_S - 0.1 <= t <= HEADER_S + MARGIN_S for t in times), times
    for port in ports.values():
        assert await settle(controller.pid, port) == 0
    assert open_fds(controller.pid) <= fds_before + 2

    # the cap: the fifth connection from one address is closed at once, on either port
    for port in ports.values():
        held = [
            await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.20", 0))
            for _ in range(4)
        ]
        try:
            assert await settle(controller.pid, port, at_least=4) == 4
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=("127.0.0.20", 0)
            )
            assert await closed_after(reader, timeout_s=2) < 0.5
            writer.close()
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=("127.0.0.21", 0)
            )
            status, _, _ = await exchange(reader, writer, "/v1/health")
            assert status == 200
            writer.close()
        finally:
            for _, w in held:
                w.close()


async def test_the_admin_port_cuts_a_dribbled_body_with_a_problem(controller: Proc) -> None:
    assert controller.admin_port is not None
    head = (
        "POST /v1/regions/eu-west/drain HTTP/1.1\r\nHost: controller\r\n"
        f"Authorization: Bearer {OPERATOR_TOKEN}\r\nContent-Type: application/json\r\n"
        "Content-Length: 200\r\n\r\n"
    ).encode()
    result = await dribble(controller.admin_port, head + b'{"reason": ', drip=b" ", every_s=0.1)
    assert result.closed_after_s is not None
    assert BODY_S - 0.1 <= result.closed_after_s <= BODY_S + MARGIN_S, result.closed_after_s
    assert result.received.startswith(b"HTTP/1.1 408 "), result.received[:300]
    assert b"application/problem+json" in result.received
