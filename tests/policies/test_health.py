"""policies.health: probe hysteresis, outlier ejection and probation, latency outliers, the
pool's ejection cap and slow start."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import health
from policies.model import AdminState, Health, NodeId, NodeView

H, P, E, U = Health.HEALTHY, Health.PROBATION, Health.EJECTED, Health.UNHEALTHY

CONFIG = health.HealthConfig(
    unhealthy_after=2,
    healthy_after=2,
    eject_consecutive_errors=5,
    eject_base_s=30.0,
    eject_max_s=300.0,
    max_ejected_fraction=0.5,
    latency_outlier_factor=3.0,
    latency_outlier_min_s=0.5,
    latency_min_samples=5,
    slow_start_s=30.0,
    latency_window=10,
)


def _node(config: health.HealthConfig = CONFIG, *, warm: bool = True) -> health.NodeHealth:
    return health.NodeHealth(NodeId("n1"), config, now=0.0, warm=warm)


def _apply(node: health.NodeHealth, event: str, now: float) -> list[health.Change]:
    if event == "probe+":
        return node.on_probe(True, now=now)
    if event == "probe-":
        return node.on_probe(False, now=now, detail="HTTP 503")
    if event == "ok":
        return node.on_result(True, ttft_s=0.1, now=now)
    if event == "fail":
        return node.on_result(False, ttft_s=None, now=now)
    if event == "tick":
        return node.tick(now)
    raise AssertionError(event)


def _fails(start: float, count: int) -> list[tuple[str, float, Health | None]]:
    """``count`` failed requests one second apart; only the last one's state is checked."""
    return [("fail", start + i, None) for i in range(count)]


# (event, now, expected state after it; None: not checked)
Script = list[tuple[str, float, Health | None]]

