"""HTTP to nodes: the request path's calls (:meth:`NodeClient.post`) on the agent's own
HTTP/1.1 client (:mod:`regional_agent.upstream.http1`: keep-alive connections pooled per node,
responses parsed by httptools), the scrapes' and probes' GETs on one aiohttp session.

Every connection, aiohttp or timeout error is translated here, once, into the agent's errors:

- cannot connect, reset before the response, timeout before the headers → ``UpstreamUnavailable``
  (retryable);

Timeouts of a POST to a node, each named in the error it raises:

- ``connect_timeout_s``: opening the TCP connection.
- ``first_byte_timeout_s``: from sending the request, the time the node gets to start answering,
  both to send its response headers and, after them, the first bytes of the body.  vLLM sends a
  stream's headers at once and then nothing until the first token, so a queued request's wait
  and its prefill are silence inside the stream: this budget covers them, however long
  ``read_timeout_s`` is.
- ``read_timeout_s``: the longest silence between two reads of the body once its first bytes
  have arrived (a node stuck mid-generation).

A call may bring :class:`Timeouts` of its own: the proxy gives streamed requests the stall
limits of their model (``stall.first_token_s`` for the wait to the first token,
``stall.inter_token_s`` between tokens), so an engine that stopped stepping is cut, counted as a
node failure and, before any byte reached the client, retried elsewhere.

- an error status → ``UpstreamStatus`` carrying the node's body (retryable for 5xx and 429);
- a broken stream after the headers → ``UpstreamUnavailable`` raised from the chunk iterator
  (the proxy knows whether bytes already reached the client, and so whether it may retry);
- a body that is not what the endpoint promises → ``UpstreamProtocolError``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from regional_agent.errors import UpstreamProtocolError, UpstreamStatus, UpstreamUnavailable
from regional_agent.upstream import http1

_CONNECTION_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)
# a timer may fire this early (uvloop's are in milliseconds): a wait this close to its end is over
_TIMER_SLACK_S = 0.001


def _why(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, asyncio.TimeoutError) or not text:
        return type(exc).__name__ if not isinstance(exc, asyncio.TimeoutError) else "timed out"
    return f"{type(exc).__name__}: {text}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """One call's time limits, and the settings they come from (named in the errors)."""

    first_byte_s: float
    gap_s: float
    first_byte_name: str = "upstream.first_byte_timeout_s"
    gap_name: str = "upstream.read_timeout_s"


