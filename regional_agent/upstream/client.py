"""HTTP to nodes: one aiohttp session with keep-alive connections pooled per node.

Every aiohttp or timeout error is translated here, once, into the agent's errors:

- cannot connect, reset before the response, timeout before the headers → ``UpstreamUnavailable``
  (retryable);

Timeouts of a POST to a node, each named in the error it raises:

- ``connect_timeout_s``: opening the TCP connection.
- ``first_byte_timeout_s``: from sending the request, the time the node gets to start answering,
  both to send its response headers and, after them, the first bytes of the body.  vLLM sends a
  stream's headers at once and then nothing until the first token, so a queued request's wait
  and its prefill are silence inside the stream: this budget covers them, however long
  ``read_timeout_s`` is.
- ``read_timeout_s``: the longest silence between two reads of the body once the request is
  older than ``first_byte_timeout_s`` (a node stuck mid-generation).

- an error status → ``UpstreamStatus`` carrying the node's body (retryable for 5xx and 429);
- a broken stream after the headers → ``UpstreamUnavailable`` raised from the chunk iterator
  (the proxy knows whether bytes already reached the client, and so whether it may retry);
- a body that is not what the endpoint promises → ``UpstreamProtocolError``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from regional_agent.errors import UpstreamProtocolError, UpstreamStatus, UpstreamUnavailable

_CONNECTION_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


def _why(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, asyncio.TimeoutError) or not text:
        return type(exc).__name__ if not isinstance(exc, asyncio.TimeoutError) else "timed out"
    return f"{type(exc).__name__}: {text}"


class UpstreamResponse:
    """A node's response whose headers have arrived; iterate its body chunk by chunk."""

    def __init__(
        self,
        node_id: str,
        response: aiohttp.ClientResponse,
        *,
        first_byte_deadline: float,
        read_timeout_s: float,
    ) -> None:
        self.node_id = node_id
        self._response = response
        self._first_byte_deadline = first_byte_deadline  # loop time
        self._read_timeout_s = read_timeout_s
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/octet-stream")

    async def _next(self) -> bytes:
        """The next chunk, ``b""`` at the end; silence allowed as the module docstring says."""
        left_s = self._first_byte_deadline - asyncio.get_running_loop().time()
        limit_s = max(self._read_timeout_s, left_s)
        try:
            async with asyncio.timeout(limit_s):
                return await self._response.content.readany()
        except TimeoutError:
            raise UpstreamUnavailable(
                f"node {self.node_id} sent nothing for {limit_s:.3g} s (read_timeout_s "
                f"{self._read_timeout_s:g} s, after first_byte_timeout_s)",
                node_id=self.node_id,
            ) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await self._next():
                yield chunk
        except _CONNECTION_ERRORS as exc:
            raise UpstreamUnavailable(
                f"node {self.node_id} broke the response stream: {_why(exc)}", node_id=self.node_id
            ) from exc

    async def read(self) -> bytes:
        parts: list[bytes] = []
        try:
            while chunk := await self._next():
                parts.append(chunk)
        except _CONNECTION_ERRORS as exc:
            raise UpstreamUnavailable(
                f"node {self.node_id} broke the response: {_why(exc)}", node_id=self.node_id
            ) from exc
        return b"".join(parts)


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
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False
            )
        return self._session

    async def close(self) -> None:
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

    @asynccontextmanager
    async def post(
        self, node_id: str, url: str, *, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[UpstreamResponse]:
        """POST and yield once the headers are in; error statuses raise ``UpstreamStatus``.

        Leaving the block early closes the connection, which makes vLLM abort the request.
        """
        deadline = asyncio.get_running_loop().time() + self._first_byte_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.session.post(url, data=body, headers=dict(headers))
        except aiohttp.ConnectionTimeoutError as exc:
            raise UpstreamUnavailable(
                f"node {node_id}: POST {url} could not connect within connect_timeout_s "
                f"{self._connect_timeout_s:g} s",
                node_id=node_id,
            ) from exc
        except TimeoutError as exc:
            raise UpstreamUnavailable(
                f"node {node_id}: POST {url} got no response headers within "
                f"first_byte_timeout_s {self._first_byte_timeout_s:g} s",
                node_id=node_id,
            ) from exc
        except _CONNECTION_ERRORS as exc:
            raise UpstreamUnavailable(
                f"node {node_id}: POST {url} failed: {_why(exc)}", node_id=node_id
            ) from exc
        try:
            if response.status >= 400:
                try:
                    payload = await response.read()
                except _CONNECTION_ERRORS:
                    payload = b""
                raise UpstreamStatus(
                    f"node {node_id} answered {response.status}",
                    node_id=node_id,
                    status=response.status,
                    body=payload,
                    content_type=response.headers.get("Content-Type", "application/json"),
                )
            yield UpstreamResponse(
                node_id,
                response,
                first_byte_deadline=deadline,
                read_timeout_s=self._read_timeout_s,
            )
        finally:
            if response.content.at_eof():
                response.release()  # fully read: the connection goes back to the pool
            else:
                response.close()  # abandoned mid-body: closing it makes the node abort
