"""Waiting in tests: poll a condition with a deadline, a server process until a URL answers,
stop background tasks and wait for them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

import aiohttp

from tests.support.process import ServerProcess


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms; fail the test naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def answered(url: str, process: ServerProcess, what: str) -> str:
    """GET ``url`` every 0.1 s, for up to 30 s, until it answers 200; return the body.  Fail
    naming ``what`` (the server) when ``process`` exits first or the URL never answers."""
    for _ in range(300):
        if process.exit_code() is not None:
            raise process.failure(f"{what} exited")
        try:
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                if r.status == 200:
                    return await r.text()
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise process.failure(f"{what}: {url} did not answer 200")


async def cancel_all(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel every task, then wait for each to finish (its cancellation is not an error)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