class UpstreamResponse:
    """A node's response whose headers have arrived; iterate its body chunk by chunk.

    The silences are timed by one timer per response, not one per read: a read that has to wait
    notes when its wait must end, and the timer, when it fires, cancels that read only if the
    wait has run that long, else moves itself to the read's own end.  A stream of thousands of
    chunks sets the timer a few times, once per ``gap_s`` at most, where an ``asyncio.timeout``
    per read scheduled and cancelled one per chunk."""

    def __init__(
        self,
        node_id: str,
        connection: http1.Connection,
        *,
        first_byte_deadline: float,
        timeouts: Timeouts,
    ) -> None:
        self.node_id = node_id
        self._conn = connection
        self._first_byte_deadline = first_byte_deadline  # loop time
        self._timeouts = timeouts
        self._started = False  # the body's first bytes have arrived
        self.status = connection.status
        self.content_type = connection.content_type or "application/octet-stream"
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task[Any] | None = None  # the task in a read that waits
        self._wait_until = 0.0  # loop time at which that read's wait runs out
        self._expired = False  # the timer cancelled the waiting read

    async def next_chunk(self, *, what: str = "response stream") -> bytes:
        """The body's next bytes, ``b""`` at its end; silence allowed as the module docstring
        says.  A broken connection raises ``UpstreamUnavailable`` ("node N broke the ``what``")."""
        conn = self._conn
        chunk = conn.take()  # what has arrived already needs no timer
        if chunk:
            self._started = True
            return chunk
        if conn.done:
            return b""
        if conn.error is not None:
            raise self._broken(conn.error, what)
        loop = asyncio.get_running_loop()
        waiting_first = not self._started  # the first bytes are due by the first-byte deadline
        until = self._first_byte_deadline if waiting_first else loop.time() + self._timeouts.gap_s
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._wait_until = until
        self._waiter = task
        timer = self._timer
        if timer is None or timer.when() > until:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(until, self._on_timer)
        try:
            while True:
                await conn.wait()
                chunk = conn.take()
                if chunk or conn.done:
                    break
                if conn.error is not None:
                    raise self._broken(conn.error, what)
        except asyncio.CancelledError:
            if self._expired and task.uncancel() <= cancelling:
                self._expired = False
                raise self._silence(waiting_first) from None
            raise  # cancelled from outside (as well)
        finally:
            self._waiter = None
        if chunk:
            self._started = True
        return chunk

    def _broken(self, error: BaseException, what: str) -> UpstreamUnavailable:
        broken = UpstreamUnavailable(
            f"node {self.node_id} broke the {what}: {_why(error)}", node_id=self.node_id
        )
        broken.__cause__ = error
        return broken

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None:
            return  # between two reads: the next read that waits sets it again
        loop = asyncio.get_running_loop()
        if loop.time() < self._wait_until - _TIMER_SLACK_S:  # the wait began after it was set
            self._timer = loop.call_at(self._wait_until, self._on_timer)
            return
        self._expired = True
        waiter.cancel()

    def _silence(self, waiting_first: bool) -> UpstreamUnavailable:
        t = self._timeouts
        if waiting_first:
            return UpstreamUnavailable(
                f"node {self.node_id} sent no first byte within {t.first_byte_s:g} s "
                f"({t.first_byte_name}): the engine may have stopped stepping",
                node_id=self.node_id,
            )
        return UpstreamUnavailable(
            f"node {self.node_id} sent nothing for {t.gap_s:g} s ({t.gap_name})",
            node_id=self.node_id,
        )

    def _close_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body chunk by chunk (:meth:`next_chunk` until it is empty)."""
        while chunk := await self.next_chunk():
            yield chunk

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while chunk := await self.next_chunk(what="response"):
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)


class NodeClient:
    def __init__(
        self, *, connect_timeout_s: float, first_byte_timeout_s: float, read_timeout_s: float
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._first_byte_timeout_s = first_byte_timeout_s
        self._read_timeout_s = read_timeout_s
        # sock_read would also bound the wait for the headers and for the first token; the
        # body's silences are timed by UpstreamResponse instead (module docstring).
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=None)
        self._default = Timeouts(first_byte_s=first_byte_timeout_s, gap_s=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None  # GETs: scrapes and probes
        self.pool = http1.Pool(connect_timeout_s=connect_timeout_s)  # the request path's calls

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
            # no cookie jar: a node's Set-Cookie must never ride along on other clients'
            # requests (and filtering a jar costs every request CPU)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        self.pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_text(self, node_id: str, url: str, *, timeout_s: float) -> str:
        try:
            async with asyncio.timeout(timeout_s), self.session.get(url) as r:
                body = await r.read()
                if r.status != 200:
                    raise UpstreamStatus(
                        f"node {node_id} answered {r.status} for {url}",
                        node_id=node_id,
                        status=r.status,
                        body=body,
                        content_type=r.headers.get("Content-Type", ""),
                    )
        except _CONNECTION_ERRORS as exc:
            raise UpstreamUnavailable(
                f"node {node_id}: GET {url} failed: {_why(exc)}", node_id=node_id
            ) from exc
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UpstreamProtocolError(
                f"node {node_id}: {url} is not UTF-8", node_id=node_id
            ) from exc

    async def get_json(self, node_id: str, url: str, *, timeout_s: float) -> Any:
        text = await self.get_text(node_id, url, timeout_s=timeout_s)
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UpstreamProtocolError(
                f"node {node_id}: {url} did not return JSON", node_id=node_id
            ) from exc

    async def probe(self, node_id: str, url: str, *, timeout_s: float) -> int:
        """GET a health URL; the status code, or ``UpstreamUnavailable`` when unreachable."""
        try:
            async with asyncio.timeout(timeout_s), self.session.get(url) as r:
                await r.read()
                return r.status
        except _CONNECTION_ERRORS as exc:
            raise UpstreamUnavailable(
                f"node {node_id}: probe {url} failed: {_why(exc)}", node_id=node_id
            ) from exc

    def post(
        self,
        node_id: str,
        url: str,
        *,
        body: bytes,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
        method: str = "POST",
    ) -> _Exchange:
        """POST (or ``method``) and yield once the headers are in (``async with``); error
        statuses raise ``UpstreamStatus``.

        ``timeouts`` replaces the client's first-byte and read timeouts for this call.  Leaving
        the block early closes the connection, which makes vLLM abort the request.
        """
        return _Exchange(self, node_id, url, body, headers, timeouts or self._default, method)


class _Exchange:
    """:meth:`NodeClient.post`'s context: a class rather than ``@asynccontextmanager``, whose
    generator is resumed at the start and the end of every request."""

    __slots__ = ("_body", "_client", "_conn", "_headers", "_method", "_node_id", "_t", "_up",
                 "_url")  # fmt: skip

    def __init__(
        self,
        client: NodeClient,
        node_id: str,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeouts: Timeouts,
        method: str,
    ) -> None:
        self._client = client
        self._node_id = node_id
        self._url = url
        self._body = body
        self._headers = headers
        self._t = timeouts
        self._method = method
        self._conn: http1.Connection | None = None
        self._up: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        node_id, url, method, body, t = self._node_id, self._url, self._method, self._body, self._t
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t.first_byte_s
        try:
            origin, target = http1.split(url)
            length = len(body) if body or method != "GET" else None
            head = http1.request_head(method, origin, target, self._headers, length)
        except ValueError as exc:
            raise UpstreamUnavailable(
                f"node {node_id}: {method} {url} failed: {exc}", node_id=node_id
            ) from exc
        pool = self._client.pool
        conn: http1.Connection | None = None
        try:
            for attempt in (0, 1):
                conn = pool.take_idle(origin) if not attempt else None
                reused = conn is not None
                if conn is None:
                    async with asyncio.timeout_at(deadline):
                        conn = await pool.dial(origin)
                conn.send(head, body)
                # the headers are due by the deadline: one timer, not an asyncio.timeout
                timer = loop.call_at(deadline, conn.expire)
                try:
                    while not conn.headers_done and conn.error is None and not conn.overdue:
                        await conn.wait()
                finally:
                    timer.cancel()
                if conn.headers_done:
                    break
                error = conn.error
                if error is None:  # overdue
                    raise TimeoutError
                if not reused or conn.got_bytes or not isinstance(error, http1.ConnectionLost):
                    raise error
                # the node closed it while it sat idle: once more, on a new connection
                conn.close()
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, http1.ConnectTimeout):
                raise UpstreamUnavailable(
                    f"node {node_id}: {method} {url} could not connect within "
                    f"connect_timeout_s {self._client._connect_timeout_s:g} s",
                    node_id=node_id,
                ) from exc
            if isinstance(exc, TimeoutError):
                raise UpstreamUnavailable(
                    f"node {node_id}: {method} {url} got no response headers within "
                    f"{t.first_byte_s:g} s ({t.first_byte_name})",
                    node_id=node_id,
                ) from exc
            if isinstance(exc, _CONNECTION_ERRORS):
                raise UpstreamUnavailable(
                    f"node {node_id}: {method} {url} failed: {_why(exc)}", node_id=node_id
                ) from exc
            raise
        assert conn is not None
        self._conn = conn
        up = UpstreamResponse(node_id, conn, first_byte_deadline=deadline, timeouts=t)
        if conn.status >= 400:
            try:
                try:
                    payload = await up.read()
                except UpstreamUnavailable:
                    payload = b""
                raise UpstreamStatus(
                    f"node {node_id} answered {conn.status}",
                    node_id=node_id,
                    status=conn.status,
                    body=payload,
                    content_type=conn.content_type or "application/json",
                )
            finally:
                up._close_timer()
                pool.release(conn)
                self._conn = None
        self._up = up
        return up

    async def __aexit__(self, *exc_info: object) -> None:
        if self._up is not None:
            self._up._close_timer()
        if self._conn is not None:
            # read to its end: back to the pool; abandoned mid-body: closed, so the node aborts
            self._client.pool.release(self._conn)
            self._conn = None


async def sibling_call(
    socket_path: str,
    method: str,
    path: str,
    *,
    headers: Mapping[str, str],
    body: bytes = b"",
    timeout_s: float,
) -> tuple[int, bytes]:
    """One HTTP request to a sibling worker on its Unix socket (``regional_agent.workers``):
    its status and body.  Raises ``OSError`` (``TimeoutError`` included) when it cannot be
    reached or does not answer within ``timeout_s``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.UnixConnector(path=socket_path)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.request(method, f"http://worker{path}", headers=headers, data=body) as reply,
        ):
            return reply.status, await reply.read()
    except aiohttp.ClientError as exc:
        raise OSError(f"worker socket {socket_path}: {_why(exc)}") from exc
