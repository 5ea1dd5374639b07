"""Waiting in tests: poll a condition with a deadline, stop background tasks and wait for them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms; fail the test naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def cancel_all(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel every task, then wait for each to finish (its cancellation is not an error)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
