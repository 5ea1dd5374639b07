"""Group routing tables shared by agent replicas through real etcd (docs/group-tables.md).

Two in-process agents of one region route through simulated nodes with ``routing.policy =
"groups"``; the protocol pieces (revision-guarded publishing, retry on a failed compare) are also
driven directly through ``TableSync`` on a real etcd, where the interleaving can be forced.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from typing import Any

import aiohttp

import meridian_etcd
from meridian_service.clock import MonotonicClock
from meridian_wire import keys
from meridian_wire.models import GroupTable
from policies import groups
from policies.group_routing import GroupPolicy
from policies.groups import GroupId
from policies.model import NodeId
from regional_agent.group_routing import GroupTables, TableSync
from regional_agent.retry import Backoff
from regional_agent.settings import GroupTableSettings
from tests.agent import publishing
from tests.agent.publishing import REGION, eventually, region
from tests.conftest import NodeFactory
from tests.support import EtcdServer
from tests.support.agent import ADMIN, AgentFactory, AgentHandle, admin_nodes
from tests.support.etcd import client as etcd_client

MODEL = "tiny-model"
FAST_TABLES = {"debounce_s": 0.2}


def _policy(handle: AgentHandle) -> GroupPolicy:
    policy = handle.edge.dispatcher.policy
    assert isinstance(policy, GroupPolicy)
    return policy


def _session_in(tables: GroupTables, group: str, *, avoid: str | None = None) -> tuple[str, int]:
    """A session id whose bucket the base table gives to ``group``."""
    for i in range(10_000):
        session = f"conv-{i}"
        bucket = groups.bucket_of(groups.session_key(session), n_buckets=tables.settings.n_buckets)
        if tables.base("session").lookup(bucket) == group:
            return session, bucket
    raise AssertionError(f"no session lands in {group}")


async def _chat(url: str, session: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-ID": session}) as r,
    ):
        assert r.status == 200, await r.text()


async def _two_agents(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> tuple[list[str], AgentHandle, AgentHandle]:
    urls = [await sim_node(profile_name="cpu-tiny", seed=i) for i in range(2)]
    handles = []
    for agent_id in ("a1", "a2"):
        handles.append(
            await start_agent(
                urls,
                policy="groups",
                region=region(etcd, agent_id=agent_id),
                group_tables=FAST_TABLES,
            )
        )
    return urls, handles[0], handles[1]


async def test_a_move_by_one_agent_is_followed_by_the_other(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls, a1, a2 = await _two_agents(etcd, sim_node, start_agent)
    t1, t2 = _policy(a1).tables, _policy(a2).tables
    assert t1.weights == t2.weights and len(t1.weights) == 2  # each node its own group
    assert t1.table("session") == t2.table("session")  # the same assignment, nothing read
    home = next(iter(t1.weights))
    other = next(g for g in t1.weights if g != home)
    session, bucket = _session_in(t1, home)
    # both agents send the session home
    await _chat(a1.url, session)
    await _chat(a2.url, session)
    # a1 moves the bucket (what groups.choose does when home is far busier)
    t1.move("session", bucket, GroupId(other))
    async with publishing.client(etcd) as c:

        async def stored() -> list[Any] | None:
            return list(await c.get_prefix(keys.groups(REGION).encode())) or None

        kvs: list[Any] = await eventually(stored, what="a1's move in etcd", timeout_s=10)
        lease = a1.publisher.lease if a1.publisher else None
        assert lease is not None
        values = [GroupTable.model_validate_json(kv.value) for kv in kvs]
        assert {v.agent for v in values} == {"a1"}
        assert all(int(kv.lease) == lease.id for kv in kvs)  # under a1's lease
        moved = [v for v in values if v.first <= bucket < v.end]
        assert [v.owner for v in moved] == [other]
    # a2 sees it through its watch, within the debounce window plus the watch
    await eventually(
        lambda: t2.table("session").lookup(bucket) == other, what="a2 following the move"
    )
    assert t2.table("session") == t1.table("session")
    # and routes the session to the new group
    await _chat(a2.url, session)
    nodes = await admin_nodes(a2.url, ADMIN)
    decisions = [d for n in nodes.values() if n["group"] == other for d in n["recent_decisions"]]
    assert any(f"bucket {bucket} -> {other} (table: home)" in d for d in decisions), decisions
    assert urls  # both nodes served


class _Replica:
    """One agent's table state and its TableSync on a real etcd, without the rest of the agent:
    the interleavings the tests need can be forced."""

    def __init__(self, etcd: EtcdServer, name: str, nodes: dict[NodeId, GroupId]) -> None:
        self.store = etcd_client(etcd.url, timeout_s=2.0)
        self.tables = GroupTables(
            GroupTableSettings(debounce_s=0.0),
            membership=lambda: {n: (g, 1.0) for n, g in nodes.items()},
        )
        self.lease: meridian_etcd.Lease | None = None
        rng = random.Random(0)
        self.sync = TableSync(
            store=self.store,
            tables=self.tables,
            region=REGION,
            agent_id=name,
            clock=MonotonicClock(),
            wall=time.time,
            lease=lambda: self.lease,
            backoff=lambda: Backoff(base_s=0.05, max_s=0.2, rng=rng),
            on_answer=lambda: None,
            on_failure=lambda exc: None,
        )
        self.watch: asyncio.Task[None] | None = None

    async def start(self, *, ttl_s: int = 30, watch: bool = True) -> None:
        self.lease = await self.store.grant(ttl_s=ttl_s)
        await self.sync.read()
        if watch:
            self.watch = asyncio.create_task(self.sync.watch_loop())

    async def close(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watch
        await self.store.close()


NODES = {NodeId(f"n{i}"): GroupId(f"g{i // 2}") for i in range(8)}  # 4 groups of 2 GPUs


async def test_a_dead_agents_entries_expire_with_its_lease(etcd: EtcdServer) -> None:
    dead, survivor = _Replica(etcd, "a1", NODES), _Replica(etcd, "a2", NODES)
    try:
        await dead.start(ttl_s=2, watch=False)  # never refreshed: as if killed
        await survivor.start()
        base = survivor.tables.base("prefix")
        bucket = 1234
        home = base.lookup(bucket)
        other = GroupId(next(g for g in dead.tables.weights if g != home))
        dead.tables.move("prefix", bucket, other)
        assert await dead.sync.flush(now=time.monotonic()) == 1
        await eventually(
            lambda: survivor.tables.table("prefix").lookup(bucket) == other,
            what="the survivor following the move",
        )
        # the dead agent's lease runs out: its ranges go, their buckets read as the assignment
        await eventually(
            lambda: survivor.tables.table("prefix") == base,
            what="the dead agent's entries expired",
            timeout_s=15,
        )
        async with publishing.client(etcd) as c:
            assert len(await c.get_prefix(keys.groups(REGION).encode())) == 0
    finally:
        await dead.close()
        await survivor.close()


async def test_a_conflicting_concurrent_write_is_retried_not_lost(etcd: EtcdServer) -> None:
    a, b = _Replica(etcd, "a1", NODES), _Replica(etcd, "a2", NODES)
    try:
        await a.start(watch=False)
        await b.start(watch=False)
        base = a.tables.base("prefix")
        # two buckets of one range: both moves touch that range's key
        span = max(base.ranges, key=lambda r: r.size)
        x, y = span.first + 10, span.first + 20
        to_x = GroupId(next(g for g in a.tables.weights if g != span.owner))
        to_y = GroupId(next(g for g in a.tables.weights if g not in (span.owner, to_x)))
        a.tables.move("prefix", x, to_x)
        b.tables.move("prefix", y, to_y)  # b has not seen a's move: it will conflict
        now = time.monotonic()
        assert await a.sync.flush(now=now) == 1
        assert await b.sync.flush(now=now) == 1
        assert (a.sync.conflicts, b.sync.conflicts) == (0, 1)
        # b read again, redid its move on the fresh table and wrote it: both moves are in etcd
        reader = _Replica(etcd, "reader", NODES)
        try:
            await reader.start(watch=False)
            table = reader.tables.table("prefix")
        finally:
            await reader.close()
        assert table.lookup(x) == to_x and table.lookup(y) == to_y
        assert b.tables.table("prefix") == table
        # the stored ranges never overlap
        async with publishing.client(etcd) as c:
            stored = [
                GroupTable.model_validate_json(kv.value)
                for kv in await c.get_prefix(keys.groups(REGION).encode())
            ]
        spans = sorted((v.first, v.end) for v in stored)
        assert all(e1 <= f2 for (_, e1), (f2, _) in itertools.pairwise(spans))
        assert {v.agent for v in stored} == {"a1", "a2"}
    finally:
        await a.close()
        await b.close()


async def test_malformed_and_foreign_entries_are_ignored_by_the_agent(etcd: EtcdServer) -> None:
    r = _Replica(etcd, "a1", NODES)
    try:
        async with publishing.client(etcd) as c:
            good = GroupTable(region=REGION, kind="prefix", first=100, end=101, owner="g3",
                              updated_at=1.0)  # fmt: skip
            unknown = good.model_copy(update={"first": 200, "end": 201, "owner": "us-east-g0"})
            await c.put(keys.group(REGION, "prefix", 100).encode(), good.model_dump_json().encode())
            await c.put(
                keys.group(REGION, "prefix", 200).encode(), unknown.model_dump_json().encode()
            )
            await c.put(keys.group(REGION, "prefix", 300).encode(), b"{not json")
        await r.start(watch=False)
        table = r.tables.table("prefix")
        assert table.lookup(100) == "g3"
        base = r.tables.base("prefix")
        assert table.lookup(200) == base.lookup(200) and table.lookup(300) == base.lookup(300)
        assert r.sync.bad == 2
        # a move over the malformed key compares against its revision and replaces it
        r.tables.move("prefix", 300, GroupId("g0" if base.lookup(300) != "g0" else "g1"))
        assert await r.sync.flush(now=time.monotonic()) == 1
    finally:
        await r.close()


async def test_own_ranges_come_back_under_a_new_lease_after_the_old_one_is_lost(
    etcd: EtcdServer,
) -> None:
    r = _Replica(etcd, "a1", NODES)
    flush: asyncio.Task[None] | None = None
    try:
        await r.start()
        flush = asyncio.create_task(r.sync.flush_loop())
        base = r.tables.base("prefix")
        bucket = 1234
        other = GroupId(next(g for g in r.tables.weights if g != base.lookup(bucket)))
        r.tables.move("prefix", bucket, other)

        async def stored() -> dict[int, tuple[GroupTable, int]]:
            async with publishing.client(etcd) as c:
                kvs = await c.get_prefix(keys.groups(REGION).encode())
            out = {}
            for kv in kvs:
                v = GroupTable.model_validate_json(kv.value)
                out[v.first] = (v, kv.lease)
            return out

        async def wait_stored(lease: meridian_etcd.Lease) -> dict[int, tuple[GroupTable, int]]:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                got = await stored()
                if any(v.first <= bucket < v.end and v.owner == other and held == lease.id
                       for v, held in got.values()):  # fmt: skip
                    return got
                await asyncio.sleep(0.05)
            raise AssertionError(f"the move is not in etcd under lease {lease.id:x}: {got}")

        old = r.lease
        assert old is not None
        before = await wait_stored(old)
        # the lease is lost (revoked: its keys go at once), the agent is granted a new one
        await r.store.revoke(old)
        r.lease = await r.store.grant(ttl_s=30)
        await wait_stored(r.lease)  # put back, under the new lease
        reader = _Replica(etcd, "reader", NODES)
        try:
            await reader.start(watch=False)
            table = reader.tables.table("prefix")  # what every agent routes by
        finally:
            await reader.close()
        assert table.lookup(bucket) == other and table == r.tables.table("prefix")
        assert table != base and len(before) >= 1 and r.sync.republished >= 1
    finally:
        if flush is not None:
            flush.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flush
        await r.close()


async def test_the_admin_policy_endpoints_list_and_switch_to_groups(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """``groups`` is one of the policies ``GET /admin/policy`` lists and ``PUT`` switches to when
    the agent keeps group tables; an agent without them says why it cannot switch (409)."""
    urls = [await sim_node(profile_name="cpu-tiny", seed=i) for i in range(2)]
    plain = await start_agent(urls, policy="meridian")
    grouped = await start_agent(
        urls, policy="groups", region=region(etcd, agent_id="a1"), group_tables=FAST_TABLES
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{plain.url}/admin/policy", headers=ADMIN) as r:
            body = await r.json()
        assert (
            "groups" not in body["available"] and "routing.policy" in body["unavailable"]["groups"]
        )
        async with s.put(
            f"{plain.url}/admin/policy", json={"policy": "groups"}, headers=ADMIN
        ) as r:
            assert r.status == 409
            error = (await r.json())["error"]
            assert 'routing.policy = "groups"' in error["message"] and error["param"] == "policy"
        assert plain.edge.dispatcher.policy.name == "meridian"  # nothing changed

        async with s.get(f"{grouped.url}/admin/policy", headers=ADMIN) as r:
            body = await r.json()
        assert body["policy"] == "groups" and "groups" in body["available"]
        tables = _policy(grouped).tables
        for name in ("prefix_aware", "groups"):
            async with s.put(
                f"{grouped.url}/admin/policy", json={"policy": name}, headers=ADMIN
            ) as r:
                assert r.status == 200 and (await r.json())["policy"] == name
        assert _policy(grouped).tables is tables  # back on the same tables, still synced
        await _chat(grouped.url, "conv-admin")
