"""HTTP/1.1 to nodes on pooled keep-alive connections: the request path's client.

aiohttp's client cost the agent more of its CPU than anything else on the request path (about
30 % of the busy agent's samples in py-spy; measured alone against a simulated node, 174 µs of
CPU per plain call against 62 µs for ``NodeClient.post`` on this module:
``benchmarks/upstream_client.py``, docs/benchmarks.md, "The request path's own HTTP client").
What a node call needs is small: a POST (or another method) with a body already in bytes, the
status and content type, and the body as it arrives, de-chunked, with backpressure.  So each
connection is an :class:`asyncio.Protocol` whose response is parsed by ``httptools`` (llhttp,
the C parser of Node.js, which aiohttp's own parser is built on too), and the idle ones wait in
a :class:`Pool` per origin (scheme, host, port).

What it does, and does not:

- One request at a time per connection (no pipelining); a connection goes back to the pool
  only when its response was read to the end and both sides keep it alive.  A response left
  mid-body closes its connection: that is how a node (vLLM) learns to abort the request.
- A reused connection that the node closed while it sat idle (its keep-alive ran out as the
  request was sent) fails before any byte of a response: the request is sent once more on a new
  connection.  Any other failure is the caller's to handle (``regional_agent.upstream.client``
  turns it into the agent's errors).
- Idle connections are closed after ``keepalive_s`` (30 s, as aiohttp's connector did).
- ``https://`` origins are dialled over TLS with the system's trust store and the host's name
  checked, as aiohttp did for node URLs.
- No redirects, cookies, proxies, compression (no ``Accept-Encoding`` is sent, so the node's
  body is relayed as it was written) or ``Expect: 100-continue``.
- A body delimited by the connection's close (no length, not chunked) ends at the close.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, cast

import httptools

# Reading from a node pauses while this much of its body waits for the consumer (a slow client
# of a long stream), and resumes once the consumer has taken it.
_HIGH_WATER_BYTES: Final = 256 * 1024
KEEPALIVE_S: Final = 30.0


class ConnectionLost(ConnectionError):
    """The connection closed (or broke) before the response was complete."""


class MalformedResponse(ConnectionError):
    """What the node sent is not an HTTP/1.x response."""


class ConnectTimeout(TimeoutError):
    """No connection within the pool's connect timeout."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a connection goes: the pool's key."""

    https: bool
    host: str
    port: int
    host_header: bytes  # the Host header's value: the host and, when the URL names one, the port


@functools.lru_cache(maxsize=4096)
def split(url: str) -> tuple[Origin, bytes]:
    """The origin of ``url`` and its request target (path and query); ``ValueError`` for a URL
    this client cannot call (not ``http``/``https``, no host, a bad port)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    https = parts.scheme == "https"
    port = parts.port  # ValueError when it is out of range or not a number
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    if port is not None:
        shown += f":{port}"
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    origin = Origin(
        https=https,
        host=host,
        port=port if port is not None else (443 if https else 80),
        host_header=shown.encode("idna" if not shown.isascii() else "ascii"),
    )
    return origin, target.encode("ascii", errors="strict")


def request_head(
    method: str, origin: Origin, target: bytes, headers: Mapping[str, str], body_length: int | None
) -> bytes:
    """The request line and headers, ``Host`` and ``Content-Length`` (unless ``body_length`` is
    ``None``) added; ``ValueError`` for a header that would break the message (CR or LF)."""
    start = b"%s %s HTTP/1.1\r\nHost: %s\r\n"
    lines = [start % (method.encode("ascii"), target, origin.host_header)]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
            raise ValueError(f"header {name!r} has a line break or a colon in it")
        lines.append(f"{name}: {value}\r\n".encode())
    if body_length is not None:
        lines.append(b"Content-Length: %d\r\n" % body_length)
    lines.append(b"\r\n")
    return b"".join(lines)


