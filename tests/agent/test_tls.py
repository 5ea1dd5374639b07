"""The agent's listener over TLS: a real ``meridian-agent`` process with ``server.tls_cert_file``
and ``server.tls_key_file`` in front of a real ``meridian-sim`` node; the certificate is replaced
and reloaded on SIGHUP while a kept-alive connection stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.faults.harness import MODEL, AgentProc, NodeProc
from tests.support.certs import CertAuthority, Pair, serial
from tests.support.ports import free_port

FAST = """
[telemetry]
scrape_interval_s = 0.1
stale_after_s = 1.0
models_refresh_s = 0.5
[health]
probe_interval_s = 0.2
"""


@dataclass
class Tls:
    ca: CertAuthority
    first: Pair
    cert: Path  # the paths the agent reads; their content is replaced by a test
    key: Path


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    ca = CertAuthority.create(tmp_path / "pki")
    first = ca.issue("first", serial=1001)
    cert, key = tmp_path / "agent.crt", tmp_path / "agent.key"
    cert.write_bytes(first.cert.read_bytes())
    key.write_bytes(first.key.read_bytes())
    key.chmod(0o600)
    return Tls(ca=ca, first=first, cert=cert, key=key)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProc]:
    n = NodeProc(port=free_port(), log_dir=tmp_path).start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
async def agent(tmp_path: Path, tls: Tls, node: NodeProc) -> AsyncIterator[AgentProc]:
    config = (
        f'[server]\ntls_cert_file = "{tls.cert}"\ntls_key_file = "{tls.key}"\n'
        f'{FAST}\n[[nodes]]\nurl = "{node.url}"\n'
    )
    a = AgentProc(port=free_port(), log_dir=tmp_path, config=config, tls=tls.ca.client())
    a.start()
    try:
        async with httpx.AsyncClient(verify=tls.ca.client(), timeout=5) as c:
            end = time.monotonic() + 30
            while (await c.get(f"{a.url}/ready")).status_code != 200:
                assert time.monotonic() < end, "the agent never became ready"
                await asyncio.sleep(0.1)
        yield a
    finally:
        a.stop()


class KeptAlive:
    """One TLS connection to the agent, kept open between requests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> KeptAlive:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
        )
        return cls(reader, writer)

    @property
    def serial(self) -> int:
        return serial(self.writer.get_extra_info("peercert"))

    async def get(self, path: str) -> int:
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await self.writer.drain()
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()


async def _handshake_serial(port: int, context: ssl.SSLContext) -> int:
    conn = await KeptAlive.open(port, context)
    try:
        return conn.serial
    finally:
        await conn.close()


def _openai(url: str, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The official client over ``http``: an httpx client, as most users pass one (this openai
    is typed for httpx2 and takes httpx's clients as they are)."""
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=http,  # type: ignore[arg-type]
    )


async def _chat(url: str, context: ssl.SSLContext) -> str:
    async with httpx.AsyncClient(verify=context, timeout=30) as http:
        client = _openai(url, http)
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    content = reply.choices[0].message.content
    assert content
    return content


async def test_the_agent_serves_https_and_the_openai_client_works(
    agent: AgentProc, tls: Tls
) -> None:
    assert agent.url.startswith("https://")
    assert agent.process is not None
    ready = f"READY https://127.0.0.1:{agent.port}"
    end = time.monotonic() + 30  # with workers the supervisor says it once every one listens
    while ready not in agent.process.log_tail(100_000):
        assert time.monotonic() < end, agent.process.log_tail()
        await asyncio.sleep(0.1)
    assert await _chat(agent.url, tls.ca.client())
    async with httpx.AsyncClient(verify=tls.ca.client(), timeout=30) as http:
        stream = await _openai(agent.url, http).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream"}],
            max_tokens=4,
            stream=True,
        )
        chunks = [c async for c in stream]
        assert chunks
    assert await _handshake_serial(agent.port, tls.ca.client()) == tls.first.serial


async def test_plain_http_and_untrusted_clients_get_nothing(agent: AgentProc) -> None:
    plain = agent.url.replace("https://", "http://")
    async with httpx.AsyncClient(timeout=5) as c:
        with pytest.raises(httpx.HTTPError):
            await c.get(f"{plain}/health")
    async with httpx.AsyncClient(timeout=5) as c:  # the system's CAs do not know ours
        with pytest.raises(httpx.ConnectError):
            await c.get(f"{agent.url}/health")


async def test_sighup_reloads_the_certificate_and_keeps_open_connections(
    agent: AgentProc, tls: Tls
) -> None:
    assert agent.process is not None
    trusted = tls.ca.client()
    old = await KeptAlive.open(agent.port, trusted)
    try:
        assert old.serial == tls.first.serial and await old.get("/health") == 200

        second = tls.ca.issue("second", serial=2002)
        _replace(tls, second)
        os.kill(agent.process.pid, signal.SIGHUP)
        await _until_serial(agent.port, trusted, second.serial)
        assert await _chat(agent.url, trusted)
        # the connection made before the reload still works, on the certificate it was made with
        assert await old.get("/health") == 200 and old.serial == tls.first.serial

        # a bad pair (this key does not match the certificate) changes nothing: the log says why
        third = tls.ca.issue("third", serial=3003)
        tls.cert.write_bytes(third.cert.read_bytes())
        tls.key.write_bytes(second.key.read_bytes())
        os.kill(agent.process.pid, signal.SIGHUP)
        await _until_logged(agent, "TLS certificate not reloaded")
        assert await _handshake_serial(agent.port, trusted) == second.serial
        assert await _chat(agent.url, trusted)
        assert await old.get("/health") == 200

        # and once the pair is whole again, SIGHUP loads it
        tls.key.write_bytes(third.key.read_bytes())
        os.kill(agent.process.pid, signal.SIGHUP)
        await _until_serial(agent.port, trusted, third.serial)
        assert await old.get("/admin/queue") == 401  # still served on the first handshake
        assert agent.process.exit_code() is None
    finally:
        await old.close()


def _replace(tls: Tls, pair: Pair) -> None:
    """Install ``pair`` where the agent reads its certificate, each file by an atomic rename."""
    for source, target in ((pair.cert, tls.cert), (pair.key, tls.key)):
        staged = target.with_suffix(".new")
        staged.write_bytes(source.read_bytes())
        staged.replace(target)


async def _until_serial(port: int, context: ssl.SSLContext, expected: int) -> None:
    end = time.monotonic() + 10
    seen = None
    while time.monotonic() < end:
        seen = await _handshake_serial(port, context)
        if seen == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"new handshakes still see serial {seen}, not {expected}")


async def _until_logged(agent: AgentProc, text: str) -> None:
    assert agent.process is not None
    end = time.monotonic() + 10
    while text not in agent.process.log_tail(20000):
        assert time.monotonic() < end, f"{text!r} not in the log:\n{agent.process.log_tail()}"
        await asyncio.sleep(0.05)