SCRIPTS: dict[str, tuple[Script, str]] = {
    "unhealthy after 2 failed probes": (
        [("probe-", 1, H), ("probe-", 2, U)],
        "2 consecutive failed probes (HTTP 503)",
    ),
    "a good probe resets the failure run": (
        [("probe-", 1, H), ("probe+", 2, H), ("probe-", 3, H)],
        "new node, healthy until probed",
    ),
    "back after 2 good probes": (
        [("probe-", 1, H), ("probe-", 2, U), ("probe+", 3, U), ("probe+", 4, H)],
        "2 consecutive good probes",
    ),
    "a failed probe resets the recovery run": (
        [("probe-", 1, H), ("probe-", 2, U), ("probe+", 3, U), ("probe-", 4, U), ("probe+", 5, U)],
        "2 consecutive failed probes (HTTP 503)",
    ),
    "4 failed requests keep the node in": (
        [*_fails(1, 4), ("tick", 5, H)],
        "new node, healthy until probed",
    ),
    "5 consecutive failed requests eject it for 30 s": (
        [*_fails(1, 5), ("tick", 5, E), ("tick", 34.9, E)],
        "5 consecutive failed requests; ejection #1 for 30 s",
    ),
    "a success breaks the run of failures": (
        [*_fails(1, 4), ("ok", 5, H), *_fails(6, 4), ("tick", 10, H)],
        "new node, healthy until probed",
    ),
    "after the ejection time: probation": (
        [*_fails(1, 5), ("tick", 35, P)],
        "ejection over after 30 s: half-open, one request at a time",
    ),
    "a success in probation: healthy": (
        [*_fails(1, 5), ("tick", 35, P), ("ok", 36, H)],
        "a request succeeded in probation",
    ),
    "probation without a tick: the result still counts as probation": (
        [*_fails(1, 5), ("ok", 36, H)],
        "a request succeeded in probation",
    ),
    "a failure in probation: ejected again for 60 s": (
        [*_fails(1, 5), ("fail", 40, E), ("tick", 99.9, E), ("tick", 100, P)],
        "ejection over after 60 s: half-open, one request at a time",
    ),
    "the third ejection lasts 90 s": (
        [*_fails(1, 5), ("fail", 40, E), ("fail", 100, E), ("tick", 189.9, E), ("tick", 190, P)],
        "ejection over after 90 s: half-open, one request at a time",
    ),
    "results from stragglers while ejected are ignored": (
        [*_fails(1, 5), ("ok", 6, E), ("fail", 7, E), ("tick", 35, P)],
        "ejection over after 30 s: half-open, one request at a time",
    ),
    "failed probes while ejected: unhealthy, back to ejected while the time runs": (
        [*_fails(1, 5), ("probe-", 6, E), ("probe-", 7, U), ("probe+", 8, U), ("probe+", 9, E)],
        "2 consecutive good probes",
    ),
    "probes back after the ejection time: probation, not healthy": (
        [*_fails(1, 5), ("probe-", 6, E), ("probe-", 7, U), ("probe+", 40, U), ("probe+", 41, P)],
        "2 consecutive good probes",
    ),
    "results while unhealthy are ignored": (
        [("probe-", 1, H), ("probe-", 2, U), *_fails(3, 10), ("probe+", 20, U), ("probe+", 21, H)],
        "2 consecutive good probes",
    ),
    "good probes do not end an ejection (gray failures pass /health)": (
        [*_fails(1, 5), ("probe+", 6, E), ("probe+", 7, E), ("probe+", 8, E)],
        "5 consecutive failed requests; ejection #1 for 30 s",
    ),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_transitions(name: str) -> None:
    script, reason = SCRIPTS[name]
    node = _node()
    for event, now, expected in script:
        _apply(node, event, now)
        if expected is not None:
            assert node.state(now) is expected, (event, now)
    last = script[-1][1]
    assert node.describe(last)["reason"] == reason


def test_changes_are_reported_once_with_their_reason() -> None:
    node = _node()
    changes = [c for i in range(5) for c in node.on_result(False, ttft_s=None, now=float(i))]
    assert [(c.before, c.after, c.reason) for c in changes] == [
        (H, E, "5 consecutive failed requests; ejection #1 for 30 s")
    ]
    assert node.tick(33.9) == []
    (timed,) = node.tick(36.0)
    assert (timed.before, timed.after, timed.at) == (E, P, 34.0)  # when the time was up
    assert node.tick(37.0) == []
    (back,) = node.on_result(True, ttft_s=0.2, now=38.0)
    assert (back.before, back.after, back.at) == (P, H, 38.0)


@pytest.mark.parametrize(
    ("base_s", "max_s", "ejections", "expected_s"),
    [
        (30.0, 300.0, 1, 30.0),
        (30.0, 300.0, 2, 60.0),
        (30.0, 300.0, 4, 120.0),
        (30.0, 300.0, 10, 300.0),
        (30.0, 300.0, 15, 300.0),  # capped
        (30.0, 50.0, 2, 50.0),
        (100.0, 50.0, 1, 50.0),  # a base longer than the cap is capped too
    ],
)
def test_ejection_time_grows_with_ejections_up_to_the_cap(
    base_s: float, max_s: float, ejections: int, expected_s: float
) -> None:
    config = health.HealthConfig(eject_base_s=base_s, eject_max_s=max_s, eject_consecutive_errors=1)
    node = _node(config)
    now = 0.0
    for _ in range(ejections):
        node.on_result(False, ttft_s=None, now=now)  # ejects: from healthy, or in probation
        assert node.state(now) is E
        view = node.describe(now)
        until = view["ejected_until"]
        assert isinstance(until, float)
        duration_s, now = until - now, until
    assert duration_s == pytest.approx(expected_s)
    assert str(view["reason"]).endswith(f"; ejection #{ejections} for {expected_s:g} s")
    assert node.ejections(now) == ejections


def test_one_ejection_is_forgiven_per_eject_max_s_of_health() -> None:
    config = health.HealthConfig(eject_base_s=10.0, eject_max_s=100.0, eject_consecutive_errors=1)
    node = _node(config)
    node.on_result(False, ttft_s=None, now=0.0)  # #1, 10 s
    node.on_result(False, ttft_s=None, now=10.0)  # probation fails: #2, 20 s
    node.on_result(True, ttft_s=0.1, now=30.0)  # healthy from 30
    assert node.ejections(129.0) == 2
    assert node.ejections(130.0) == 1
    assert node.ejections(1000.0) == 0
    node.on_result(False, ttft_s=None, now=130.0)
    assert node.describe(130.0)["reason"] == "1 consecutive failed requests; ejection #2 for 20 s"


# -- slow start --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("after_s", "expected"),
    [(0.0, 0.1), (15.0, 0.55), (29.0, 0.1 + 0.9 * 29 / 30), (30.0, 1.0), (300.0, 1.0)],
)
def test_slow_start_ramps_linearly_after_readmission(after_s: float, expected: float) -> None:
    node = _node()
    for event, now in [("probe-", 1), ("probe-", 2), ("probe+", 3), ("probe+", 10)]:
        _apply(node, event, now)
    assert node.slow_start(10.0 + after_s) == pytest.approx(expected)


