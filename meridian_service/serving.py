"""Serving an aiohttp application until SIGINT or SIGTERM; SIGHUP reloads TLS certificates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from meridian_service import hygiene
from meridian_service import tls as tls_module

DEFAULT_LIMITS = hygiene.ConnectionLimits()

log = logging.getLogger(__name__)


async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    handler_cancellation: bool = False,
    limits: hygiene.ConnectionLimits = DEFAULT_LIMITS,
    label: str = "server",
    tls: tls_module.ServerTls | None = None,
    on_ready: Callable[[int], None] | None = None,
    reuse_port: bool = False,
    unix_path: str | None = None,
    announce: bool = True,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then clean up; ``on_ready(port)`` once bound.

    Every connection gets ``limits`` (:mod:`meridian_service.hygiene`: read timeouts,
    keep-alive, the per-address cap); ``label`` is their settings group, for log lines.  With
    ``tls`` the site serves HTTPS, and SIGHUP reloads its certificate and key
    (:mod:`meridian_service.tls`), as it does every other :class:`~meridian_service.tls.ServerTls`
    the app started (the controller's admin port).
    Signal handlers are installed before ``READY http(s)://host:port`` is printed, so a
    supervisor that signals right after reading the line never kills the process uncleanly.

    For one of several processes serving a port (``regional_agent.workers``): ``reuse_port``
    binds with SO_REUSEPORT, ``unix_path`` serves the app on that Unix socket too (plain HTTP,
    the same limits), and ``announce=False`` leaves the READY line to the supervisor.
    """
    runner = hygiene.runner(
        app, limits, label=label, handler_cancellation=handler_cancellation, access_log=None
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    hup = False
    try:
        site = hygiene.site(
            runner, host, port, ssl_context=tls.context if tls else None, reuse_port=reuse_port
        )
        await site.start()
        bound = site.bound_port
        if unix_path is not None:
            await web.UnixSite(runner, unix_path).start()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        if tls is not None or tls_module.live():  # this site's, or one the app started
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(signal.SIGHUP, _reload)
                hup = True
        if on_ready is not None:
            on_ready(bound)
        if announce:
            scheme = "https" if tls is not None else "http"
            print(f"READY {scheme}://{host}:{bound}", flush=True)
        await stop.wait()
    finally:
        if hup:
            loop.remove_signal_handler(signal.SIGHUP)
        await runner.cleanup()


def _reload() -> None:
    log.info("SIGHUP: reloading TLS certificates")
    tls_module.reload_all()
