"""meridian_service.hygiene's deadlines, in process: a kept-alive connection's requests set no
timer of their own, and the deadlines still close the connection on time, not before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from meridian_service import hygiene
from tests.support import free_port

HEADER_S = 0.4
KEEPALIVE_S = 0.6
LATE_S = 1.0  # two shared cores: a timer may fire late, never early


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def server() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/ok", _ok)
    limits = hygiene.ConnectionLimits(
        header_timeout_s=HEADER_S, body_timeout_s=HEADER_S, keepalive_timeout_s=KEEPALIVE_S
    )
    runner = hygiene.runner(app, limits, access_log=None)
    await runner.setup()
    port = free_port()
    site = hygiene.Site(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    assert await reader.readexactly(length) == b"ok"


async def _closed_after(reader: asyncio.StreamReader) -> float:
    start = time.monotonic()
    assert await asyncio.wait_for(reader.read(1), KEEPALIVE_S + LATE_S + 1) == b""
    return time.monotonic() - start


async def test_kept_alive_requests_set_no_timer_and_the_idle_deadline_still_closes(
    server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    timers: list[float] = []
    set_timer = hygiene._Connection._set_timer

    def counting(self: hygiene._Connection, now: float, deadline: float) -> None:
        timers.append(now)
        set_timer(self, now, deadline)

    monkeypatch.setattr(hygiene._Connection, "_set_timer", counting)
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    try:
        start = time.monotonic()
        for _ in range(50):
            await _get(reader, writer)
        took = time.monotonic() - start
        # the connection's first deadline, and one more each HEADER_S (the shortest timeout)
        # at most: not one for each phase of each request (idle, headers, idle: 100 here)
        assert len(timers) <= 2 + took / HEADER_S, (len(timers), took)
        # idle: closed KEEPALIVE_S after the last response, not before (the timer set for the
        # shortest timeout fires first and is set again for the deadline)
        idle = await _closed_after(reader)
        assert KEEPALIVE_S - 0.01 <= idle <= KEEPALIVE_S + LATE_S, idle
    finally:
        writer.close()


async def test_headers_that_stop_half_way_are_cut_at_the_header_deadline(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    try:
        await _get(reader, writer)  # a kept-alive connection: the idle timer is the one set
        await asyncio.sleep(KEEPALIVE_S / 2)
        writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n")  # and never the blank line
        start = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), HEADER_S + LATE_S + 1)
        took = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert HEADER_S - 0.01 <= took <= HEADER_S + LATE_S, took
    finally:
        writer.close()