@given(events=st.lists(st.tuples(st.sampled_from(["ok", "fail", "probe+", "probe-"]),
                                 st.floats(0.0, 20.0)), max_size=30),
       later=st.floats(0.0, 200.0))  # fmt: skip
def test_steady_until_is_when_state_or_share_could_first_change_by_itself(
    events: list[tuple[str, float]], later: float
) -> None:
    """Without news, ``state`` and ``slow_start`` keep their values from ``now`` until just
    before ``steady_until(now)`` (the pool caches views by it)."""
    node = _node(warm=False)
    now = 0.0
    for event, dt in events:
        now += dt
        if event in ("ok", "fail"):
            node.on_result(event == "ok", ttft_s=0.1 if event == "ok" else None, now=now)
        else:
            _apply(node, event, now)
    until = node.steady_until(now)
    assert until >= now
    if until > now:
        t = min(now + later, until - 1e-6) if math.isfinite(until) else now + later
        assert (node.state(t), node.slow_start(t)) == (node.state(now), node.slow_start(now))


def test_steady_until_names_the_ejection_end_and_the_ramp() -> None:
    node = _node()
    assert node.steady_until(0.0) == math.inf  # healthy and warm
    for i in range(5):
        node.on_result(False, ttft_s=None, now=float(i))
    assert node.state(10.0) is Health.EJECTED
    ends = node.steady_until(10.0)
    assert ends > 10.0 and node.state(ends) is Health.PROBATION
    node.on_result(True, ttft_s=0.1, now=40.0)
    assert node.steady_until(41.0) == 41.0  # ramping: changes continuously
    assert node.steady_until(100.0) == math.inf


def test_slow_start_after_probation() -> None:
    node = _node()
    for i in range(5):
        node.on_result(False, ttft_s=None, now=float(i))
    assert node.slow_start(10.0) == 0.1  # ejected: the floor
    assert node.slow_start(40.0) == 0.1  # probation: the floor (and routing gives it one slot)
    node.on_result(True, ttft_s=0.1, now=40.0)
    assert node.slow_start(40.0) == pytest.approx(0.1)
    assert node.slow_start(55.0) == pytest.approx(0.55)
    assert node.slow_start(70.0) == 1.0


@pytest.mark.parametrize(
    ("warm", "slow_start_s", "at", "expected"),
    [
        (True, 30.0, 0.0, 1.0),  # healthy at agent start-up: no ramp
        (True, 30.0, 5.0, 1.0),
        (False, 30.0, 0.0, 0.1),  # added to a running agent: ramps from first sight
        (False, 30.0, 15.0, 0.55),
        (False, 0.0, 0.0, 1.0),  # slow start off
    ],
)
def test_slow_start_at_first_sight(
    warm: bool, slow_start_s: float, at: float, expected: float
) -> None:
    node = _node(health.HealthConfig(slow_start_s=slow_start_s), warm=warm)
    node.on_probe(True, now=at)
    assert node.slow_start(at) == pytest.approx(expected)


