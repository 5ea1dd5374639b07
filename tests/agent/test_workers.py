"""``workers.count`` above 1: the shared load table across real forked processes, the prefix
relay's wire format, and ``meridian-agent --workers 2`` as a real supervisor with real workers
in front of real ``meridian-sim`` processes (docs/agent.md, Workers)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import random
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from controlplane.reconcile.fleet import combine
from meridian_service.clock import MonotonicClock
from policies import routing
from policies.model import AdminState, NodeId, RequestView
from policies.model import Health as HealthState
from regional_agent import admin, request_ids
from regional_agent.nodes import Node, NodePool
from regional_agent.publisher.publisher import worker_agent_id
from regional_agent.queue import Dispatcher
from regional_agent.settings import NodeSettings, QueueSettings, Settings
from regional_agent.tenants import new_key
from regional_agent.workers import shared
from regional_agent.workers.runtime import IDLE_SHARE_S, Worker, WorkerRuntime
from regional_agent.workers.shared import RING, SCAN_EVERY_S, LoadShare, LoadTable
from regional_agent.workers.siblings import (
    MAX_HASHES,
    PrefixRelay,
    PrefixRings,
    decode,
    encode,
)
from tests.agent import publishing
from tests.agent.conftest import ADMIN, ADMIN_TOKEN, AgentFactory, SimProcess, stop_process
from tests.conftest import NodeFactory
from tests.support import EtcdServer
from tests.support.process import in_child

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the h100-llama3-8b profile's


# -- the shared load table, across a real fork ---------------------------------------------------


@pytest.fixture
def lock_file(tmp_path: Path) -> Path:
    return tmp_path / "slots.lock"


def test_a_forked_worker_s_counts_are_summed_and_seen_as_moved(lock_file: Path) -> None:
    table = LoadTable(workers=3, slots=64)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    me.write("http://a:8000", 2, 200, 50)
    assert me.totals("http://b:8000") == (0, 0, 0)
    assert me.moved() == set()

    def sibling() -> None:
        other = LoadShare(table, worker=1, lock_file=lock_file)
        other.write("http://a:8000", 3, 300, 0)
        other.write("http://b:8000", 1, 10, 10)

    in_child(sibling)
    assert me.totals("http://a:8000") == (5, 500, 50)
    assert me.totals("http://b:8000") == (1, 10, 10)
    assert me.moved() == {"http://a:8000", "http://b:8000"}
    assert me.moved() == set()  # read once

    table.clear_worker(1)  # the supervisor, after worker 1 died
    assert me.totals("http://a:8000") == (2, 200, 50)
    assert me.totals("http://b:8000") == (0, 0, 0)
    assert me.moved() == {"http://a:8000", "http://b:8000"}


def test_the_acting_worker_reads_every_worker_s_demand_and_arrivals_never_fall(
    lock_file: Path,
) -> None:
    """The autoscaler's queue and arrivals come from every worker; a worker that died keeps
    the arrivals of its earlier lives, and its queue goes with it."""
    table = LoadTable(workers=3, slots=8)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    me.post_demand(1, 10)

    def sibling(worker: int, queued: int, arrivals: int) -> Callable[[], None]:
        def work() -> None:
            LoadShare(table, worker=worker, lock_file=lock_file).post_demand(queued, arrivals)

        return work

    in_child(sibling(1, 4, 100))
    in_child(sibling(2, 0, 7))
    assert me.demand(2, 12) == (2 + 4 + 0, 12 + 100 + 7)  # its own as given: fresher

    table.clear_worker(1)  # the supervisor, after worker 1 died
    assert me.demand(2, 12) == (2 + 0 + 0, 12 + 100 + 7)
    in_child(sibling(1, 3, 5))  # its new life: 5 arrivals so far, after the 100 of its last
    assert me.demand(2, 12) == (2 + 3 + 0, 12 + 105 + 7)


def test_a_node_s_last_slot_goes_to_one_worker_only(lock_file: Path) -> None:
    table = LoadTable(workers=2, slots=16)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    assert me.reserve("http://a:8000", 2, 1, 100, 10)

    def sibling() -> None:
        other = LoadShare(table, worker=1, lock_file=lock_file)
        assert other.reserve("http://a:8000", 2, 1, 50, 0)  # the second of two slots
        assert not other.reserve("http://a:8000", 2, 2, 60, 0)  # none left: nothing written
        assert other.totals("http://a:8000") == (2, 150, 10)

    in_child(sibling)
    assert not me.reserve("http://a:8000", 2, 2, 200, 20)
    assert me.totals("http://a:8000") == (2, 150, 10)
    me.write("http://a:8000", 0, 0, 0)  # this worker's request ended
    assert me.reserve("http://a:8000", 2, 1, 10, 0)


def test_a_reservation_takes_the_lock_only_near_the_node_s_limit(lock_file: Path) -> None:
    """With room to spare for every sibling's reservation under way, a reservation stands
    without the lock; one that could take the last slots waits for it."""
    table = LoadTable(workers=3, slots=16)  # two siblings: a read may miss 2 reservations
    me = LoadShare(table, worker=0, lock_file=lock_file)
    node = "http://a:8000"
    me.slot(node)  # claimed now: claiming takes the lock too
    held = os.open(lock_file, os.O_RDWR)  # the lock, held as a sibling would hold it
    fcntl.flock(held, fcntl.LOCK_EX)
    results: list[bool] = []

    def reserve(in_flight: int) -> threading.Thread:
        def run() -> None:
            results.append(me.reserve(node, 4, in_flight, 0, 0))

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    try:
        reserve(1).join(timeout=10)  # 1 of 4: 2 slots left for what a read may miss
        reserve(2).join(timeout=10)  # 2 of 4: as many
        assert results == [True, True]  # done while the lock is held
        third = reserve(3)  # 3 of 4: it needs the lock
        third.join(timeout=0.3)
        assert third.is_alive()
        assert results == [True, True]
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)
    third.join(timeout=5)
    assert results == [True, True, True]
    assert me.totals(node) == (3, 0, 0)


def test_a_reservation_that_does_not_fit_is_undone(lock_file: Path) -> None:
    """A reservation is written before the sum is read; one that finds the node full leaves
    this worker's counts as they were."""
    table = LoadTable(workers=2, slots=16)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    node = "http://a:8000"
    assert me.reserve(node, 3, 1, 100, 10)
    assert me.reserve(node, 3, 2, 150, 20)

    def sibling() -> None:
        other = LoadShare(table, worker=1, lock_file=lock_file)
        assert other.reserve(node, 3, 1, 7, 7)  # the third of three slots

    in_child(sibling)
    assert not me.reserve(node, 3, 3, 999, 99)
    assert me.totals(node) == (3, 157, 27)  # this worker's 2, 150, 20 and the sibling's


