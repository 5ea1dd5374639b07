"""regional_agent.upstream.http1, the request path's HTTP/1.1 client, through ``NodeClient.post``
against real servers on loopback: aiohttp's, and raw asyncio ones that send what a test needs
byte for byte (a node that drops a kept-alive connection, a body ended by the close, garbage, a
fast stream to a slow reader), and a TLS server with a certificate of the test's own CA."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from regional_agent.errors import UpstreamStatus, UpstreamUnavailable
from regional_agent.upstream import http1
from regional_agent.upstream.client import NodeClient, Timeouts
from tests.support.certs import CertAuthority


def _client() -> NodeClient:
    return NodeClient(connect_timeout_s=2.0, first_byte_timeout_s=5.0, read_timeout_s=5.0)


async def _aiohttp_node(
    routes: Callable[[web.Application], None], *, tls: ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    app = web.Application()
    routes(app)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class _RawNode:
    """A server that runs ``handler`` on each connection; :meth:`close` waits for the handlers
    to finish (the client's close ends them) and closes their connections."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 5)
        await self._server.wait_closed()


async def _raw_node(handler: Handler) -> tuple[_RawNode, str]:
    node = _RawNode(handler)
    return node, await node.start()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


async def test_keep_alive_carries_the_next_request_and_the_host_and_length_are_sent() -> None:
    peers: list[object] = []
    seen: list[tuple[str | None, str | None, bytes]] = []

    async def echo(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        body = await request.read()
        seen.append((request.headers.get("Host"), request.headers.get("X-Request-ID"), body))
        return web.json_response({"n": len(peers)})

    node = _aiohttp_node(lambda app: app.router.add_post("/v1/x", echo))
    base = await anext(node)
    client = _client()
    try:
        for i in range(3):
            async with client.post(
                "n1", f"{base}/v1/x", body=b'{"i": %d}' % i, headers={"X-Request-ID": f"r{i}"}
            ) as up:
                assert up.status == 200
                assert up.content_type.startswith("application/json")
                assert await up.read() == b'{"n": %d}' % (i + 1)
        assert len(set(peers)) == 1, peers  # one connection, kept alive
        assert client.pool.open_connections() == 1 and client.pool.idle_connections() == 1
        port = base.rsplit(":", 1)[1]
        assert seen == [(f"127.0.0.1:{port}", f"r{i}", b'{"i": %d}' % i) for i in range(3)]
    finally:
        await client.close()
        await node.aclose()


async def test_a_stream_left_mid_body_closes_its_connection_and_the_node_sees_it_go() -> None:
    gone = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: x\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            gone.set()
            raise

    node = _aiohttp_node(lambda app: app.router.add_post("/s", endless))
    base = await anext(node)
    client = _client()
    try:
        async with client.post("n1", f"{base}/s", body=b"{}", headers={}) as up:
            async for chunk in up.chunks():
                assert chunk.startswith(b"data: x")
                break
        await asyncio.wait_for(gone.wait(), 5)
        assert client.pool.idle_connections() == 0
    finally:
        await client.close()
        await node.aclose()


async def test_an_error_status_raises_with_the_node_body_and_keeps_the_connection() -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": "queue full"}, status=503)

    node = _aiohttp_node(lambda app: app.router.add_post("/x", busy))
    base = await anext(node)
    client = _client()
    try:
        with pytest.raises(UpstreamStatus) as caught:
            async with client.post("n1", f"{base}/x", body=b"{}", headers={}):
                pass
        assert caught.value.http_status == 503
        assert caught.value.upstream_body == b'{"error": "queue full"}'
        assert caught.value.content_type.startswith("application/json")
        assert client.pool.idle_connections() == 1
    finally:
        await client.close()
        await node.aclose()


async def test_a_kept_alive_connection_the_node_dropped_is_retried_once_on_a_new_one() -> None:
    """The race keep-alive has: the node closes an idle connection as the next request goes out
    on it.  This node answers one request per connection and closes the connection when the
    second arrives, without a byte of answer."""
    connections = 0

    async def one_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await _read_request(reader)
        writer.transport.abort()  # a reset, as a node's idle timeout can look

    server, base = await _raw_node(one_per_connection)
    client = _client()
    try:
        for _ in range(3):
            async with client.post("n1", f"{base}/x", body=b"{}", headers={}) as up:
                assert await up.read() == b"ok"
        assert connections == 3
    finally:
        await client.close()
        await server.close()


async def test_headers_overdue_cut_the_call_at_the_first_byte_limit_and_close_it() -> None:
    hung_up = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # nothing sent, until the agent hangs up
        hung_up.set()

    server, base = await _raw_node(silent)
    client = _client()
    try:
        started = time.monotonic()
        with pytest.raises(
            UpstreamUnavailable,
            match=r"got no response headers within 0.3 s \(upstream.first_byte_timeout_s\)",
        ):
            async with client.post(
                "n1", f"{base}/x", body=b"{}", headers={},
                timeouts=Timeouts(first_byte_s=0.3, gap_s=5.0),
            ):  # fmt: skip
                pass
        assert 0.29 <= time.monotonic() - started < 2.0
        await asyncio.wait_for(hung_up.wait(), 5)
    finally:
        await client.close()
        await server.close()


async def test_a_body_without_a_length_ends_when_the_node_closes() -> None:
    async def old_style(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nhello, ")
        await writer.drain()
        writer.write(b"world")
        writer.close()

    server, base = await _raw_node(old_style)
    client = _client()
    try:
        async with client.post("n1", f"{base}/x", body=b"{}", headers={}) as up:
            assert await up.read() == b"hello, world"
        assert client.pool.idle_connections() == 0
    finally:
        await client.close()
        await server.close()


async def test_a_body_cut_short_is_a_broken_response_not_a_short_one() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    server, base = await _raw_node(cut)
    client = _client()
    try:
        with pytest.raises(UpstreamUnavailable, match=r"node n1 broke the response: .*closed"):
            async with client.post("n1", f"{base}/x", body=b"{}", headers={}) as up:
                await up.read()
    finally:
        await client.close()
        await server.close()


async def test_garbage_instead_of_a_response_is_an_unavailable_node_named_so() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the agent hangs up
        writer.close()

    server, base = await _raw_node(garbage)
    client = _client()
    try:
        with pytest.raises(UpstreamUnavailable, match=r"failed: MalformedResponse: malformed"):
            async with client.post("n1", f"{base}/x", body=b"{}", headers={}):
                pass
        for _ in range(100):  # the close completes on a later turn of the loop
            if client.pool.open_connections() == 0:
                break
            await asyncio.sleep(0.01)
        assert client.pool.open_connections() == 0
    finally:
        await client.close()
        await server.close()


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    client = _client()
    try:
        with pytest.raises(UpstreamUnavailable, match=r"header 'X-Evil' has a line break"):
            async with client.post(
                "n1", "http://127.0.0.1:9/x", body=b"{}", headers={"X-Evil": "a\r\nHost: b"}
            ):
                pass
        with pytest.raises(UpstreamUnavailable, match=r"not an http\(s\) URL"):
            async with client.post("n1", "ftp://127.0.0.1/x", body=b"{}", headers={}):
                pass
        assert client.pool.open_connections() == 0
    finally:
        await client.close()


async def test_a_refused_connection_is_an_unavailable_node() -> None:
    server, base = await _raw_node(_read_request)  # type: ignore[arg-type]
    await server.close()
    client = _client()
    try:
        with pytest.raises(UpstreamUnavailable, match=r"node n1: POST .* failed: "):
            async with client.post("n1", f"{base}/x", body=b"{}", headers={}):
                pass
    finally:
        await client.close()


async def test_a_fast_stream_to_a_slow_reader_is_held_back_at_the_node_not_in_the_agent() -> None:
    """4 MiB sent as fast as the node can, read slowly: reading from the node pauses at the
    high-water mark, so the agent never holds much more than that, and every byte arrives."""
    total = 4 * 1024 * 1024
    piece = b"x" * 65536

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for _ in range(total // len(piece)):
            writer.write(piece)
            await writer.drain()
        writer.close()

    server, base = await _raw_node(flood)
    client = _client()
    most = 0
    got = 0
    try:
        async with client.post("n1", f"{base}/x", body=b"{}", headers={}) as up:
            async for chunk in up.chunks():
                got += len(chunk)
                most = max(most, len(chunk))
                await asyncio.sleep(0.002)
        assert got == total
        # what had piled up when taken: the high-water mark (256 KiB) and a read or two past it
        assert most <= 1024 * 1024, most
    finally:
        await client.close()
        await server.close()


async def test_idle_connections_are_closed_after_the_keep_alive() -> None:
    closed = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()  # EOF: the agent closed it
        closed.set()
        writer.close()

    server, base = await _raw_node(serve)
    client = _client()
    client.pool = http1.Pool(connect_timeout_s=2.0, keepalive_s=0.2)
    try:
        async with client.post("n1", f"{base}/x", body=b"{}", headers={}) as up:
            await up.read()
        assert client.pool.idle_connections() == 1
        await asyncio.wait_for(closed.wait(), 5)
        assert client.pool.idle_connections() == 0
    finally:
        await client.close()
        await server.close()


async def test_https_nodes_are_verified_against_the_trust_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = CertAuthority.create(tmp_path)
    pair = ca.issue("node", serial=1001)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pair.cert, pair.key)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="over tls")

    node = _aiohttp_node(lambda app: app.router.add_post("/x", hello), tls=tls)
    base = await anext(node)
    try:
        untrusting = _client()
        try:
            with pytest.raises(UpstreamUnavailable, match=r"(?i)certificate verify failed"):
                async with untrusting.post("n1", f"{base}/x", body=b"{}", headers={}):
                    pass
        finally:
            await untrusting.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert))  # the test's CA is the trust store
        trusting = _client()
        try:
            async with trusting.post("n1", f"{base}/x", body=b"{}", headers={}) as up:
                assert await up.read() == b"over tls"
        finally:
            await trusting.close()
    finally:
        await node.aclose()