# -- pool-level functions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pool_size", "fraction", "limit"),
    [
        (0, 0.5, 0),
        (1, 0.5, 1),  # at least one, as Envoy
        (2, 0.5, 1),
        (3, 0.0, 1),
        (10, 0.1, 1),
        (20, 0.1, 2),
        (10, 0.5, 5),
        (100, 0.29, 29),  # not 28 from 28.999999999999996
        (7, 1.0, 7),
    ],
)
def test_ejection_limit(pool_size: int, fraction: float, limit: int) -> None:
    assert health.ejection_limit(pool_size, max_fraction=fraction) == limit


@pytest.mark.parametrize(
    ("states", "fraction", "allowed"),
    [
        ([H, H], 0.5, True),
        ([E, H], 0.5, False),
        ([E, H, H, H], 0.5, True),
        ([E, E, H, H], 0.5, False),
        ([U, U, H, H], 0.5, True),  # unhealthy nodes do not use the cap
        ([P, H], 0.5, True),  # nor do nodes on probation
        ([H], 0.1, True),  # one node may always be ejected
        ([E, H, H, H, H, H, H, H, H, H], 0.1, False),
    ],
)
def test_may_eject(states: list[Health], fraction: float, allowed: bool) -> None:
    assert health.may_eject(states, max_fraction=fraction) is allowed


def _ids(values: list[float]) -> dict[NodeId, float]:
    return {NodeId(f"n{i}"): v for i, v in enumerate(values)}


@pytest.mark.parametrize(
    ("values", "outliers"),
    [
        ([0.2, 0.2, 0.25, 1.5], ["n3"]),
        ([0.2, 0.2, 0.25, 0.6], []),  # 3x is not exceeded
        ([0.05, 0.05, 0.05, 0.45], []),  # 9x, but below latency_outlier_min_s
        ([0.2, 2.0], []),  # one peer only: cannot tell slow from different hardware
        ([0.2, 0.3, 2.0], ["n2"]),
        ([0.2, 0.2, 0.2, 0.2, 1.0, 3.0], ["n5", "n4"]),  # worst first
        ([1.0, 1.0, 1.0, 1.0], []),
        ([0.0, 0.0, 0.7], ["n2"]),
    ],
)
def test_detect_latency_outliers(values: list[float], outliers: list[str]) -> None:
    found = health.detect_latency_outliers(_ids(values), config=CONFIG)
    assert [o.node_id for o in found] == outliers
    assert all(o.reason.startswith("latency outlier") for o in found)


# -- the tracker: the cap and the latency comparison -------------------------------------------


def _tracker(n: int, config: health.HealthConfig = CONFIG) -> health.Tracker:
    tracker = health.Tracker(config)
    for i in range(n):
        tracker.track(NodeId(f"n{i}"), now=0.0, warm=True)
    return tracker


def test_cap_keeps_the_second_of_two_nodes_in() -> None:
    tracker = _tracker(2)
    a, b = NodeId("n0"), NodeId("n1")
    for i in range(5):
        tracker.on_result(a, False, ttft_s=None, now=float(i))
    assert tracker.ejected(now=5.0) == 1
    notes = [c for i in range(7) for c in tracker.on_result(b, False, ttft_s=None, now=5.0 + i)]
    node_b = tracker.get(b)
    assert node_b is not None and node_b.state(12.0) is H
    assert len(notes) == 1 and not notes[0].changed  # refused once, reported once
    assert notes[0].reason == "5 consecutive failed requests; kept in: the ejection cap is reached"
    assert node_b.describe(12.0)["reason"] == notes[0].reason
    # a's time is up (probation does not use the cap): b's next failure ejects it
    (change,) = tracker.on_result(b, False, ttft_s=None, now=40.0)
    assert (change.before, change.after) == (H, E)
    assert node_b.state(40.0) is E