@pytest.fixture
def claims_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims kept for a minute: a busy test host may take longer than the 0.25 s."""
    monkeypatch.setattr(shared, "CLAIM_TTL_S", 60.0)


def test_a_sibling_s_claim_names_its_node_and_how_far_it_covers_the_prompt(
    lock_file: Path, monkeypatch: pytest.MonkeyPatch, claims_last: None
) -> None:
    table = LoadTable(workers=2, slots=16)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    node = "http://a:8000"
    me.slot(node)  # as the pool's views slot every node
    theirs = tuple(range(1, 41))  # 40 blocks
    mine = theirs[:10] + tuple(range(1000, 1030))  # the same first 10 blocks

    def sibling() -> None:
        LoadShare(table, worker=1, lock_file=lock_file).claim(node, theirs, 0)

    in_child(sibling)
    assert shared.CLAIM_AT == (3, 7, 15, 31)  # the blocks claimed
    assert me.claimed(mine, 0) == (node, 8)  # its blocks 3 and 7 are the sibling's
    assert me.claimed(mine, 5) == (node, 8)
    assert me.claimed(mine, 8) is None  # block 15: the sibling's prompt went on otherwise
    assert me.claimed(theirs, 0) == (node, 32)  # no deeper than claims go
    assert me.claimed(theirs, 16) == (node, 32)
    assert me.claimed(theirs, 32) is None
    assert me.claimed(tuple(range(500, 540)), 0) is None  # another prompt
    me.claim(node, mine, 8)
    assert me.claimed(mine, 8) is None  # this worker's own claim: its index has it
    monkeypatch.setattr(shared, "CLAIM_TTL_S", 0.0)
    assert me.claimed(mine, 0) is None  # too old: the relay has told every worker by now


def test_claims_of_one_node_by_two_siblings_cover_the_prompt_and_a_torn_entry_is_ignored(
    lock_file: Path, claims_last: None
) -> None:
    table = LoadTable(workers=3, slots=16)
    node = "http://a:8000"
    first = tuple(range(1, 41))
    second = first[:10] + tuple(range(1000, 1030))  # its blocks 3 and 7 are the first's

    def siblings() -> None:
        LoadShare(table, worker=1, lock_file=lock_file).claim(node, first, 0)
        LoadShare(table, worker=2, lock_file=lock_file).claim(node, second, 0)

    in_child(siblings)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    me.slot(node)
    assert me.claimed(first, 0) == (node, 32)  # blocks 3 and 7 by worker 2, 15 and 31 by 1

    # an entry two workers wrote at once: one's key and stamp, the other's value
    other = tuple(range(2000, 2040))
    me.claim(node, other, 0)
    cells, key = table.cells, first[3]
    at = next(
        a for a in range(table.claims_at, table.claims_at + 3 * shared.CLAIMS, 3)
        if cells[a] == key
    )  # fmt: skip
    mixed = next(
        a for a in range(table.claims_at, table.claims_at + 3 * shared.CLAIMS, 3)
        if cells[a] == other[3]
    )  # fmt: skip
    cells[at + 1] = cells[mixed + 1] | 1  # worker 1's mark, another key's value
    assert me.claimed(first, 0) is None


def test_a_sibling_s_prompt_tail_is_found_past_the_match_and_an_old_or_torn_one_is_not(
    lock_file: Path,
) -> None:
    """A tail is written once at the positions it is given; a sibling's bisection over the
    positions past its own match finds the deepest one written, whoever wrote it."""
    table = LoadTable(workers=3, slots=16)
    a, b = "http://a:8000", "http://b:8000"
    turn = tuple(range(1, 41))  # a system prompt of 30 blocks, a conversation's first turn
    later = (*turn, *range(500, 520))  # its next turn

    def siblings() -> None:
        one = LoadShare(table, worker=1, lock_file=lock_file)
        assert one.share_tail(a, turn, range(30, 40))
        LoadShare(table, worker=2, lock_file=lock_file).share_tail(
            b, (*range(1, 31), 900, 901), (30, 31)
        )  # another question after the same system prompt

    in_child(siblings)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    me.slot(a)
    me.slot(b)
    assert me.deepest_tail(later, range(30, 60), 120.0) == (a, 40)
    assert me.deepest_tail(turn, range(30, 40), 120.0) == (a, 40)
    assert me.deepest_tail(later, range(40, 60), 120.0) is None  # past the tail: the new turn
    assert me.deepest_tail((*range(1, 31), 900, 901, 902), range(30, 33), 120.0) == (b, 32)
    assert me.deepest_tail(tuple(range(1000, 1040)), range(30, 40), 120.0) is None
    # a stride past the dense head: the turn ended between two of the query's positions, and
    # its last block (written, as the last of every prompt) is the query's too
    assert me.deepest_tail(later, (31, 35, 43, 47, 51, 55, 59), 120.0) == (a, 40)
    other_turn = (*turn[:38], 77, 78, *range(600, 620))  # left the turn at its 39th block
    assert me.deepest_tail(other_turn, (31, 35, 43, 47, 51, 55, 59), 120.0) == (a, 36)
    time.sleep(0.002)
    assert me.deepest_tail(later, range(30, 60), 0.001) is None  # older than the index's TTL
    # an entry two workers wrote at once: one's key and stamp, another key's value
    cells = table.cells
    at = next(
        x for x in range(table.tails_at, table.tails_at + 4 * shared.TAILS, 4)
        if cells[x] == turn[39]
    )  # fmt: skip
    other = next(
        x for x in range(table.tails_at, table.tails_at + 4 * shared.TAILS, 4)
        if cells[x] == 901
    )  # fmt: skip
    cells[at + 1] = cells[other + 1]
    assert me.deepest_tail(later, range(30, 60), 120.0) == (a, 39)  # the block before it
    unknown = LoadShare(table, worker=0, lock_file=lock_file)  # has slotted no node
    assert unknown.deepest_tail(later, range(30, 60), 120.0) is None


@given(
    writes=st.lists(
        st.tuples(
            # keys whose home entries are the table's last ones: their entries tried run past
            # its end, into the entries kept after it; and some anywhere
            st.sampled_from([shared.TAILS * k - d for k in (1, 2, 3) for d in (1, 2)] + [7, 99]),
            st.sampled_from(["http://a:8000", "http://b:8000"]),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_the_tails_table_finds_the_last_write_of_each_key_even_past_its_end(
    writes: list[tuple[int, str]],
) -> None:
    """At most 8 keys a home entry: each is found with the node of its last write, and a key
    never written is not found."""
    with tempfile.TemporaryDirectory() as tmp:
        table = LoadTable(workers=2, slots=4)
        writer, reader = (
            LoadShare(table, worker=w, lock_file=Path(tmp) / "slots.lock") for w in range(2)
        )
        for node in ("http://a:8000", "http://b:8000"):
            reader.slot(node)
        last: dict[int, str] = {}
        for key, node in writes:
            assert writer.share_tail(node, (key,), (0,))
            last[key] = node
        for key, node in last.items():
            assert reader.deepest_tail((key,), (0,), 120.0) == (node, 1)
        assert reader.deepest_tail((shared.TAILS * 4 - 1,), (0,), 120.0) is None
        assert table.cells[table.demand_at] == 0  # the tails stayed in their own cells


def _dispatcher(pool: NodePool, seed: int, **config: Any) -> Dispatcher:
    """A ``meridian`` dispatcher over ``pool``, seeded."""
    return Dispatcher(
        pool=pool,
        policy=routing.create("meridian", routing.RoutingConfig(**config)),
        settings=QueueSettings(),
        clock=MonotonicClock(),
        rng=random.Random(seed),
    )


async def test_a_new_prompt_goes_where_a_sibling_sent_it_moments_before(
    lock_file: Path, claims_last: None
) -> None:
    """Two workers meet a new prompt at once (docs/benchmarks.md, Workers): the second sends
    it where the first did, before any relayed record, though its views find that node the
    busier by the first's request; without the claims it goes to the other node."""
    table = LoadTable(workers=2, slots=16)
    nodes = [NodeId("http://a:8000"), NodeId("http://b:8000")]

    def worker(index: int) -> Dispatcher:
        pool = NodePool()
        pool.shared = LoadShare(table, worker=index, lock_file=lock_file)
        for node in nodes:
            pool.add(Node(node_id=node, url=node, models=frozenset({MODEL})))
        dispatcher = _dispatcher(pool, index)
        dispatcher.claims = pool.shared
        return dispatcher

    def chat(tail: int) -> RequestView:
        hashes = (*range(1, 31), tail)  # a system prompt of 30 blocks, a question
        return RequestView(model=MODEL, prompt_tokens=500, max_tokens=10, block_hashes=hashes)

    first, second = worker(0), worker(1)
    there = (await first.acquire(chat(100), tokens=510)).node_id
    assert (await second.acquire(chat(200), tokens=510)).node_id == there
    assert second.stats.routed == {"sibling-claim": 1}  # and so in the decisions metric

    alone = worker(1)  # the same views, without the claims
    alone.claims = None
    elsewhere = (await alone.acquire(chat(300), tokens=510)).node_id
    assert elsewhere != there


