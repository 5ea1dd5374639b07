"""The etcd layer (``meridian_etcd``) against a real etcd: keys, transactions guarded by
revisions or fenced, leases, watches, member failover, and how each failure is reported."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

import meridian_etcd
from meridian_etcd import Deleted, Entry, Snapshot
from tests.support import EtcdServer
from tests.support.etcd import client as etcd_client

DEAD = "http://127.0.0.1:1"  # nothing listens on port 1


async def test_keys_round_trip_with_revisions(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    try:
        first = await store.put("/t/a", b"1")
        second = await store.put("/t/a", b"2")
        assert second > first
        got = await store.get("/t/a")
        assert got is not None
        assert (got.value, got.mod_revision, got.version, got.lease) == (b"2", second, 2, 0)
        assert got.create_revision == first
        assert await store.get("/t/missing") is None
        await store.put("/t/b", b"3")
        snapshot = await store.get_prefix("/t/")
        assert [e.key for e in snapshot.entries] == ["/t/a", "/t/b"]
        assert snapshot.revision >= second
        await store.delete("/t/a")
        assert await store.get("/t/a") is None
    finally:
        await store.close()


async def test_commit_with_expect_writes_only_at_the_expected_revisions(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    try:
        made = await store.commit(puts=[("/t/a", b"1")], expect={"/t/a": 0})  # must be absent
        assert made is not None
        assert await store.commit(puts=[("/t/a", b"2")], expect={"/t/a": 0}) is None
        got = await store.get("/t/a")
        assert got is not None and got.value == b"1"
        again = await store.commit(puts=[("/t/a", b"3")], deletes=[], expect={"/t/a": made})
        assert again is not None and again > made
        with pytest.raises(ValueError, match="not both"):
            fence = meridian_etcd.Fence(key="/t/l", value=b"x", create_revision=1)
            await store.commit(puts={"/t/a": b"4"}, expect={"/t/a": again}, fence=fence)
    finally:
        await store.close()


async def test_a_fenced_commit_lands_only_while_the_fence_key_is_the_one_held(
    etcd: EtcdServer,
) -> None:
    store = etcd_client(etcd.url)
    try:
        lease = await store.grant(ttl_s=10)
        holder = await store.claim("/t/leader", b"me", lease=lease)
        assert holder is not None and holder.lease == lease.id
        fence = meridian_etcd.Fence(
            key="/t/leader", value=holder.value, create_revision=holder.create_revision
        )
        await store.commit(puts={"/t/plan": b"v1"}, fence=fence)
        # someone else is elected: the key is deleted and created again
        await store.delete("/t/leader")
        await store.put("/t/leader", b"other")
        with pytest.raises(meridian_etcd.Fenced, match="fenced off"):
            await store.commit(puts={"/t/plan": b"v2"}, deletes=["/t/x"], fence=fence)
        got = await store.get("/t/plan")
        assert got is not None and got.value == b"v1"
        # a claim does not take a key that is held
        again = await store.claim("/t/leader", b"me", lease=lease)
        assert again is not None and again.value == b"other"
    finally:
        await store.close()


async def test_more_than_one_transaction_holds_is_written_in_fenced_batches(
    etcd: EtcdServer,
) -> None:
    """etcd refuses a transaction of more than --max-txn-ops (128) operations; commit_batches
    writes 300 puts and 10 deletes in batches, the ``last`` keys in the final one."""
    store = etcd_client(etcd.url)
    try:
        with pytest.raises(meridian_etcd.Refused, match="too many operations"):
            await store.commit(puts={f"/b/{i:03d}": b"x" for i in range(129)})
        await store.commit(puts={f"/b/old-{i}": b"x" for i in range(10)})
        lease = await store.grant(ttl_s=10)
        holder = await store.claim("/b/leader", b"me", lease=lease)
        assert holder is not None
        fence = meridian_etcd.Fence(
            key="/b/leader", value=holder.value, create_revision=holder.create_revision
        )
        puts = [(f"/b/{i:03d}", str(i).encode()) for i in range(300)]
        batches = await store.commit_batches(
            puts=puts, deletes=[f"/b/old-{i}" for i in range(10)], fence=fence,
            last={"/b/plan": b"p"},
        )  # fmt: skip
        assert batches == 3  # 311 operations in transactions of at most 128
        got = {e.key: e for e in (await store.get_prefix("/b/")).entries}
        assert {f"/b/{i:03d}" for i in range(300)} <= set(got)
        assert not any(k.startswith("/b/old-") for k in got)
        plan = got["/b/plan"]
        assert plan.mod_revision == max(e.mod_revision for e in got.values())  # last of all
        assert len({got[k].mod_revision for k, _ in puts}) == 3  # each batch is one revision
        await store.delete("/b/leader")  # fenced off: nothing of the next batches lands
        with pytest.raises(meridian_etcd.Fenced):
            await store.commit_batches(puts=[("/b/late", b"x")], fence=fence)
        assert await store.get("/b/late") is None
        with pytest.raises(ValueError, match="cannot land in one transaction"):
            await store.commit_batches(last={f"/b/{i}": b"x" for i in range(129)})
    finally:
        await store.close()


async def test_leases_keep_keys_alive_and_a_lost_lease_says_so(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    try:
        lease = await store.grant(ttl_s=5)
        assert lease.ttl_s == 5
        await store.put("/t/alive", b"", lease=lease)
        assert await store.keep_alive(lease) == 5
        got = await store.get("/t/alive")
        assert got is not None and got.lease == lease.id
        await store.revoke(lease)
        assert await store.get("/t/alive") is None
        with pytest.raises(meridian_etcd.LeaseLost, match="no longer knows"):
            await store.keep_alive(lease)
        # a write under a lease etcd does not know: etcd's NOT_FOUND, by its message
        with pytest.raises(meridian_etcd.LeaseLost, match="lease not found"):
            await store.put("/t/alive", b"", lease=lease)
    finally:
        await store.close()


async def test_a_request_etcd_refuses_is_refused_not_unavailable(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    try:
        with pytest.raises(meridian_etcd.Refused, match="key is not provided") as refused:
            await store.put("", b"x")  # INVALID_ARGUMENT
        assert not refused.value.retryable
        await store.put("/t/still-fine", b"1")  # the client was not dropped for it
        assert store.endpoint == etcd.url
    finally:
        await store.close()


async def test_follow_reports_the_value_now_then_each_change(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    await store.put("/t/desired", b"a")
    seen: list[bytes | None] = []
    try:
        async with contextlib.aclosing(store.follow("/t/desired")) as changes:
            async for change in changes:
                seen.append(change.value)
                if len(seen) == 1:
                    await store.put("/t/desired", b"b")
                elif len(seen) == 2:
                    await store.delete("/t/desired")
                else:
                    break
        assert seen == [b"a", b"b", None]
    finally:
        await store.close()


async def test_follow_prefix_gives_a_snapshot_then_puts_and_deletes(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    await store.put("/t/p/1", b"one")
    items: list[Snapshot | Entry | Deleted] = []
    try:
        async with contextlib.aclosing(store.follow_prefix("/t/p/")) as changes:
            async for item in changes:
                items.append(item)
                if len(items) == 1:
                    await store.put("/t/p/2", b"two")
                elif len(items) == 2:
                    await store.delete("/t/p/1")
                else:
                    break
        snapshot, put, deleted = items
        assert isinstance(snapshot, Snapshot) and [e.value for e in snapshot.entries] == [b"one"]
        assert isinstance(put, Entry) and (put.key, put.value) == ("/t/p/2", b"two")
        assert isinstance(deleted, Deleted) and deleted.key == "/t/p/1"
        assert deleted.mod_revision > put.mod_revision
    finally:
        await store.close()


async def test_a_watch_whose_member_dies_ends_with_unavailable(fresh_etcd: EtcdServer) -> None:
    store = etcd_client(fresh_etcd.url, timeout_s=1.0)
    try:
        with pytest.raises(meridian_etcd.Unavailable):
            async with contextlib.aclosing(store.follow_prefix("/t/")) as changes:
                async for _ in changes:
                    fresh_etcd.process.kill()
    finally:
        await store.close()


async def test_a_call_fails_over_to_a_live_member_and_names_them_all_when_none_is(
    etcd: EtcdServer,
) -> None:
    store = etcd_client(DEAD, etcd.url, timeout_s=1)
    try:
        await store.put("/t/x", b"y")  # the dead member is tried, then the live one
        got = await store.get("/t/x")
        assert got is not None and got.value == b"y"
        assert store.endpoint == etcd.url
    finally:
        await store.close()
    nowhere = etcd_client(DEAD, "http://127.0.0.1:2", timeout_s=1)
    try:
        with pytest.raises(meridian_etcd.Unavailable, match="unreachable") as caught:
            await nowhere.get("/t/x")
        assert DEAD in caught.value.message and "127.0.0.1:2" in caught.value.message
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, BaseException)  # raised from the foreign one
    finally:
        await nowhere.close()


async def test_a_call_cancelled_by_another_caller_dropping_the_channel_is_retried(
    etcd: EtcdServer,
) -> None:
    """The controller's keep-alive and its window pass share one client: when one call fails
    and drops the channel, gRPC cancels the other's call.  That must read as a failed call (and
    be retried on the fresh channel), never as the caller's own cancellation, which ended the
    election for good."""
    store = etcd_client(etcd.url)
    try:
        await store.put("/t/a", b"1")
        calls = [asyncio.create_task(store.get_prefix("/t/")) for _ in range(5)]
        await asyncio.sleep(0)  # the calls are in flight on the channel ...
        # ... which a failing call drops, as _translate does for an unavailable member
        await store._drop(store._generation, reason="a concurrent call failed")
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, Snapshot) and len(r.entries) == 1 for r in results), results
    finally:
        await store.close()


async def test_our_own_cancellation_propagates_as_it_is(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    try:
        call = asyncio.create_task(store.get_prefix("/t/"))
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        await store.close()


async def test_a_cancel_that_grpc_turns_into_the_calls_error_still_cancels(
    etcd: EtcdServer,
) -> None:
    """gRPC's unary call catches the cancel of the task awaiting it and ends with the call's
    status instead (``grpc.aio._call.UnaryUnaryCall._invoke``): when that status is an error,
    the task sees an ``AioRpcError`` and its cancellation is spent.  The layer must still
    cancel: read as Unavailable, a loop that retries on it never ended (a controller's and an
    agent's shutdown hung on etcd being down, 2 of 20 tries against a dead member)."""
    store = etcd_client(etcd.url)
    metadata = grpc.aio.Metadata()

    async def op(_: object) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # what gRPC does with it
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, metadata, metadata, "failed to connect"
            ) from None

    try:
        call = asyncio.create_task(store._call("put /t/a", op))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await store.get("/t/a") is None  # and the client still works
    finally:
        await store.close()