def test_cap_holds_a_failed_probation_node_in_probation() -> None:
    tracker = _tracker(2, health.HealthConfig(eject_consecutive_errors=1))
    a, b = NodeId("n0"), NodeId("n1")
    tracker.on_result(a, False, ttft_s=None, now=0.0)  # a: ejected until 30
    tracker.on_result(b, False, ttft_s=None, now=29.0)  # b: refused (a is ejected)
    tracker.on_result(a, True, ttft_s=0.1, now=31.0)  # a: healthy again
    tracker.on_result(b, False, ttft_s=None, now=31.0)  # b: ejected until 61
    tracker.on_result(a, False, ttft_s=None, now=32.0)  # a: refused
    node_a = tracker.get(a)
    assert node_a is not None and node_a.state(32.0) is H
    assert tracker.evaluate(now=61.0)[0].after is P  # b on probation: a place is free
    tracker.on_result(a, False, ttft_s=None, now=62.0)  # a: ejected (#2, 60 s)
    assert node_a.state(62.0) is E
    tracker.on_result(b, False, ttft_s=None, now=63.0)  # b fails in probation: cap full
    node_b = tracker.get(b)
    assert node_b is not None and node_b.state(63.0) is P
    assert "kept in: the ejection cap is reached" in str(node_b.describe(63.0)["reason"])


def _feed(tracker: health.Tracker, ttfts: dict[str, float], *, now: float, count: int) -> None:
    for node_id, ttft in ttfts.items():
        for _ in range(count):
            tracker.on_result(NodeId(node_id), True, ttft_s=ttft, now=now)


def test_latency_outlier_is_ejected_and_judged_afresh_after() -> None:
    tracker = _tracker(4)
    _feed(tracker, {"n0": 0.2, "n1": 0.25, "n2": 0.2, "n3": 2.0}, now=1.0, count=4)
    assert tracker.evaluate(now=1.0) == []  # 4 samples each: fewer than latency_min_samples
    _feed(tracker, {"n0": 0.2, "n1": 0.25, "n2": 0.2, "n3": 2.0}, now=2.0, count=1)
    (change,) = tracker.evaluate(now=2.0)
    assert (change.node_id, change.before, change.after) == ("n3", H, E)
    assert change.reason.startswith("latency outlier")
    slow = tracker.get(NodeId("n3"))
    assert slow is not None and slow.ttft_s() is None  # samples dropped
    assert slow.describe(2.0)["ttft_samples"] == 0
    # back on probation, one fast success: healthy; too few samples to be judged again
    _feed(tracker, {"n3": 0.2}, now=40.0, count=1)
    assert slow.state(40.0) is H
    assert tracker.evaluate(now=40.0) == []


def test_latency_outliers_respect_the_cap_worst_first() -> None:
    times = {"n0": 0.2, "n1": 0.2, "n2": 1.0, "n3": 3.0}  # n2: 5x, n3: 15x their peers' median
    tracker = _tracker(4)  # fraction 0.5: two of four may go
    _feed(tracker, times, now=1.0, count=5)
    assert [(c.node_id, c.after, c.changed) for c in tracker.evaluate(now=1.0)] == [
        ("n3", E, True),
        ("n2", E, True),
    ]
    capped = _tracker(4, dataclasses.replace(CONFIG, max_ejected_fraction=0.25))  # one may go
    _feed(capped, times, now=1.0, count=5)
    changes = capped.evaluate(now=1.0)
    assert [(c.node_id, c.after, c.changed) for c in changes] == [
        ("n3", E, True),  # the worst goes
        ("n2", H, False),  # the milder one stays in, said once
    ]
    assert changes[1].reason.startswith("latency outlier")
    assert changes[1].reason.endswith("kept in: the ejection cap is reached")
    assert capped.evaluate(now=2.0) == []  # not said again
    # n2 is judged against n0 and n1 only now (n3 left the comparison): still slow, still capped
    node = capped.get(NodeId("n2"))
    assert node is not None and node.state(2.0) is H


def test_a_slow_node_with_one_peer_is_not_judged() -> None:
    tracker = _tracker(3)
    _feed(tracker, {"n0": 0.2, "n1": 3.0}, now=1.0, count=5)  # n2 has no samples
    assert tracker.evaluate(now=1.0) == []


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="unhealthy_after"):
        health.HealthConfig(unhealthy_after=0)
    with pytest.raises(ValueError, match="max_ejected_fraction"):
        health.HealthConfig(max_ejected_fraction=1.5)
    with pytest.raises(ValueError, match="latency_outlier_factor"):
        health.HealthConfig(latency_outlier_factor=1.0)


