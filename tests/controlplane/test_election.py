"""Leader election on a real etcd: one leader, failover within the TTL, fenced writes."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

import meridian_etcd
from controlplane.election import Election
from meridian_service.clock import WallClock
from meridian_wire import keys
from tests.support import EtcdServer, cancel_all
from tests.support.etcd import client as etcd_client


async def _until(predicate: object, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_one_leader_then_a_follower_takes_over_and_the_old_one_is_fenced(
    etcd: EtcdServer,
) -> None:
    stores = [etcd_client(etcd.url), etcd_client(etcd.url)]
    elections = [
        Election(store=s, identity=f"c{i}", ttl_s=2, clock=WallClock())
        for i, s in enumerate(stores)
    ]
    fences: dict[str, meridian_etcd.Fence] = {}

    def worker(name: str):  # type: ignore[no-untyped-def]
        async def work(fence: meridian_etcd.Fence) -> None:
            fences[name] = fence
            await asyncio.Event().wait()

        return work

    tasks = [asyncio.create_task(e.run(worker(e.identity))) for e in elections]
    try:
        await _until(lambda: any(e.leading for e in elections), 5)
        await asyncio.sleep(0.5)
        leaders = [e for e in elections if e.leading]
        assert len(leaders) == 1
        first = leaders[0]
        other = next(e for e in elections if e is not first)
        old_fence = fences[first.identity]
        probe = {keys.PREFIX + "probe": b"1"}
        await stores[elections.index(first)].commit(puts=probe, fence=old_fence)

        # the leader's process dies: its keep-alives stop
        dead = tasks[elections.index(first)]
        dead.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dead
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await _until(lambda: other.leading, 6)
        assert loop.time() - t0 <= 2 + 1.5  # within the lease TTL (plus a poll)
        new_fence = fences[other.identity]
        assert new_fence.create_revision > old_fence.create_revision
        # a write carrying the old leader's fence does not land
        with pytest.raises(meridian_etcd.Fenced):
            await stores[0].commit(puts={keys.PREFIX + "probe": b"stale"}, fence=old_fence)
        got = await stores[0].get(keys.PREFIX + "probe")
        assert got is not None and got.value == b"1"
    finally:
        await cancel_all(tasks)
        for s in stores:
            await s.close()


async def test_the_election_survives_leader_work_that_ends_cancelled(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    election = Election(store=store, identity="c0", ttl_s=2, clock=WallClock())
    runs: list[meridian_etcd.Fence] = []

    async def work(fence: meridian_etcd.Fence) -> None:
        runs.append(fence)
        if len(runs) == 1:
            raise asyncio.CancelledError  # as a gRPC call cancelled under it would
        await asyncio.Event().wait()

    task = asyncio.create_task(election.run(work))
    try:
        await _until(lambda: len(runs) >= 2 and election.leading, 15)
        assert not task.done()
    finally:
        await cancel_all([task])
        await election.resign()
        await store.close()


async def test_unreachable_etcd_is_one_warning_naming_the_url_and_leading_is_info(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's typo in --etcd shows once, loudly, with the URL; a normal election is not a
    warning."""
    caplog.set_level(logging.DEBUG)
    dead = "http://127.0.0.1:1"
    nowhere = etcd_client(dead, timeout_s=0.5)
    election = Election(store=nowhere, identity="c0", ttl_s=2, clock=WallClock())
    task = asyncio.create_task(election.run(lambda fence: asyncio.Event().wait()))
    try:
        await _until(lambda: election.etcd_ok is False, 10)
        await asyncio.sleep(2.0)  # three more campaigns fail meanwhile
    finally:
        await cancel_all([task])
        await nowhere.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert dead in warnings[0].getMessage() and "unreachable" in warnings[0].getMessage()
    info = [r for r in caplog.records if r.levelno == logging.INFO and "etcd" in r.getMessage()]
    assert info == []  # no line per retry
    caplog.clear()
    store = etcd_client(etcd.url)
    election = Election(store=store, identity="c1", ttl_s=2, clock=WallClock())
    task = asyncio.create_task(election.run(lambda fence: asyncio.Event().wait()))
    try:
        await _until(lambda: election.leading, 10)
    finally:
        await cancel_all([task])
        await election.resign()
        await store.close()
    leading = [r for r in caplog.records if "election: leading" in r.getMessage()]
    assert [r.levelno for r in leading] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