class Connection(asyncio.Protocol):
    """One keep-alive connection to a node and the response of its current request."""

    def __init__(self, pool: Pool, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0  # loop time it went back to the pool
        self._parser: httptools.HttpResponseParser | None = None  # while a request is out
        self.status = 0
        self.content_type = ""
        self.headers_done = False
        self.done = False  # the whole response has arrived
        self.keep_alive = False
        self.got_bytes = False  # any byte of this request's response
        self.overdue = False  # the caller's deadline for the headers passed (expire)
        self.error: ConnectionError | None = None
        self._delimited = False  # a Content-Length or chunked body (else it ends at the close)
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    # -- the exchange ----------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        """Start a request: reset the response's state and write the request."""
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.content_type = ""
        self.headers_done = self.done = self.keep_alive = self.got_bytes = self.overdue = False
        self.error = None
        self._delimited = False
        self._body = []
        self._buffered = 0
        assert self.transport is not None
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)

    def take(self) -> bytes:
        """The body's bytes that have arrived and not been taken (``b""``: none yet)."""
        body = self._body
        if not body:
            return b""
        chunk = body[0] if len(body) == 1 else b"".join(body)
        self._body = []
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def wait(self) -> asyncio.Future[None]:
        """A future done at the next thing that happens to the response (headers, body bytes,
        its end, an error)."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = self._loop.create_future()
        return waiter

    def reusable(self) -> bool:
        """Whether this connection may carry another request: its response was read whole and
        both sides keep it alive."""
        return (
            self.done
            and self.keep_alive
            and self.error is None
            and not self._body
            and not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def expire(self) -> None:
        """The caller's deadline passed (a timer's callback): wake its wait, which gives up."""
        self.overdue = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: ConnectionError) -> None:
        if self.error is None and not self.done:
            self.error = error
        self._wake()

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are one
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self.done:  # bytes nobody asked for: the connection is unusable
            self._fail(MalformedResponse("the node sent bytes with no request outstanding"))
            self.close()
            return
        self.got_bytes = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(MalformedResponse(f"malformed HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if self._parser is not None and not self.done:
            if self.headers_done and not self._delimited and exc is None:
                self.done = True  # a body delimited by the close: this is its end
                self._wake()
                return
            why = f": {exc}" if exc is not None else ""
            self._fail(ConnectionLost(f"the node closed the connection mid-response{why}"))

    # -- httptools callbacks -----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._delimited = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self.status = self._parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        assert self._parser is not None
        self.keep_alive = self._parser.should_keep_alive()
        self.done = True
        self._wake()


class Pool:
    """Idle keep-alive connections by origin, and the dialling of new ones."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float = KEEPALIVE_S) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: set[Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def open_connections(self) -> int:
        return len(self._open)

    def idle_connections(self) -> int:
        return sum(map(len, self._idle.values()))

    def take_idle(self, origin: Origin) -> Connection | None:
        """The most recently used idle connection to ``origin`` that is still open and within
        its keep-alive, out of the pool; ``None`` when there is none."""
        idle = self._idle.get(origin)
        if not idle:
            return None
        assert self.loop is not None
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self._keepalive_s:
                conn.close()
                continue
            return conn
        return None

    async def dial(self, origin: Origin) -> Connection:
        """A new connection to ``origin``.  ``ConnectTimeout`` when none could be opened within
        the connect timeout; ``OSError`` (an ``ssl.SSLError`` included) when the dial failed."""
        loop = self.loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.https:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                transport, conn = await loop.create_connection(
                    lambda: Connection(self, origin, loop),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls is not None else None,
                )
        except TimeoutError as exc:
            raise ConnectTimeout(
                f"no connection to {origin.host}:{origin.port} within {self._connect_timeout_s:g} s"
            ) from exc
        # uvloop may call connection_made after create_connection has returned
        conn.transport = transport
        self._open.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """Back to the pool when it may carry another request, else closed."""
        if not conn.reusable():
            conn.close()
            return
        loop = self.loop
        assert loop is not None
        conn.idle_since = loop.time()
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._sweep is None:
            self._sweep = loop.call_later(self._keepalive_s, self._close_stale)

    def forget(self, conn: Connection) -> None:
        """``conn`` closed: out of the pool."""
        self._open.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def _close_stale(self) -> None:
        self._sweep = None
        loop = self.loop
        assert loop is not None
        oldest = loop.time() - self._keepalive_s
        left = False
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since <= oldest]:
                idle.remove(conn)
                conn.close()
            left = left or bool(idle)
        if left:
            self._sweep = loop.call_later(self._keepalive_s, self._close_stale)

    def close(self) -> None:
        """Close every connection, idle or not."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