async def test_a_closed_client_refuses_calls(etcd: EtcdServer) -> None:
    store = etcd_client(etcd.url)
    await store.put("/t/a", b"1")
    await store.close()
    with pytest.raises(meridian_etcd.Unavailable, match="closed"):
        await store.get("/t/a")


def test_client_config_rejects_what_it_cannot_dial() -> None:
    with pytest.raises(ValueError, match="at least one etcd endpoint"):
        meridian_etcd.ClientConfig(endpoints=[])
    with pytest.raises(ValueError, match="is https:// but TLS to etcd is not set up: set ca_file"):
        meridian_etcd.ClientConfig(endpoints=["https://10.0.0.1:2379"])
    with pytest.raises(ValueError, match="plaintext http:// but ca_file is set"):
        meridian_etcd.ClientConfig(endpoints=["http://10.0.0.1:2379"], ca_file="/ca.pem")
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        meridian_etcd.ClientConfig(
            endpoints=["https://10.0.0.1:2379"], ca_file="/ca.pem", cert_file="/c.pem"
        )
    with pytest.raises(ValueError, match="user is set but password_file is not"):
        meridian_etcd.ClientConfig(endpoints=["http://10.0.0.1:2379"], user="agent-eu-west")
    secret = meridian_etcd.ClientConfig(
        endpoints=["http://10.0.0.1:2379"], user="u", password="hunter2"
    )
    assert "hunter2" not in repr(secret)
    with pytest.raises(ValueError, match="timeout_s"):
        meridian_etcd.ClientConfig(endpoints=["http://10.0.0.1:2379"], timeout_s=0)
