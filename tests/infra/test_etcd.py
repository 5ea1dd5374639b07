"""Smoke test of the etcd fixture through aetcd: keys, and leases kept alive or revoked."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aetcd
import pytest

from tests.support import EtcdServer

TTL_S = 2  # etcd's floor is 1.5 x the election timeout (1 s by default), rounded up


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[aetcd.Client]:
    async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=5) as client:
        yield client


async def test_put_and_get(client: aetcd.Client) -> None:
    await client.put(b"/meridian/v1/smoke", b"hello")

    got = await client.get(b"/meridian/v1/smoke")

    assert got is not None
    assert got.value == b"hello"


async def test_keyspace_is_empty_for_each_test(client: aetcd.Client) -> None:
    assert await client.get(b"/meridian/v1/smoke") is None


async def test_fresh_etcd_is_a_server_of_its_own(
    client: aetcd.Client, fresh_etcd: EtcdServer, etcd: EtcdServer
) -> None:
    await client.put(b"/meridian/v1/shared", b"x")

    async with aetcd.Client(host=fresh_etcd.host, port=fresh_etcd.port, timeout=5) as fresh:
        assert fresh_etcd.port != etcd.port
        assert await fresh.get(b"/meridian/v1/shared") is None


async def test_lease_kept_alive_outlives_its_ttl_and_revoke_deletes_its_key(
    client: aetcd.Client,
) -> None:
    kept = await client.lease(TTL_S)
    left = await client.lease(TTL_S)
    assert kept.ttl == TTL_S
    await client.put(b"/meridian/v1/regions/kept/alive", b"", lease=kept)
    await client.put(b"/meridian/v1/regions/left/alive", b"", lease=left)
    granted_at = time.monotonic()

    async def keep_alive() -> None:
        while True:
            await kept.refresh()
            await asyncio.sleep(TTL_S / 4)

    refresher = asyncio.create_task(keep_alive())
    try:
        # The lease nobody refreshes expires; the refreshed one, granted at the same time,
        # must still be there afterwards.
        while await client.get(b"/meridian/v1/regions/left/alive") is not None:
            assert time.monotonic() - granted_at < 10 * TTL_S, "unrefreshed lease never expired"
            await asyncio.sleep(0.1)
        assert time.monotonic() - granted_at >= TTL_S - 0.5
        await asyncio.sleep(TTL_S / 2)
        assert time.monotonic() - granted_at > TTL_S
        assert await client.get(b"/meridian/v1/regions/kept/alive") is not None
        assert await kept.remaining_ttl() > 0
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher

    await kept.revoke()

    assert await client.get(b"/meridian/v1/regions/kept/alive") is None
    assert await kept.remaining_ttl() == -1