async def test_a_probation_trial_is_not_moved_by_a_sibling_s_claim(
    lock_file: Path, claims_last: None
) -> None:
    """A trial goes to the node on probation even where a sibling claimed the prompt for
    another node: choosing again would give the trial away."""
    table = LoadTable(workers=2, slots=16)
    healthy, trying = NodeId("http://a:8000"), NodeId("http://b:8000")

    class Health:
        def state(self, node_id: NodeId, *, now: float) -> HealthState:
            return HealthState.PROBATION if node_id == trying else HealthState.HEALTHY

        def slow_start(self, node_id: NodeId, *, now: float) -> float:
            return 1.0

        def steady_until(self, node_id: NodeId, *, now: float) -> float:
            return math.inf

    pool = NodePool()
    pool.health = Health()
    pool.shared = LoadShare(table, worker=0, lock_file=lock_file)
    for node in (healthy, trying):
        pool.add(Node(node_id=node, url=node, models=frozenset({MODEL})))
    dispatcher = _dispatcher(pool, 0, probation_every=2)
    dispatcher.claims = pool.shared
    hashes = tuple(range(1, 33))
    LoadShare(table, worker=1, lock_file=lock_file).claim(healthy, hashes, 0)  # the sibling

    def chat() -> RequestView:
        return RequestView(model=MODEL, prompt_tokens=512, max_tokens=10, block_hashes=hashes)

    first = await dispatcher.acquire(chat(), tokens=522)  # not a trial
    assert first.node_id == healthy and not first.decision.trial
    second = await dispatcher.acquire(chat(), tokens=522)  # every 2nd decision: a trial
    assert second.node_id == trying and second.decision.trial


def test_a_decision_reads_the_count_a_sibling_wrote_since_the_last_share_read(
    lock_file: Path,
) -> None:
    """Stale sibling counts moved prompts between nodes (docs/benchmarks.md, Workers): every
    read of the views reads what the siblings changed, without waiting for the share loop,
    and the share loop still wakes the queue for it."""
    table = LoadTable(workers=2, slots=16)
    pool = NodePool()
    pool.shared = LoadShare(table, worker=0, lock_file=lock_file)
    node = NodeId("http://a:8000")
    pool.add(Node(node_id=node, url=node, models=frozenset({MODEL})))
    assert pool.views(now=0.0).by_id[node].in_flight == 0
    woken: list[int] = []
    pool.subscribe(lambda: woken.append(1))

    LoadShare(table, worker=1, lock_file=lock_file).write(node, 3, 300, 0)  # the sibling
    assert pool.views(now=0.0).by_id[node].in_flight == 3  # no siblings_moved() between
    assert woken == []  # a decision does not route back into the queue
    assert pool.siblings_moved() == 0  # the decision read the move ...
    assert woken == [1]  # ... and the share loop owes the queue its wake


@pytest.mark.parametrize("siblings", [True, False])
def test_a_worker_s_own_moves_are_redone_once_at_the_next_read(
    lock_file: Path, siblings: bool
) -> None:
    """With siblings, a dispatch, a first token and a completion leave the node's view to the
    next read of the views, which redoes it once (a decision redoes the nodes the siblings
    moved anyway); every read shows the counts as they are.  Alone, each move redoes it at
    once, so that a decision finds the views ready."""
    pool = NodePool()
    if siblings:
        pool.shared = LoadShare(LoadTable(workers=2, slots=16), worker=0, lock_file=lock_file)
    node = NodeId("http://a:8000")
    pool.add(Node(node_id=node, url=node, models=frozenset({MODEL})))
    assert pool.views(now=0.0).by_id[node].in_flight == 0
    built: list[NodeId] = []
    view = pool._view

    def counted(n: Node, *args: Any) -> Any:
        built.append(n.node_id)
        return view(n, *args)

    pool._view = counted  # type: ignore[method-assign]
    assert pool.acquire(node, tokens=100, prefill=40)
    pool.first_token(node, prefill=40)
    assert len(built) == (0 if siblings else 2)
    views = pool.views(now=0.0)
    assert (views.by_id[node].in_flight, views.by_id[node].prefill_tokens) == (1, 0)
    assert len(built) == (1 if siblings else 2)
    pool.release(node, tokens=100, failed=False)
    assert [v.in_flight for v in pool.observed(now=0.0)] == [0]  # the admin API's read
    assert len(built) == (2 if siblings else 3)
    assert pool.views(now=0.0).by_id[node].in_flight == 0
    assert len(built) == (2 if siblings else 3)  # nothing moved since


async def test_the_share_loop_keeps_its_fast_pace_for_requests_waiting_for_a_slot(
    tmp_path: Path,
) -> None:
    """At 2 ms always, an idle worker's share loop cost it 13 ms of CPU a second
    (docs/benchmarks.md, Workers): while nothing waits here it runs every ``IDLE_SHARE_S``, and
    at ``share_interval_s`` from the moment a request waits for a slot, which a sibling frees."""
    table = LoadTable(workers=2, slots=16)
    rings = PrefixRings(workers=2)
    node = NodeId("http://a:8000")

    def runtime(index: int) -> WorkerRuntime:
        pool = NodePool()
        pool.add(Node(node_id=node, url=node, slots=1, models=frozenset({MODEL})))
        dispatcher = _dispatcher(pool, index)
        worker = Worker(
            index=index, count=2, directory=tmp_path, table=table, rings=rings, secret="s"
        )
        return WorkerRuntime(
            worker,
            pool=pool,
            dispatcher=dispatcher,
            clock=MonotonicClock(),
            render_metrics=lambda: b"",
            share_interval_s=0.002,
        )

    first, second = runtime(0), runtime(1)
    posted: list[int] = []  # the queue depth the second worker posted, once per loop turn
    post = second.share.post_demand

    def counted(queued: int, arrivals: int) -> None:
        posted.append(queued)
        post(queued, arrivals)

    second.share.post_demand = counted  # type: ignore[method-assign]
    request = RequestView(model=MODEL, prompt_tokens=10, max_tokens=10)
    loop = asyncio.create_task(second.share_loop())
    try:
        await asyncio.sleep(0.5)
        assert len(posted) <= 0.5 / IDLE_SHARE_S + 1  # idle: 250 turns at the 2 ms pace
        held = await first._dispatcher.acquire(request, tokens=20)  # the node's one slot
        waiting = asyncio.create_task(second._dispatcher.acquire(request, tokens=20))
        await asyncio.sleep(0.01)
        before = len(posted)
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert len(posted) - before >= 10  # the fast pace: about 100 turns
        assert posted[-1] == 1  # the waiting request, for the autoscaler
        held.release()  # on the first worker: only the second's share loop can see it
        lease = await asyncio.wait_for(waiting, 1.0)
        assert lease.node_id == node
        lease.release()
        await asyncio.sleep(0.05)
        before = len(posted)
        await asyncio.sleep(0.3)
        assert len(posted) - before <= 0.3 / IDLE_SHARE_S + 1
        assert posted[-1] == 0
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    assert second._dispatcher.on_queued is None


def test_a_sibling_that_laps_its_ring_makes_the_reader_compare_every_slot(
    lock_file: Path,
) -> None:
    table = LoadTable(workers=2, slots=64)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    nodes = [f"http://n{i}:8000" for i in range(5)]
    for node in nodes:
        assert me.totals(node) == (0, 0, 0)  # slotted here
    other = LoadShare(table, worker=1, lock_file=lock_file)
    other.write(nodes[0], 1, 1, 1)
    for i in range(RING + 5):  # more writes than the ring names, all on node 4
        other.write(nodes[4], i % 3, i, 0)
    assert me.moved() == {nodes[0], nodes[4]}


@given(
    batches=st.lists(
        st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=RING - 1),
        min_size=1,
        max_size=12,
    )
)
def test_the_nodes_a_sibling_wrote_are_read_from_its_ring_across_its_end(
    batches: list[list[int]],
) -> None:
    """Between two reads a sibling writes fewer entries than its ring holds, starting anywhere
    in it: the reader names exactly the nodes written, whether the run of entries wraps past
    the ring's end or not (no backstop: each read comes well within ``SCAN_EVERY_S``)."""
    with tempfile.TemporaryDirectory() as tmp:
        lock_file = Path(tmp) / "slots.lock"
        table = LoadTable(workers=2, slots=64)
        me = LoadShare(table, worker=0, lock_file=lock_file)
        nodes = [f"http://n{i}:8000" for i in range(10)]
        for node in nodes:
            assert me.totals(node) == (0, 0, 0)  # slotted here
        assert me.moved() == set()
        other = LoadShare(table, worker=1, lock_file=lock_file)
        for batch in batches:
            for n in batch:
                other.write(nodes[n], 1, n, 0)
            me._scanned_s = time.monotonic()  # this test reads the ring, not the backstop
            assert me.moved() == {nodes[n] for n in batch}


def test_a_write_whose_ring_entry_was_read_stale_is_found_by_the_timed_backstop(
    lock_file: Path,
) -> None:
    """arm64 may show a sibling's new generation before its ring entry: the reader then looks
    at the wrong slot, and only the backstop, ``SCAN_EVERY_S`` after the last, finds the
    write (by time: reads come with every decision)."""
    table = LoadTable(workers=2, slots=64)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    a, b = "http://a:8000", "http://b:8000"
    assert me.totals(a) == me.totals(b) == (0, 0, 0)  # both slotted here
    assert me.moved() == set()
    other = LoadShare(table, worker=1, lock_file=lock_file)
    other.write(a, 2, 20, 0)
    # what the reader sees of a stale ring entry: the write's ring entry names b's slot
    generation = table.cells[1 + 1]
    table.cells[table.rings_at + RING + generation % RING] = me.slot(b) or 0
    assert me.moved() == {b}  # a's write missed ...
    assert me.moved() == set()
    time.sleep(SCAN_EVERY_S + 0.01)
    assert me.moved() == {a}  # ... until the backstop compares every slot


def test_the_workers_agree_on_every_node_s_slot_and_a_full_table_says_so(
    lock_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = LoadTable(workers=2, slots=8)
    nodes = [f"http://n{i}:8000" for i in range(9)]

    def sibling() -> None:
        other = LoadShare(table, worker=1, lock_file=lock_file)
        for node in reversed(nodes[:8]):
            assert other.slot(node) is not None

    in_child(sibling)
    me = LoadShare(table, worker=0, lock_file=lock_file)
    with caplog.at_level(logging.WARNING):
        slots = [me.slot(node) for node in nodes]
    assert sorted(s for s in slots[:8] if s is not None) == list(range(8))
    assert slots[8] is None
    assert me.totals(nodes[8]) is None  # routed on this worker's own counts
    assert caplog.text.count("load table is full") == 1


@given(
    st.text(min_size=1, max_size=40),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=50),
)
def test_prefix_records_survive_the_ring(node: str, start: int, hashes: list[int]) -> None:
    record = encode(node, hashes, start)
    assert decode(record) == (node, start, tuple(hashes))
    assert decode(b"pad" + record, 3, len(record)) == (node, start, tuple(hashes))  # names kept


def test_a_record_whose_node_is_not_utf8_is_refused_every_time() -> None:
    good = encode("http://a:8000", [1, 2])
    bad = good.replace(b"http://a:8000", b"http://\xff:8000")
    for _ in range(2):  # the bad name is not remembered as a name
        with pytest.raises(UnicodeDecodeError):
            decode(bad)
    assert decode(good) == ("http://a:8000", 0, (1, 2))


def test_a_truncated_or_overlong_prefix_record_is_refused() -> None:
    whole = encode("http://a:8000", [1, 2, 3])
    for cut in (1, 7, len(whole) - 1):
        with pytest.raises(ValueError, match="truncated"):
            decode(whole[:cut])
    with pytest.raises(ValueError, match="past a record's end"):
        decode(whole + b"\0")
    with pytest.raises(OverflowError):
        encode("http://a:8000", [2**64])


def _relays(
    rings: PrefixRings, got: dict[int, list[tuple[str, int, tuple[int, ...]]]], **kw: Any
) -> list[PrefixRelay]:
    """A relay for each worker of ``rings``; what worker w takes in lands in ``got[w]``."""
    return [
        PrefixRelay(
            rings,
            worker=w,
            on_records=lambda records, w=w: got.setdefault(w, []).extend(records),
            clock=time.monotonic,
            **kw,
        )
        for w in range(rings.workers)
    ]


def test_prefix_records_reach_every_sibling_and_a_long_prompt_keeps_its_head() -> None:
    got: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
    relays = _relays(PrefixRings(workers=3), got)
    relays[0].send("http://a:8000", list(range(5)))
    relays[0].send("http://b:8000", list(range(MAX_HASHES + 500)))
    relays[1].take()
    relays[0].take()  # nothing of its own
    relays[2].take()
    relays[2].take()  # nothing new
    for w in (1, 2):
        assert got[w] == [
            ("http://a:8000", 0, (0, 1, 2, 3, 4)),
            ("http://b:8000", 0, tuple(range(MAX_HASHES))),
        ]
    assert 0 not in got
    assert relays[2].counts() == {
        "sent": 0,
        "shared": 0,
        "received": 2,
        "overrun": 0,
        "malformed": 0,
    }


def test_a_ring_wraps_and_a_reader_a_ring_behind_counts_what_it_lost() -> None:
    """Records of every size cross the ring's end intact; a worker that reads a sibling's ring
    only after it was written over loses those records, counts them, and takes the next."""
    rings = PrefixRings(workers=2, ring_bytes=130_000)  # the least: two frames of the longest
    got: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
    writer, reader = _relays(rings, got)
    rng = random.Random(7)
    sent = []
    for i in range(400):  # about 11 times round the ring, read as it goes
        count = rng.choice((1, 30, 900, MAX_HASHES))
        hashes = tuple(rng.getrandbits(64) for _ in range(count))
        writer.send(f"http://n{i % 3}:8000", hashes)
        sent.append((f"http://n{i % 3}:8000", 0, hashes))
        if count > 30 or rng.random() < 0.5:  # a reader may lag a ring less the longest frame
            reader.take()
    reader.take()
    assert got[1] == sent and reader.overrun == 0 and reader.malformed == 0
    for i in range(40):  # 40 records of 27 KiB: about 8 rings
        writer.send("http://a:8000", tuple(range(i, i + 3400)))
    writer.send("http://a:8000", (1, 2, 3))
    reader.take()
    assert reader.overrun == 41 and got[1][len(sent) :] == []  # the last, too: one read
    writer.send("http://a:8000", (4, 5))
    reader.take()
    assert got[1][len(sent) :] == [("http://a:8000", 0, (4, 5))]
    assert reader.counts() == {
        "sent": 0,
        "shared": 0,
        "received": 401,
        "overrun": 41,
        "malformed": 0,
    }


def test_a_forked_worker_reads_the_records_its_sibling_writes() -> None:
    """The rings are a shared mapping made before the fork, as the supervisor makes them."""
    rings = PrefixRings(workers=2)
    got: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
    parent = _relays(rings, got)[0]

    def child() -> None:
        _relays(rings, {})[1].send("http://a:8000", (7, 8, 9))

    in_child(child)
    parent.take()
    assert got[0] == [("http://a:8000", 0, (7, 8, 9))]


def test_a_record_leaves_out_the_head_its_sender_sent_that_node_whole_moments_ago() -> None:
    """A prompt's head (the blocks the sender's policy matched on the node) goes whole to the
    siblings once per ``full_every_s`` per node; in between, records carry only the tail."""
    now = [0.0]
    got: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
    rings = PrefixRings(workers=2)
    sender, receiver = (
        PrefixRelay(
            rings,
            worker=w,
            on_records=lambda records, w=w: got.setdefault(w, []).extend(records),
            clock=lambda: now[0],
            full_every_s=1.0,
        )
        for w in range(2)
    )
    head = tuple(range(1, 25))
    a, b = "http://a:8000", "http://b:8000"
    sender.send(a, (*head, 100))  # a new prompt: nothing matched
    sender.send(a, (*head, 101), 24)  # its head matched on a, not yet sent whole as one
    now[0] = 0.9
    sender.send(a, (*head, 102), 24)  # now it was: the tail alone
    sender.send(a, (*head, 103, 104), 24)
    sender.send(b, (*head, 105), 24)  # another node: whole
    sender.send(a, head, 24)  # the head alone, matched and told: nothing to tell
    now[0] = 1.0
    sender.send(a, (*head, 106), 24)  # told 1 s ago: whole again
    receiver.take()
    assert got[1] == [
        (a, 0, (*head, 100)),
        (a, 0, (*head, 101)),
        (a, 24, (102,)),
        (a, 24, (103, 104)),
        (b, 0, (*head, 105)),
        (a, 0, (*head, 106)),
    ]
    assert (sender.sent, sender.tails) == (6, 2)


async def test_a_sibling_learns_whole_prompts_from_records_without_their_head(
    tmp_path: Path,
) -> None:
    """Worker 0 routes questions after one system prompt: the first two go whole through the
    ring, the others' tails (the head left out) to the shared table.  Worker 1 takes the whole
    ones in before its next decision, and its policy asks the table for the rest: it matches
    each whole prompt on the node it went to."""
    table = LoadTable(workers=2, slots=16)
    rings = PrefixRings(workers=2)
    nodes = [NodeId("http://a:8000"), NodeId("http://b:8000")]

    def runtime(index: int) -> WorkerRuntime:
        pool = NodePool()
        for node in nodes:
            pool.add(Node(node_id=node, url=node, models=frozenset({MODEL})))
        worker = Worker(
            index=index, count=2, directory=tmp_path, table=table, rings=rings, secret="s"
        )
        return WorkerRuntime(
            worker,
            pool=pool,
            dispatcher=_dispatcher(pool, index),
            clock=MonotonicClock(),
            render_metrics=lambda: b"",
            share_interval_s=0.002,
        )

    def chat(tail: int) -> RequestView:
        hashes = (*range(1, 31), tail)  # a system prompt of 30 blocks, a question
        return RequestView(model=MODEL, prompt_tokens=31 * 16, max_tokens=1, block_hashes=hashes)

    first, second = runtime(0), runtime(1)
    went = []
    for tail in range(100, 106):
        lease = await first._dispatcher.acquire(chat(tail), tokens=31 * 16 + 1)
        went.append(lease.node_id)
        lease.release()
    assert len(set(went)) == 1  # one agent's routing: the prompt stays on its node
    assert first.relay.counts()["sent"] == 2  # the first two whole, through the ring
    assert first.relay.tails == first.relay.counts()["shared"] == 4  # the table
    assert second.relay.received == 0  # nothing taken until it decides
    lease = await second._dispatcher.acquire(chat(106), tokens=31 * 16 + 1)
    assert (lease.node_id, lease.decision.expected_hit_tokens) == (went[0], 30 * 16)
    lease.release()
    assert second.relay.received == 2
    policy, views = second._dispatcher.policy, second._pool.views(now=0.0)
    for tail in range(100, 106):
        decision = policy.choose(chat(tail), list(views), now=0.0, rng=random.Random(0))
        assert (decision.node, decision.expected_hit_tokens) == (went[0], 31 * 16), tail
    # a policy switched to (``POST /admin/policy``) asks the table too, from its first decision
    # (it learns the head from the next whole record, as any policy after a switch)
    second._dispatcher.set_policy(routing.create("prefix_aware", routing.RoutingConfig()))
    first.relay.send(went[0], chat(107).block_hashes)  # nothing matched: whole
    lease = await second._dispatcher.acquire(chat(104), tokens=31 * 16 + 1)
    assert (lease.node_id, lease.decision.expected_hit_tokens) == (went[0], 31 * 16)
    lease.release()
    first.close()
    assert first._dispatcher.on_routed is None and first._dispatcher.before_choosing is None


