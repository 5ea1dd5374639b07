"""Leader election on a real etcd: one leader, failover within the TTL, fenced writes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from controlplane.election import Election
from controlplane.errors import NotLeader, StoreUnavailable
from controlplane.store import Store
from controlplane.store.etcd import Fence
from meridian_service.clock import WallClock
from meridian_wire import keys
from tests.support import EtcdServer, cancel_all


async def _until(predicate: object, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_one_leader_then_a_follower_takes_over_and_the_old_one_is_fenced(
    etcd: EtcdServer,
) -> None:
    stores = [Store([etcd.url]), Store([etcd.url])]
    elections = [
        Election(store=s, identity=f"c{i}", ttl_s=2, clock=WallClock())
        for i, s in enumerate(stores)
    ]
    fences: dict[str, Fence] = {}

    def worker(name: str):  # type: ignore[no-untyped-def]
        async def work(fence: Fence) -> None:
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
        await stores[elections.index(first)].commit(probe, fence=old_fence)

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
        with pytest.raises(NotLeader):
            await stores[0].commit({keys.PREFIX + "probe": b"stale"}, fence=old_fence)
        got = await stores[0].get(keys.PREFIX + "probe")
        assert got is not None and got.value == b"1"
    finally:
        await cancel_all(tasks)
        for s in stores:
            await s.close()


async def test_store_fails_over_to_a_live_endpoint_and_reports_when_none_is(
    etcd: EtcdServer,
) -> None:
    dead = "http://127.0.0.1:1"
    store = Store([dead, etcd.url], timeout_s=1)
    try:
        await store.put(keys.PREFIX + "x", b"y")
        got = await store.get(keys.PREFIX + "x")
        assert got is not None and got.value == b"y"
        assert store.endpoint == etcd.url
    finally:
        await store.close()
    nowhere = Store([dead], timeout_s=1)
    try:
        with pytest.raises(StoreUnavailable, match="unreachable"):
            await nowhere.get(keys.PREFIX + "x")
    finally:
        await nowhere.close()


async def test_a_call_cancelled_by_another_caller_closing_the_channel_is_retried(
    etcd: EtcdServer,
) -> None:
    """The leader's keep-alive and its window pass share one store: when one call fails and
    closes the channel, gRPC cancels the other's call.  That must read as a failed call (and
    be retried), never as the caller's own cancellation, which ended the election for good."""
    store = Store([etcd.url])
    try:
        await store.put("/t/a", b"1")
        calls = [asyncio.create_task(store.get_prefix("/t/")) for _ in range(5)]
        await asyncio.sleep(0)  # the calls are in flight on the channel ...
        await store.close()  # ... which another caller closes
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, list) and len(r) == 1 for r in results), results
    finally:
        await store.close()


async def test_the_election_survives_leader_work_that_ends_cancelled(etcd: EtcdServer) -> None:
    store = Store([etcd.url])
    election = Election(store=store, identity="c0", ttl_s=2, clock=WallClock())
    runs: list[Fence] = []

    async def work(fence: Fence) -> None:
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
