"""Process plumbing shared by Meridian's servers: settings loading and serving until a signal.

``regional_agent``, ``controlplane`` and ``simulator`` may import this package; it imports none
of ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pydantic
from aiohttp import web
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

S = TypeVar("S", bound=BaseSettings)


def load_settings(
    cls: type[S], *, config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> S:
    """Settings from ``overrides`` (flags) > environment > ``config_file`` (TOML) > defaults."""
    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")

    class _Loaded(cls):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if config_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
            return tuple(sources)

    loaded: S = _Loaded(**(overrides or {}))
    return loaded


def explain(exc: pydantic.ValidationError) -> str:
    """A validation error as an operator reads it: one ``field.path: problem`` per line."""
    lines = [
        f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
    ]
    return "invalid settings:\n" + "\n".join(lines)


async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    handler_cancellation: bool = False,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then clean up; ``on_ready(port)`` once bound.

    Signal handlers are installed before ``READY http://host:port`` is printed, so a supervisor
    that signals right after reading the line never kills the process uncleanly.
    """
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
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
