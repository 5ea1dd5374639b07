"""Serving an aiohttp application until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

from aiohttp import web

from meridian_service import hygiene

DEFAULT_LIMITS = hygiene.ConnectionLimits()


async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    handler_cancellation: bool = False,
    limits: hygiene.ConnectionLimits = DEFAULT_LIMITS,
    label: str = "server",
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then clean up; ``on_ready(port)`` once bound.

    Every connection gets ``limits`` (:mod:`meridian_service.hygiene`: read timeouts,
    keep-alive, the per-address cap); ``label`` is their settings group, for log lines.
    Signal handlers are installed before ``READY http://host:port`` is printed, so a supervisor
    that signals right after reading the line never kills the process uncleanly.
    """
    runner = hygiene.runner(
        app, limits, label=label, handler_cancellation=handler_cancellation, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        bound = int(sockets[0].getsockname()[1]) if sockets else port
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(bound)
        print(f"READY http://{host}:{bound}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
