"""The event loop a Meridian server runs on: uvloop where it is installed, else asyncio's own.

uvloop (libuv under asyncio's API) is a dependency on Linux and macOS.  It cut the agent's CPU
per request by a few per cent in the saturated benchmark (docs/benchmarks.md, "Router CPU per
request"); ``server.event_loop = "asyncio"`` keeps the standard loop, for a platform without
uvloop or to rule it out when debugging.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

log = logging.getLogger(__name__)

EventLoop = Literal["uvloop", "asyncio"]
T = TypeVar("T")


def factory(choice: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory when ``choice`` is uvloop and it imports; ``None`` for asyncio's."""
    if choice != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        log.info("uvloop is not installed: running on asyncio's own event loop")
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, choice: EventLoop = "uvloop") -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names (see :func:`factory`)."""
    with asyncio.Runner(loop_factory=factory(choice)) as runner:
        return runner.run(main)


def running() -> str:
    """The running loop's kind, for the start line: ``uvloop`` or ``asyncio``."""
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )
