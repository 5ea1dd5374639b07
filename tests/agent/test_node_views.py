"""The pool's views are kept between requests (regional_agent.nodes): whatever happens, what
``views`` answers equals views built afresh at that instant, except ``telemetry.age_s``, which is
the sample's age when the view was built."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from policies import health
from policies.model import Health, NodeId, NodeView, Telemetry
from regional_agent.nodes import Node, NodePool
from regional_agent.workers.shared import LoadShare, LoadTable

NODES = [NodeId(f"n{i}") for i in range(4)]
STALE_S = 2.0
RAMP_S = 5.0


class Sources:
    """Health and telemetry whose answers change with time the way the real ones do: an
    ejection that ends, a slow-start ramp, a sample that goes stale; every other change is
    announced with ``pool.notify()``, as the health monitor and the scraper do."""

    def __init__(self) -> None:
        self.ejected_until: dict[NodeId, float] = {}
        self.ramp_from: dict[NodeId, float] = {}
        self.sample: dict[NodeId, tuple[float, int]] = {}  # taken at, waiting

    def state(self, node_id: NodeId, *, now: float) -> Health:
        until = self.ejected_until.get(node_id)
        if until is None:
            return Health.HEALTHY
        return Health.EJECTED if now < until else Health.PROBATION

    def slow_start(self, node_id: NodeId, *, now: float) -> float:
        start = self.ramp_from.get(node_id)
        if start is None or self.state(node_id, now=now) is not Health.HEALTHY:
            return 1.0 if start is None else 0.1
        return 0.1 + 0.9 * min(1.0, max(0.0, (now - start) / RAMP_S))

    def steady_until(self, node_id: NodeId, *, now: float) -> float:
        if self.state(node_id, now=now) is Health.EJECTED:
            return self.ejected_until[node_id]
        start = self.ramp_from.get(node_id)
        if start is not None and now < start + RAMP_S:
            return now
        return math.inf

    def snapshot(self, node_id: NodeId, *, now: float) -> Telemetry | None:
        got = self.sample.get(node_id)
        if got is None or now - got[0] > STALE_S:
            return None
        return Telemetry(
            age_s=now - got[0], running=0, waiting=got[1], kv_util=0.5, prefix_hit_rate=None,
            block_size=16,
        )  # fmt: skip

    def fresh_until(self, node_id: NodeId) -> float:
        got = self.sample.get(node_id)
        return math.inf if got is None else got[0] + STALE_S


def _fresh(pool: NodePool, now: float) -> list[NodeView]:
    return [_no_age(pool.view(n, now=now)) for n in pool]


def _no_age(view: NodeView) -> NodeView:
    if view.telemetry is None:
        return view
    return dataclasses.replace(view, telemetry=dataclasses.replace(view.telemetry, age_s=0.0))


op = st.one_of(
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    st.tuples(st.just("acquire"), st.sampled_from(NODES), st.integers(1, 500)),
    st.tuples(st.just("first_token"), st.sampled_from(NODES)),
    st.tuples(st.just("release"), st.sampled_from(NODES)),
    st.tuples(st.just("eject"), st.sampled_from(NODES), st.floats(0.1, 4.0)),
    st.tuples(st.just("ramp"), st.sampled_from(NODES)),
    st.tuples(st.just("scrape"), st.sampled_from(NODES), st.integers(0, 9)),
    st.tuples(st.just("weight"), st.sampled_from(NODES), st.floats(0.5, 4.0)),
    st.tuples(st.just("add_remove"), st.sampled_from(NODES)),
    st.tuples(st.just("observe")),  # the status, the publisher, the autoscaler read the pool
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(op, st.booleans()), max_size=60), st.sampled_from([0.0, 0.6]))
def test_cached_views_equal_fresh_ones_after_any_sequence_of_changes(
    ops: list[tuple[tuple, bool]], panic_threshold: float
) -> None:
    """After any changes, read after each or after several (a node's moves between two
    reads are redone at the read), the kept views are the fresh ones."""
    pool = NodePool(panic_threshold=panic_threshold)
    sources = Sources()
    pool.health = sources
    pool.telemetry = sources
    for node_id in NODES:
        pool.add(Node(node_id=node_id, url=f"http://{node_id}", models=frozenset({"m"})))
    now = 0.0
    held: dict[NodeId, list[tuple[int, int]]] = {n: [] for n in NODES}  # tokens, prefill left
    for number, (step, read) in enumerate(ops):
        kind = step[0]
        if kind == "tick":
            now += step[1]
        elif kind == "acquire" and step[1] in pool:
            pool.acquire(step[1], tokens=step[2], prefill=step[2] // 2)
            held[step[1]].append((step[2], step[2] // 2))
        elif kind == "first_token" and held[step[1]] and step[1] in pool:
            tokens, prefill = held[step[1]].pop()
            pool.first_token(step[1], prefill=prefill)
            held[step[1]].append((tokens, 0))
        elif kind == "release" and held[step[1]]:
            tokens, prefill = held[step[1]].pop()
            pool.release(step[1], tokens=tokens, failed=False, prefill=prefill)
        elif kind == "eject":
            sources.ejected_until[step[1]] = now + step[2]
            pool.notify()
        elif kind == "ramp":
            sources.ejected_until.pop(step[1], None)
            sources.ramp_from[step[1]] = now
            pool.notify()
        elif kind == "scrape":
            sources.sample[step[1]] = (now, step[2])
            pool.notify()
        elif kind == "weight" and (node := pool.get(step[1])) is not None:
            node.weight = step[2]
            pool.notify()
        elif kind == "observe":
            pool.serving(now=now)
        elif kind == "add_remove":
            if step[1] in pool:
                pool.remove(step[1])
                held[step[1]] = []
            else:
                pool.add(Node(node_id=step[1], url=f"http://{step[1]}", models=frozenset({"m"})))
        if not read and number < len(ops) - 1:
            continue
        fresh = _fresh(pool, now)
        expected = health.routing_views(fresh, health.panic(fresh, threshold=panic_threshold))
        got = pool.views(now=now)
        assert [_no_age(v) for v in got] == expected, step
        assert got.by_id == {v.node_id: v for v in got}
        assert [_no_age(v) for v in pool.observed(now=now)] == fresh


def test_views_are_not_rebuilt_while_nothing_changes() -> None:
    pool = NodePool()
    pool.add(Node(node_id=NodeId("a"), url="http://a", models=frozenset({"m"})))
    pool.add(Node(node_id=NodeId("b"), url="http://b", models=frozenset({"m"})))
    first = pool.views(now=1.0)
    assert pool.views(now=2.0) is first  # the same list: nothing was rebuilt
    a_before, b_before = first
    pool.acquire(NodeId("a"), tokens=10)
    a_after, b_after = pool.views(now=3.0)
    assert b_after is b_before  # only the node whose accounting moved was rebuilt
    assert a_after is not a_before and a_after.in_flight == 1


def test_in_panic_a_view_rebuilt_for_its_accounting_is_still_shown_healthy() -> None:
    pool = NodePool(panic_threshold=0.6)
    sources = Sources()
    pool.health = sources
    pool.telemetry = sources
    for node_id in NODES:
        pool.add(Node(node_id=node_id, url=f"http://{node_id}", models=frozenset({"m"})))
    sources.ejected_until.update({NODES[0]: 5.0, NODES[1]: 5.0})
    pool.notify()
    assert all(v.health is Health.HEALTHY for v in pool.views(now=1.0))  # 2 of 4: panic
    pool.acquire(NODES[0], tokens=5)
    patched = pool.views(now=1.0)
    assert patched.by_id[NODES[0]].health is Health.HEALTHY and patched[0].in_flight == 1
    assert pool.views(now=6.0).by_id[NODES[0]].health is Health.HEALTHY  # probation, in panic
    assert pool.observed(now=6.0)[0].health is Health.PROBATION


def test_with_workers_a_completion_shows_in_the_view_at_once(tmp_path: Path) -> None:
    """With a shared load table the view is redone from the workers' totals: after this
    worker's completion the node has its slot back (it was full) and its prefill gone."""
    table = LoadTable(workers=2, slots=8)
    pool = NodePool()
    pool.shared = LoadShare(table, worker=0, lock_file=tmp_path / "lock")
    node_id = NodeId("a")
    pool.add(Node(node_id=node_id, url="http://a", models=frozenset({"m"}), slots=1))
    assert pool.views(now=0.0)[0].has_slot
    assert pool.acquire(node_id, tokens=10, prefill=5)
    assert not pool.views(now=0.0)[0].has_slot
    pool.first_token(node_id, prefill=5)
    assert pool.views(now=0.0)[0].prefill_tokens == 0
    pool.release(node_id, tokens=10, failed=False)
    view = pool.views(now=0.0)[0]
    assert (view.in_flight, view.in_flight_tokens, view.has_slot) == (0, 0, True)
    assert pool.observed(now=0.0)[0].in_flight == 0


def test_a_view_rebuilt_by_a_status_read_is_rebuilt_for_routing_too() -> None:
    """The status, the publisher and the autoscaler read ``observed``/``serving``; a view whose
    time came and that such a read rebuilt (an ejection ended) is rebuilt for routing too."""
    pool = NodePool()
    sources = Sources()
    pool.health = sources
    pool.telemetry = sources
    for node_id in NODES[:2]:
        pool.add(Node(node_id=node_id, url=f"http://{node_id}", models=frozenset({"m"})))
    sources.ejected_until[NODES[0]] = 5.0
    pool.notify()
    assert pool.views(now=1.0).by_id[NODES[0]].health is Health.EJECTED
    assert [v.node_id for v in pool.serving(now=6.0)] == [NODES[1]]  # A on probation now
    assert pool.views(now=7.0).by_id[NODES[0]].health is Health.PROBATION
