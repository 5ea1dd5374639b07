"""Helpers for the publisher and autoscaler tests: a test's own etcd client, region settings
with fast loops, and polling with a generous deadline (never a timed assertion)."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aetcd

from meridian_wire import keys
from meridian_wire.models import RegionStatus
from tests.support import EtcdServer

T = TypeVar("T")
REGION = "eu-west"


def region(etcd: EtcdServer, **overrides: Any) -> dict[str, Any]:
    """``region`` settings for ``start_agent``: fast lease, heartbeat and debounce."""
    return {
        "id": REGION,
        "geo": "eu",
        "residency": ["eu", "gdpr"],
        "endpoints": ["https://eu-west.llm.example.com"],
        "etcd": [etcd.url],
        "lease_ttl_s": 2,
        "window_s": 2.0,
        "min_interval_s": 0.2,
        "load_min_interval_s": 0.5,
        "retry_base_s": 0.1,
        "retry_max_s": 0.5,
        "etcd_timeout_s": 1.0,
        **overrides,
    }


@asynccontextmanager
async def client(etcd: EtcdServer) -> AsyncIterator[aetcd.Client]:
    c = aetcd.Client(host=etcd.host, port=etcd.port, timeout=5)
    try:
        yield c
    finally:
        await c.close()


async def eventually(
    check: Callable[[], Awaitable[T | None] | T | None], *, what: str, timeout_s: float = 30.0
) -> T:
    """Poll ``check`` (sync or async) until it returns something other than ``None`` or
    ``False``; fail with ``what`` after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value is not None and value is not False:
            return value  # type: ignore[return-value]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.05)


async def agent_key(
    c: aetcd.Client, leaf: str, region_id: str = REGION, agent: str | None = None
) -> Any:
    """The ``alive`` or ``status`` key of ``agent`` in the region; with ``agent`` None, of the
    region's only agent (a test that runs one)."""
    if agent is not None:
        key = (
            keys.agent_alive(region_id, agent)
            if leaf == "alive"
            else keys.agent_status(region_id, agent)
        )
        return await c.get(key.encode())
    found = [
        kv
        for kv in await c.get_prefix(keys.agents(region_id).encode())
        if bytes(kv.key).decode().endswith("/" + leaf)
    ]
    assert len(found) <= 1, f"more than one agent of {region_id} has a {leaf} key"
    return found[0] if found else None


async def status(
    c: aetcd.Client, region_id: str = REGION, agent: str | None = None
) -> tuple[RegionStatus, int] | None:
    """The agent's status and its version (writes since created), or ``None``."""
    got = await agent_key(c, "status", region_id, agent)
    if got is None:
        return None
    return RegionStatus.model_validate_json(got.value), int(got.version)


async def alive(c: aetcd.Client, region_id: str = REGION, agent: str | None = None) -> int | None:
    """The lease id the agent's alive key is under, or ``None`` when the key is absent."""
    got = await agent_key(c, "alive", region_id, agent)
    return None if got is None else int(got.lease)


async def put_desired(
    c: aetcd.Client, value: dict[str, Any] | bytes, region_id: str = REGION
) -> None:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    await c.put(keys.desired(region_id).encode(), raw)
