"""A test about to hit pytest-timeout prints the stack of every pending asyncio task.

pytest-timeout's own traceback of an async test shows only the event loop idling in
``select``: the coroutine that waits forever is invisible.  A timer fires a few seconds before
the limit and writes each task's stack to stderr, which the failure report shows under
"Captured stderr call".
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator

import pytest

LEAD_S = 5.0  # how long before the limit the stacks are printed


def timeout_of(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    configured = item.config.getini("timeout")
    return float(configured) if configured else None


def dump_tasks() -> None:
    """Every pending task's name and stack (read from this thread while the loop's thread
    waits in ``select``: good enough for a post-mortem)."""
    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    print(f"\n--- watchdog: {len(tasks)} pending asyncio task(s) ---", file=sys.stderr)
    for task in tasks:
        print(f"task {task.get_name()}:", file=sys.stderr)
        try:
            task.print_stack(limit=30, file=sys.stderr)
        except Exception as exc:  # a frame changing under us: say so and go on
            print(f"  (stack unreadable: {exc!r})", file=sys.stderr)
    sys.stderr.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    limit = timeout_of(item)
    timer = None
    if limit is not None and limit > 2 * LEAD_S:
        timer = threading.Timer(limit - LEAD_S, dump_tasks)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