def test_a_forked_process_makes_request_ids_of_its_own() -> None:
    """Each ``--workers`` worker is a fork: its ids must not repeat its parent's or a sibling's
    (the prefix is drawn again in the child; the counter is not reset, and need not be)."""
    mine = request_ids.new()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.write(write, request_ids.new().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    theirs = os.read(read, 100).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(theirs) == len(mine) == 32
    assert theirs[:16] != mine[:16]  # the process's prefix
    assert request_ids.new()[:16] == mine[:16]  # the parent keeps its own


async def test_a_restarted_worker_holds_a_drain_for_a_node_its_discovery_has_not_found(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """``admin.catch_up`` with a sibling's state: a static node's drain and weight are taken at
    once; those of a node found by DNS are held until this worker's discovery adds it."""
    handle = await start_agent([await sim_node()], policy="round_robin")
    edge = handle.edge
    (static,) = list(edge.pool)
    state = {
        "policy": "least_connections",
        "nodes": [
            {"id": static.node_id, "url": static.url, "source": "static", "admin": "drained",
             "weight": 3.0, "slots": static.slots, "group": static.node_id},
            {"id": "127.0.0.1:9", "url": "http://127.0.0.1:9", "source": "dns:vllm.example.",
             "admin": "draining", "weight": 2.0, "slots": 64, "group": "127.0.0.1:9"},
        ],
    }  # fmt: skip
    done = await admin.catch_up(edge, state)
    assert done == [
        f"draining {static.node_id}",
        f"weight {static.node_id} 3",
        "held for 127.0.0.1:9 until discovered",
        "policy least_connections",
    ]
    assert static.admin is AdminState.DRAINING and static.weight == 3.0
    found = await edge.roster.add(
        edge.roster.make(NodeSettings(url="http://127.0.0.1:9"), source="dns:vllm.example.")
    )
    assert found.admin is AdminState.DRAINING and found.weight == 2.0
    assert await admin.catch_up(edge, state) == []  # nothing left to take

    # a node deleted and added again at another URL since the start is added at the new one
    moved = await edge.roster.add(
        edge.roster.make(NodeSettings(id="gpu-7", url="http://127.0.0.1:10"), source="admin")
    )
    state["nodes"].append(
        {"id": "gpu-7", "url": "http://127.0.0.1:11", "source": "admin", "admin": "active",
         "weight": 1.0, "slots": 64, "group": "gpu-7"}
    )  # fmt: skip
    assert await admin.catch_up(edge, state) == [
        "removed gpu-7 at http://127.0.0.1:10",
        "added gpu-7",
    ]
    again = edge.pool.get("gpu-7")
    assert again is not None and again is not moved and again.url == "http://127.0.0.1:11"

    # a drain a sibling passes on about a node this worker has not found yet is held too
    edge.sibling_secret = "the supervisor's secret"
    async with httpx.AsyncClient(base_url=handle.url, trust_env=False) as client:
        sibling = {"X-Meridian-Worker-Secret": edge.sibling_secret}
        reply = await client.post("/admin/nodes/127.0.0.1:12/drain", headers=sibling)
        assert reply.status_code == 202 and reply.json() == {"held": "127.0.0.1:12"}
        reply = await client.put(
            "/admin/nodes/127.0.0.1:12/weight", headers=sibling, json={"weight": 4}
        )
        assert reply.status_code == 202
        assert edge.roster.held["127.0.0.1:12"] == (True, 4.0)
        reply = await client.post("/admin/nodes/127.0.0.1:13/drain", headers=ADMIN)
        assert reply.status_code == 404  # from a client, an unknown node is still unknown


def test_settings_refuse_several_workers_where_one_process_must_own_the_region() -> None:
    """The simulator actuator adds its nodes to one process's pool; the actuators that call
    out act in one worker, and a publishing agent's workers are replicas."""
    with pytest.raises(pydantic.ValidationError, match=r"autoscaler.actuator = 'simulator'"):
        Settings(workers={"count": 2}, autoscaler={"actuator": "simulator"})
    assert Settings(autoscaler={"actuator": "simulator"}).processes() == 1  # one per CPU: one
    assert Settings().workers.count == 0
    assert Settings(workers={"count": 2}, autoscaler={"actuator": "dry-run"}).workers.count == 2
    acting = Settings(workers={"count": 2}, autoscaler={"actuator": "command", "command": ["x"]})
    assert acting.workers.count == 2
    replicas = Settings(
        workers={"count": 2},
        region={"id": "eu-west", "geo": "eu", "etcd": ["http://127.0.0.1:2379"]},
        nodes=[{"url": "http://127.0.0.1:8000"}],
    )
    assert replicas.workers.processes() == 2


def test_a_worker_s_id_keeps_the_tail_that_tells_agents_apart() -> None:
    """``<agent_id>-w<i>`` within the 63 characters of a key's id: a long id loses its head,
    not the host's end and pid that differ between pods."""
    assert worker_agent_id("edge-a", 3) == "edge-a-w3"
    a, b = "x" * 55 + "-pod-a-12", "x" * 55 + "-pod-b-12"
    assert worker_agent_id(a, 0) != worker_agent_id(b, 0)
    for agent_id in (a, "." + "y" * 62, "z" * 63):
        got = worker_agent_id(agent_id, 255)
        assert re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,62}", got) and got.endswith("-w255"), got


# -- meridian-agent --workers 2 ----------------------------------------------------------------


@dataclass
class AgentProcess:
    url: str
    proc: subprocess.Popen[str]
    log: Path

    def workers(self) -> list[int]:
        """The pids of the supervisor's live children."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()]

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """``agent = agent_process(nodes, workers=2, env={...})``: ``meridian-agent`` as a real
    process; it is stopped (SIGTERM) after the test."""
    started: list[AgentProcess] = []

    def start(nodes: list[SimProcess], *, workers: int = 2, **env: str) -> AgentProcess:
        log = tmp_path / f"agent-{len(started)}.log"
        args = [sys.executable, "-m", "regional_agent.cli", "--port", "0"]
        args += ["--workers", str(workers)]
        for node in nodes:
            args += ["--node", node.url]
        environment = {
            **os.environ,
            "MERIDIAN_AGENT_ADMIN__TOKEN": ADMIN_TOKEN,
            "MERIDIAN_AGENT_TELEMETRY__SCRAPE_INTERVAL_S": "0.2",
            **env,
        }
        with log.open("w") as err:
            proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=err, text=True, env=environment
            )
        assert proc.stdout is not None
        line = _readline(proc, timeout_s=30)
        if not line.startswith("READY "):
            proc.kill()
            raise RuntimeError(f"meridian-agent did not start: {line!r}\n{log.read_text()}")
        agent = AgentProcess(url=line.split()[1], proc=proc, log=log)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        stop_process(agent.proc, timeout_s=30)


def _readline(proc: subprocess.Popen[str], *, timeout_s: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline()


def _fresh() -> httpx.AsyncClient:
    """A client that opens a new connection for every request: the kernel spreads them over
    the workers' sockets."""
    return httpx.AsyncClient(
        timeout=60, limits=httpx.Limits(max_keepalive_connections=0), trust_env=False
    )


async def _metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with _fresh() as client:
        reply = await client.get(f"{url}/metrics")
    assert reply.status_code == 200
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _by_worker(samples: list[tuple[dict[str, str], float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in samples:
        out[labels["worker"]] = out.get(labels["worker"], 0.0) + value
    return out


async def _node_metric(node: SimProcess, *names: str) -> float:
    """The sum of every sample of ``names`` in one scrape of the node (one scrape: a request
    that moves from one series to another between two scrapes is not counted twice)."""
    async with _fresh() as client:
        reply = await client.get(f"{node.url}/metrics")
    return sum(
        s.value
        for f in text_string_to_metric_families(reply.text)
        for s in f.samples
        if s.name in names
    )


async def _chat(client: httpx.AsyncClient, url: str, content: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return await client.post(f"{url}/v1/chat/completions", json={**body, **extra})


async def _wait_models(url: str) -> None:
    """Until every worker knows the nodes' model (each refreshes it on its own)."""
    async with _fresh() as client:
        for _ in range(100):
            replies = [await client.get(f"{url}/ready") for _ in range(8)]
            if all(r.status_code == 200 for r in replies):
                return
            await asyncio.sleep(0.1)
    raise AssertionError("the workers never became ready")


async def test_two_workers_share_the_port_and_one_metrics_page(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    nodes = sim_processes(2, profile="h100-llama3-8b", time_scale=50.0)
    agent = agent_process(nodes, workers=2)
    assert len(agent.workers()) == 2
    await _wait_models(agent.url)
    async with _fresh() as client:
        replies = await asyncio.gather(
            *(_chat(client, agent.url, f"hello {i} " + "and more " * 40) for i in range(40))
        )  # a prompt of whole blocks: its record goes to the sibling
    assert [r.status_code for r in replies] == [200] * 40
    await asyncio.sleep(0.3)  # the share loops' turns: each worker takes in the other's records
    ids = [r.headers["X-Request-ID"] for r in replies]
    assert len(set(ids)) == 40, "two workers gave one request id to two requests"
    metrics = await _metrics(agent.url)
    served = _by_worker(metrics["meridian_agent_requests_total"])
    assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == 40
    assert metrics["meridian_agent_workers"] == [({}, 2.0)]
    assert metrics["meridian_agent_workers_scraped"] == [({}, 2.0)]
    assert agent.log_text().count("workers ready") == 1
    relayed = metrics["meridian_agent_prefix_relay_records_total"]
    sent = sum(v for labels, v in relayed if labels["direction"] == "sent")
    received = sum(v for labels, v in relayed if labels["direction"] == "received")
    assert sent == 40  # every routed prompt, for the one sibling
    assert received == sent  # taken in at a decision, or at the share loop's turn (0.1 s)
    lost = metrics["meridian_agent_prefix_relay_lost_records_total"]
    assert {labels["cause"] for labels, _ in lost} == {"overrun", "malformed"}
    assert sum(v for _, v in lost) == 0


async def test_each_node_is_scraped_and_probed_by_one_worker_for_both(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    """Two workers, two nodes, a scrape and a probe every 0.2 s: each node's owner scrapes
    and probes it, and the other worker lists the owner's sample (``scraped_by``) having
    scraped and probed it at most at the start, before the owner's first (each worker scraped
    and probed every node before), and counts the owner's probes as its own."""
    nodes = sim_processes(2)
    agent = agent_process(nodes, workers=2, MERIDIAN_AGENT_HEALTH__PROBE_INTERVAL_S="0.2")
    await _wait_models(agent.url)
    await asyncio.sleep(2.0)  # about 10 scrape and probe rounds
    by_owner: dict[str, dict[str, Any]] = {}  # node -> its owner's listing of it
    by_reader: dict[str, dict[str, Any]] = {}  # node -> the other worker's
    for _ in range(64):
        async with _fresh() as client:  # a new connection: either worker may take it
            got = await client.get(f"{agent.url}/admin/nodes", headers=ADMIN)
        assert got.status_code == 200, got.text
        for node in got.json()["nodes"]:
            seen = by_reader if node["telemetry"]["scraped_by"] else by_owner
            seen[node["url"]] = node
        if len(by_owner) == len(by_reader) == 2:
            break
    assert sorted(by_owner) == sorted(by_reader) == sorted(n.url for n in nodes)
    for url, owned in by_owner.items():
        read = by_reader[url]
        assert owned["telemetry"]["scrapes_total"] >= 5, owned
        assert read["telemetry"]["scrapes_total"] <= 2, read  # against about 10 when each did
        assert read["telemetry"]["stale"] is False and read["telemetry"]["age_s"] < 1.0, read
        assert read["telemetry"]["block_size"] == owned["telemetry"]["block_size"] is not None
        assert owned["health"]["probes_sent"] >= 5, owned
        assert read["health"]["probes_sent"] <= 2, read
        assert read["health"]["consecutive_probe_successes"] >= 5, read  # the owner's probes


async def test_the_slots_of_a_node_are_counted_over_every_worker(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    """One node with one slot: requests that arrive on both workers still run one at a time
    there (each worker alone would send it one of its own)."""
    (node,) = sim_processes(1, profile="h100-llama3-8b", time_scale=1.0)
    agent = agent_process([node], workers=2, MERIDIAN_AGENT_QUEUE__SLOTS_PER_NODE="1")
    await _wait_models(agent.url)
    peak = 0.0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            held = await _node_metric(
                node, "vllm:num_requests_running", "vllm:num_requests_waiting"
            )  # one scrape: a request finishing and the next arriving between two would add up
            peak = max(peak, held)
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch())
    served: dict[str, float] = {}
    async with _fresh() as client:
        # 8 at once, again until both workers took some: the kernel spreads new connections
        # by a hash of their ports, and all 8 land on one worker about once in 128 rounds
        for round_ in range(4):
            replies = await asyncio.gather(
                *(_chat(client, agent.url, f"long {round_} {i}", max_tokens=40) for i in range(8))
            )
            assert [r.status_code for r in replies] == [200] * 8
            served = _by_worker((await _metrics(agent.url))["meridian_agent_requests_total"])
            if set(served) == {"0", "1"}:
                break
    done.set()
    await watcher
    assert set(served) == {"0", "1"}, served  # both workers took some
    assert peak == 1, f"the node had {peak} requests at once with one slot"


async def _hits_of(
    nodes: list[SimProcess], agent: AgentProcess, prompts: list[str], repeats: int
) -> float:
    await _wait_models(agent.url)
    before = sum([await _node_metric(n, "vllm:prefix_cache_hits_total") for n in nodes])
    async with _fresh() as client:
        for _ in range(repeats):
            for prompt in prompts:
                reply = await _chat(client, agent.url, prompt)
                assert reply.status_code == 200
    after = sum([await _node_metric(n, "vllm:prefix_cache_hits_total") for n in nodes])
    return after - before


async def test_two_workers_keep_the_prefix_hits_of_one(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    """Each prompt is sent three times, each time on a new connection, so its repeats land on
    either worker; the one that did not route it before knows where it went from its sibling.
    The agent breaks ties between nodes without the prefix at random: a worker that did not
    know would send a repeat to the other node about half the time."""
    prompts = [f"system prompt number {i}: " + "a long shared context " * 80 for i in range(6)]
    hits = {}
    for workers in (1, 2):
        nodes = sim_processes(2, profile="h100-llama3-8b", time_scale=50.0)
        agent = agent_process(nodes, workers=workers, MERIDIAN_AGENT_ROUTING__POLICY="prefix_aware")
        hits[workers] = await _hits_of(nodes, agent, prompts, repeats=3)
        if workers == 2:
            served = _by_worker((await _metrics(agent.url))["meridian_agent_requests_total"])
            assert set(served) == {"0", "1"}, served
    assert hits[1] > 0
    assert hits[2] == hits[1], hits


async def test_a_publishing_agent_s_workers_are_replicas_of_the_region(
    etcd: EtcdServer,
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    """With ``region.etcd``, each worker publishes as a replica of its own, ``<agent_id>-w<i>``
    under a lease of its own: the controller combines them as it combines replicas, each takes
    its share of a tenant's rate limit from etcd's count, and their keys go with the agent."""
    nodes = sim_processes(2)
    agent = agent_process(
        nodes,
        workers=2,
        MERIDIAN_AGENT_REGION__ID=publishing.REGION,
        MERIDIAN_AGENT_REGION__GEO="eu",
        MERIDIAN_AGENT_REGION__ETCD=json.dumps([etcd.url]),
        MERIDIAN_AGENT_REGION__AGENT_ID="edge-a",
        MERIDIAN_AGENT_REGION__LEASE_TTL_S="2",
        MERIDIAN_AGENT_REGION__MIN_INTERVAL_S="0.2",
    )
    ids = ["edge-a-w0", "edge-a-w1"]
    async with publishing.client(etcd) as c:
        statuses = []
        for agent_id in ids:
            got = await publishing.eventually(
                lambda agent_id=agent_id: publishing.status(c, agent=agent_id),
                what=f"{agent_id}'s status",
            )
            statuses.append(got[0])
        leases = {await publishing.alive(c, agent=agent_id) for agent_id in ids}
        assert None not in leases and len(leases) == 2
        combined = combine(statuses)
        assert combined.agent_id == "edge-a-w0,edge-a-w1"
        assert combined.nodes_total == 2
        await publishing.eventually(
            lambda: all(
                f"split over 2 agent processes (replicas, each of their workers), this one rank {r}"
                in agent.log.read_text()
                for r in (0, 1)
            ),
            what="each worker's share of the rate limits, from etcd's count",
        )
        stop_process(agent.proc, timeout_s=30)

        async def gone() -> bool:
            return all([await publishing.alive(c, agent=agent_id) is None for agent_id in ids])

        await publishing.eventually(gone, what="both workers' alive keys gone with the agent")


async def test_workers_without_etcd_split_a_tenant_s_rate_limit(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    """Without etcd's count, N workers take 1/N of a tenant's limit each, so the agent admits
    the limit, not N times it: 16 requests over fresh connections (the kernel spreads them over
    both workers) to a tenant of 4 requests a minute, 4 served (each worker's 2)."""
    key, digest = new_key()
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(
        f'[[tenants]]\nname = "team"\nrpm = 4\n[[tenants.keys]]\nsha256 = "{digest}"\n'
    )
    agent = agent_process(
        sim_processes(1, profile="h100-llama3-8b", time_scale=50.0),
        workers=2,
        MERIDIAN_AGENT_TENANTS__KEYS_FILE=str(keys_file),
    )
    await _wait_models(agent.url)
    served: list[str] = []
    for n in range(16):
        async with _fresh() as client:
            got = await client.post(
                f"{agent.url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL, "messages": [{"role": "user", "content": f"q{n}"}],
                      "max_tokens": 1},
            )  # fmt: skip
        assert got.status_code in (200, 429), got.text
        if got.status_code == 200:
            served.append(got.headers["x-ratelimit-limit-requests"])
    assert served == ["2"] * 4


async def test_without_etcd_the_first_worker_runs_the_dry_run_autoscaler(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    """No election without etcd: worker 0 acts, its sibling stands by (each answers
    ``GET /admin/autoscaler`` for the connections the kernel gives it)."""
    agent = agent_process(
        sim_processes(1), workers=2, MERIDIAN_AGENT_AUTOSCALER__ACTUATOR="dry-run"
    )
    seen: set[tuple[bool, str | None]] = set()
    for _ in range(64):
        async with _fresh() as client:  # a new connection: either worker may take it
            got = await client.get(f"{agent.url}/admin/autoscaler", headers=ADMIN)
        assert got.status_code == 200, got.text
        seen.add((got.json()["acting"], got.json()["actor"]))
        if len(seen) == 2:
            break
    assert seen == {(True, None), (False, "w0")}


async def test_one_worker_runs_the_command_actuator_on_every_worker_s_queue(
    tmp_path: Path,
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    """An autoscaler that acts does so in worker 0 alone, and its load policy reads the
    requests waiting on every worker: one node with one slot holds a request, and the others
    wait in the queues of both workers."""
    (node,) = sim_processes(1, profile="h100-llama3-8b", time_scale=1.0)
    runs = tmp_path / "runs"
    command = ["sh", "-c", f"echo $PPID {{floor}} >> {runs}"]  # $PPID: the worker's pid
    agent = agent_process(
        [node],
        workers=2,
        MERIDIAN_AGENT_QUEUE__SLOTS_PER_NODE="1",
        MERIDIAN_AGENT_AUTOSCALER__ACTUATOR="command",
        MERIDIAN_AGENT_AUTOSCALER__COMMAND=json.dumps(command),
        MERIDIAN_AGENT_AUTOSCALER__INTERVAL_S="0.2",
        MERIDIAN_AGENT_AUTOSCALER__LOAD__POLICY="reactive",
        MERIDIAN_AGENT_AUTOSCALER__LOAD__SCALE_UP_QUEUE="2",
        MERIDIAN_AGENT_AUTOSCALER__LOAD__SCALE_DOWN_QUEUE="0",
        MERIDIAN_AGENT_AUTOSCALER__LOAD__SCALE_UP_QUEUE_FOR_S="0.4",
    )
    await _wait_models(agent.url)
    held: list[asyncio.Task[httpx.Response]] = []
    client = _fresh()
    try:
        waiting: dict[str, float] = {}
        for i in range(24):  # until both workers hold waiting requests (the kernel spreads them)
            held.append(asyncio.ensure_future(
                _chat(client, agent.url, f"wait {i}", max_tokens=2000, ignore_eos=True)
            ))  # fmt: skip
            await asyncio.sleep(0.1)
            waiting = _by_worker((await _metrics(agent.url))["meridian_agent_queue_depth"])
            if sum(waiting.values()) >= 4 and min(waiting.get(w, 0) for w in ("0", "1")) >= 1:
                break
        assert min(waiting.get(w, 0) for w in ("0", "1")) >= 1, waiting
        total = sum(waiting.values())
        seen: dict[str, Any] = {}
        for _ in range(100):
            async with _fresh() as fresh:  # a new connection: either worker may take it
                got = (await fresh.get(f"{agent.url}/admin/autoscaler", headers=ADMIN)).json()
            if got["acting"] and got["signals"] is not None:
                seen = got
                if got["signals"]["queue"] == total and got["load_target_nodes"] > 1:
                    break
            await asyncio.sleep(0.1)
        assert seen["signals"]["queue"] == total, (seen, waiting)  # every worker's queue
        assert seen["decision"] is not None and seen["load_target_nodes"] > 1, seen
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await client.aclose()
    lines = [line.split() for line in runs.read_text().splitlines()]
    assert {pid for pid, _ in lines} <= {str(p) for p in agent.workers()}, lines
    assert len({pid for pid, _ in lines}) == 1, f"more than one worker ran the command: {lines}"
    assert float(lines[-1][1]) > 1, lines  # the floor the summed queue asked for


async def test_an_admin_change_on_one_worker_is_made_on_every_worker(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    nodes = sim_processes(2, profile="h100-llama3-8b", time_scale=50.0)
    agent = agent_process(nodes, workers=2)
    await _wait_models(agent.url)
    drained = nodes[0].url.removeprefix("http://")
    async with _fresh() as client:
        reply = await client.post(f"{agent.url}/admin/nodes/{drained}/drain", headers=ADMIN)
        assert reply.status_code == 200
        assert "X-Meridian-Workers-Missed" not in reply.headers
        for secret in (b"not the secret", "\u00fc".encode()):  # a guess, and not even ASCII
            refused = await client.post(
                f"{agent.url}/admin/nodes/{drained}/undrain",
                headers={"X-Meridian-Worker-Secret": secret},  # type: ignore[dict-item]
            )
            assert refused.status_code == 401, refused.text
        for _ in range(10):  # each on a new connection: either worker answers
            listed = (await client.get(f"{agent.url}/admin/nodes", headers=ADMIN)).json()
            states = {n["id"]: n["admin"] for n in listed["nodes"]}
            assert states[drained] in ("draining", "drained"), states
        before = await _node_metric(nodes[0], "vllm:request_success_total")
        replies = await asyncio.gather(*(_chat(client, agent.url, f"q {i}") for i in range(20)))
    assert [r.status_code for r in replies] == [200] * 20
    assert await _node_metric(nodes[0], "vllm:request_success_total") == before
    assert agent.log_text().count("node draining") == 2  # once on each worker
    assert ADMIN_TOKEN not in agent.log_text()

    # changes made at once through both workers end the same on both
    node = nodes[1].url.removeprefix("http://")
    async with _fresh() as client:
        for _ in range(15):
            await asyncio.gather(
                *(
                    client.post(f"{agent.url}/admin/nodes/{node}/{action}", headers=ADMIN)
                    for action in ("drain", "undrain", "drain", "undrain")
                )
            )
            seen = set()
            for _ in range(8):
                listed = (await client.get(f"{agent.url}/admin/nodes", headers=ADMIN)).json()
                seen.add({n["id"]: n["admin"] for n in listed["nodes"]}[node])
            assert len(seen) == 1, f"the workers disagree on {node}: {seen}"
        await client.post(f"{agent.url}/admin/nodes/{node}/undrain", headers=ADMIN)

    # a worker killed and started again takes the drain from its sibling
    os.kill(sorted(agent.workers())[1], signal.SIGKILL)
    for _ in range(100):
        if "caught up from worker 0" in agent.log_text():
            break
        await asyncio.sleep(0.1)
    assert f"caught up from worker 0: draining {drained}" in agent.log_text()
    await _wait_models(agent.url)
    async with _fresh() as client:
        replies = await asyncio.gather(*(_chat(client, agent.url, f"r {i}") for i in range(20)))
    assert [r.status_code for r in replies] == [200] * 20
    assert await _node_metric(nodes[0], "vllm:request_success_total") == before


async def test_a_killed_worker_is_started_again_and_its_counts_are_cleared(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    """One node with one slot.  A worker is killed -9 while its request holds that slot: were
    its count left in the shared table, no request could be routed to the node again."""
    (node,) = sim_processes(1, profile="h100-llama3-8b", time_scale=0.5)
    agent = agent_process(
        [node],
        workers=2,
        MERIDIAN_AGENT_QUEUE__SLOTS_PER_NODE="1",
        MERIDIAN_AGENT_QUEUE__DEADLINE_S="20",
    )
    await _wait_models(agent.url)
    async with _fresh() as client:
        long = asyncio.ensure_future(_chat(client, agent.url, "a long one", max_tokens=2000))
        holder = None
        for _ in range(200):
            metrics = await _metrics(agent.url)
            busy = [
                labels["worker"]
                for labels, value in metrics.get("meridian_agent_node_in_flight", [])
                if value > 0
            ]
            if busy:
                holder = int(busy[0])
                break
            await asyncio.sleep(0.05)
        assert holder is not None, "the long request never showed in flight"
        for _ in range(8):  # either worker answers, with the node's load over both
            listed = (await client.get(f"{agent.url}/admin/nodes", headers=ADMIN)).json()
            assert [n["in_flight"] for n in listed["nodes"]] == [1], listed
        pids = sorted(agent.workers())  # forked in index order
        os.kill(pids[holder], signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            await long  # its worker died: the connection is gone
        # The kernel may close the dead worker's connection before its listening socket (fds
        # close in number order, and an accepted one can have the lower number): a connection
        # made meanwhile would land in that socket's queue and be reset with it.  Once the
        # supervisor has reaped the worker, every descriptor of it is closed.
        for _ in range(100):
            if f"worker {holder} was killed by SIGKILL" in agent.log_text():
                break
            await asyncio.sleep(0.02)
        started = time.monotonic()
        replies = [await _chat(client, agent.url, f"after {i}") for i in range(6)]
        assert [r.status_code for r in replies] == [200] * 6
        assert time.monotonic() - started < 15
    for _ in range(100):
        if len(agent.workers()) == 2 and agent.log_text().count("worker listening") == 3:
            break
        await asyncio.sleep(0.1)
    log = agent.log_text()
    assert f"worker {holder} was killed by SIGKILL" in log
    assert log.count("worker listening") == 3, log  # two at the start, one again
    exits = {
        (labels["worker"], labels["cause"]): value
        for labels, value in (await _metrics(agent.url))["meridian_agent_worker_exits_total"]
    }
    assert exits == {
        (str(w), cause): float(w == holder and cause == "signal")
        for w in (0, 1)
        for cause in ("signal", "status")
    }, exits


def test_sigterm_stops_every_worker_and_a_killed_supervisor_takes_them_along(
    sim_processes: Callable[..., list[SimProcess]],
    agent_process: Callable[..., AgentProcess],
) -> None:
    nodes = sim_processes(1, profile="h100-llama3-8b", time_scale=50.0)
    first = agent_process(nodes, workers=2)
    workers = first.workers()
    first.proc.send_signal(signal.SIGHUP)  # every worker reloads its keys; none dies of it
    deadline = time.monotonic() + 20
    while first.log_text().count("SIGHUP: reloading") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.log_text().count("SIGHUP: reloading") == 2, first.log_text()
    assert first.workers() == workers
    first.proc.terminate()
    assert first.proc.wait(timeout=30) == 0
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]

    second = agent_process(nodes, workers=2)
    workers = second.workers()
    second.proc.kill()
    second.proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not [pid for pid in workers if _alive(pid)], "workers outlived their supervisor"


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