# -- invariants --------------------------------------------------------------------------------

_EVENTS = st.tuples(
    st.sampled_from(["probe+", "probe-", "ok", "fail", "evaluate"]),
    st.integers(min_value=0, max_value=7),  # node index (modulo the pool size)
    st.floats(min_value=0.0, max_value=5.0),  # ttft_s
    st.floats(min_value=0.0, max_value=40.0),  # seconds since the previous event
)


@settings(max_examples=300, deadline=None)
@given(
    pool_size=st.integers(min_value=1, max_value=8),
    fraction=st.floats(min_value=0.0, max_value=1.0),
    errors=st.integers(min_value=1, max_value=4),
    base_s=st.floats(min_value=0.5, max_value=60.0),
    max_s=st.floats(min_value=0.5, max_value=120.0),
    slow_start_s=st.floats(min_value=0.0, max_value=60.0),
    events=st.lists(_EVENTS, max_size=120),
)
def test_invariants(
    pool_size: int,
    fraction: float,
    errors: int,
    base_s: float,
    max_s: float,
    slow_start_s: float,
    events: list[tuple[str, int, float, float]],
) -> None:
    config = health.HealthConfig(
        unhealthy_after=2,
        healthy_after=2,
        eject_consecutive_errors=errors,
        eject_base_s=base_s,
        eject_max_s=max_s,
        max_ejected_fraction=fraction,
        latency_min_samples=3,
        latency_min_peers=1,
        slow_start_s=slow_start_s,
    )
    tracker = _tracker(pool_size, config)
    limit = max(1, math.floor(fraction * pool_size + 1e-9))
    now = 0.0
    for kind, index, ttft_s, dt in events:
        now += dt
        node_id = NodeId(f"n{index % pool_size}")
        if kind == "probe+":
            changes = tracker.on_probe(node_id, True, now=now)
        elif kind == "probe-":
            changes = tracker.on_probe(node_id, False, now=now)
        elif kind == "ok":
            changes = tracker.on_result(node_id, True, ttft_s=ttft_s, now=now)
        elif kind == "fail":
            changes = tracker.on_result(node_id, False, ttft_s=None, now=now)
        else:
            changes = tracker.evaluate(now=now)
        for change in changes:
            assert change.node_id in tracker
            assert isinstance(change.reason, str) and change.reason
        assert tracker.ejected(now=now) <= limit
        assert tracker.ejected(now=now) <= max(1, fraction * pool_size + 1e-9)
        for node in tracker:
            state = node.state(now)
            assert state in (H, P, E, U)
            assert 0.0 < node.slow_start(now) <= 1.0
            view = node.describe(now)
            assert view["state"] == state.value
            until = view["ejected_until"]
            if state is E:
                assert isinstance(until, float)
                assert now < until <= now + max_s
                assert until - float(view["since"]) <= max_s + 1e-9  # type: ignore[arg-type]


# -- panic -------------------------------------------------------------------------------------

ACTIVE, DRAINING = AdminState.ACTIVE, AdminState.DRAINING


def _views(*nodes: tuple[AdminState, Health]) -> list[NodeView]:
    return [
        NodeView(
            node_id=NodeId(f"n{i}"),
            models=frozenset({"m"}),
            admin=admin,
            health=state,
            slow_start=health.SLOW_START_FLOOR if state is not H else 1.0,
        )
        for i, (admin, state) in enumerate(nodes)
    ]


