"""regional_agent.upstream.client's silence limits, against a real HTTP server on loopback that
streams on a script: one timer per response, moved by the reads, that cuts a node gone silent,
never a slow consumer, and never takes an outside cancel for its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import pytest
import uvloop
from aiohttp import web

from regional_agent.errors import UpstreamUnavailable
from regional_agent.upstream import client as upstream
from regional_agent.upstream.client import NodeClient, Timeouts

GAP_S = 0.25


async def _serve(script: Sequence[float | None]) -> tuple[web.AppRunner, str]:
    """A node that sends its headers, then for each entry of ``script`` sleeps that long and
    sends a chunk (``None``: sleeps for ever)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, pause in enumerate(script):
            if pause is None:
                await asyncio.sleep(3600)
            else:
                await asyncio.sleep(pause)
            await response.write(f"data: {i}\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/stream", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # the endless handlers are cancelled
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/stream"


async def _read(
    script: Sequence[float | None],
    *,
    first_byte_s: float = 2.0,
    consumer_pause_s: float = 0.0,
    on_chunk: Callable[[bytes], None] | None = None,
) -> list[bytes]:
    runner, url = await _serve(script)
    node = NodeClient(connect_timeout_s=2.0, first_byte_timeout_s=5.0, read_timeout_s=5.0)
    got: list[bytes] = []
    try:
        timeouts = Timeouts(first_byte_s=first_byte_s, gap_s=GAP_S)
        async with node.post("n1", url, body=b"{}", headers={}, timeouts=timeouts) as up:
            async for chunk in up.chunks():
                got.append(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
                if consumer_pause_s:
                    await asyncio.sleep(consumer_pause_s)
    finally:
        await node.close()
        await runner.cleanup()
    return got


@pytest.fixture
def timer_fires(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each response's timer fired."""
    fired: list[float] = []
    original = upstream.UpstreamResponse._on_timer

    def counting(self: upstream.UpstreamResponse) -> None:
        fired.append(time.monotonic())
        original(self)

    monkeypatch.setattr(upstream.UpstreamResponse, "_on_timer", counting)
    return fired


async def test_a_steady_stream_longer_than_many_gaps_is_read_whole_with_few_timer_fires(
    timer_fires: list[float],
) -> None:
    """40 chunks 0.05 s apart (2 s, eight gaps): none is cut, and the one timer fired about
    once a gap, not once a chunk."""
    got = await _read([0.05] * 40)
    assert b"".join(got).count(b"data: ") == 40
    assert len(timer_fires) <= 12, len(timer_fires)


async def test_a_node_silent_mid_stream_is_cut_after_the_gap(timer_fires: list[float]) -> None:
    seen: list[float] = []
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match=r"sent nothing for 0.25 s"):
        await _read([0.05] * 10 + [None], on_chunk=lambda _: seen.append(time.monotonic()))
    silent_for = time.monotonic() - seen[-1]
    assert GAP_S - 0.01 <= silent_for < GAP_S + 0.5, silent_for
    assert time.monotonic() - started < 5


async def test_a_first_byte_overdue_is_cut_at_the_first_byte_limit() -> None:
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match=r"sent no first byte within 0.6 s"):
        await _read([None], first_byte_s=0.6)
    assert 0.55 <= time.monotonic() - started < 2.0


async def test_a_first_byte_later_than_the_gap_is_not_cut_by_it() -> None:
    """The gap starts counting after the first bytes: a 0.5 s prefill under a 0.25 s gap."""
    got = await _read([0.5, 0.05, 0.05], first_byte_s=2.0)
    assert b"".join(got).count(b"data: ") == 3


async def test_a_slow_consumer_is_not_taken_for_a_silent_node() -> None:
    """The client side pauses 0.4 s, longer than the gap, between reads; the node's chunks wait
    in the buffer, and nothing is cut."""
    got = await _read([0.01] * 6, consumer_pause_s=0.4)
    assert b"".join(got).count(b"data: ") == 6


async def test_an_outside_cancel_during_a_wait_stays_a_cancel() -> None:
    reading = asyncio.ensure_future(_read([0.05, None]))
    await asyncio.sleep(0.3)  # in the endless wait, with the timer set
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


def test_on_uvloop_too_a_steady_stream_passes_and_a_silence_is_cut() -> None:
    """uvloop, the agent's default loop, keeps its timers in milliseconds: the same limits hold
    on it (a synchronous test: it runs its own loop)."""

    async def scenarios() -> None:
        got = await _read([0.05] * 20)
        assert b"".join(got).count(b"data: ") == 20
        seen: list[float] = []
        with pytest.raises(UpstreamUnavailable, match=r"sent nothing for 0.25 s"):
            await _read([0.05] * 4 + [None], on_chunk=lambda _: seen.append(time.monotonic()))
        assert GAP_S - 0.01 <= time.monotonic() - seen[-1] < GAP_S + 0.5

    uvloop.run(scenarios())