@pytest.mark.parametrize(
    ("nodes", "threshold", "active"),
    [
        ([(ACTIVE, H)] * 8, 0.5, False),
        ([(ACTIVE, H)] * 4 + [(ACTIVE, U)] * 4, 0.5, False),  # exactly half: no panic
        ([(ACTIVE, H)] * 3 + [(ACTIVE, U)] * 5, 0.5, True),
        ([(ACTIVE, H)] + [(ACTIVE, U)] * 7, 0.5, True),  # the benchmark: 7 of 8 unhealthy
        ([(ACTIVE, U)] * 8, 0.5, True),
        ([(ACTIVE, U)] * 8, 0.0, False),  # 0 turns panic off
        ([(ACTIVE, P), (ACTIVE, E)], 0.5, True),  # probation is one slot, no capacity
        ([(ACTIVE, H), (ACTIVE, P)], 0.5, False),  # half healthy: no panic
        ([(ACTIVE, H)] + [(ACTIVE, P)] * 3, 0.5, True),  # a blip put most on probation
        ([(ACTIVE, E)] * 3 + [(ACTIVE, H)], 0.5, True),  # ejected is not
        ([(ACTIVE, H)] * 2 + [(DRAINING, U)] * 6, 0.5, False),  # draining nodes do not count
        ([(DRAINING, H)] * 3, 0.5, False),  # no active node: nothing to panic over
        ([], 0.5, False),
        ([(ACTIVE, H)] * 7 + [(ACTIVE, U)] * 3, 0.71, True),  # Envoy's ~71 %
        ([(ACTIVE, H)] * 71 + [(ACTIVE, U)] * 29, 0.71, False),  # 71 of 100 is not below 71 %
        ([(ACTIVE, H)] * 2, 1.0, False),
        ([(ACTIVE, H), (ACTIVE, U)], 1.0, True),
    ],
)
def test_panic(nodes: list[tuple[AdminState, Health]], threshold: float, active: bool) -> None:
    decision = health.panic(_views(*nodes), threshold=threshold)
    assert decision.active is active
    assert decision.eligible == sum(1 for admin, _ in nodes if admin is ACTIVE)
    assert decision.reason.startswith("panic" if active else "no panic")


def test_routing_views_in_panic_show_active_nodes_healthy_and_keep_drained_out() -> None:
    views = _views((ACTIVE, H), (ACTIVE, U), (ACTIVE, E), (ACTIVE, P), (DRAINING, U))
    decision = health.panic(views, threshold=0.6)
    assert decision.active and decision.routable == 1 and decision.eligible == 4  # healthy ones
    routed = health.routing_views(views, decision)
    assert [v.health for v in routed] == [H, H, H, H, U]
    assert [v.routable for v in routed] == [True, True, True, True, False]
    assert all(v.slow_start == 1.0 and v.has_slot for v in routed[:4])
    assert routed[0] is views[0] and routed[4] is views[4]


def test_routing_views_without_panic_are_unchanged() -> None:
    views = _views((ACTIVE, H), (ACTIVE, U))
    decision = health.panic(views, threshold=0.5)
    assert not decision.active
    assert health.routing_views(views, decision) == views


def test_panic_threshold_is_validated() -> None:
    with pytest.raises(ValueError, match="panic_threshold"):
        health.HealthConfig(panic_threshold=1.5)
    with pytest.raises(ValueError, match="panic_threshold"):
        health.HealthConfig(panic_threshold=-0.1)


@given(
    nodes=st.lists(
        st.tuples(st.sampled_from([ACTIVE, DRAINING]), st.sampled_from([H, P, E, U])),
        max_size=20,
    ),
    threshold=st.floats(min_value=0.0, max_value=1.0),
)
def test_panic_invariants(nodes: list[tuple[AdminState, Health]], threshold: float) -> None:
    views = _views(*nodes)
    decision = health.panic(views, threshold=threshold)
    routed = health.routing_views(views, decision)
    assert [v.node_id for v in routed] == [v.node_id for v in views]
    for before, after in zip(views, routed, strict=True):
        if before.admin is DRAINING:  # never routed to, panic or not
            assert not after.routable
        if before.routable:
            assert after.routable
    if decision.active:  # every active node may take requests
        assert all(v.routable for v in routed if v.admin is ACTIVE)
        assert decision.routable < threshold * decision.eligible
    elif decision.eligible and threshold > 0:
        # within the verdict's rounding tolerance, which is on the share, not the count
        assert decision.routable / decision.eligible + 1e-9 >= threshold
