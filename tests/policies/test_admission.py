"""policies.admission: priorities, anti-starvation ordering, depth limit, retry budget."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import admission


@pytest.mark.parametrize(
    ("header", "tenant", "expected"),
    [
        ("high", None, 0),
        ("HIGH ", None, 0),
        ("normal", None, 1),
        ("low", None, 2),
        ("2", None, 2),
        (None, "batch-team", 2),
        (None, "unknown-tenant", 1),
        ("high", "batch-team", 0),  # the header wins
        (None, None, 1),
        ("", None, 1),
    ],
)
def test_parse_priority(header: str | None, tenant: str | None, expected: int) -> None:
    classes = {"batch-team": "low"}
    assert admission.parse_priority(header, tenant=tenant, tenant_classes=classes) == expected


@pytest.mark.parametrize("header", ["urgent", "7", "-1"])
def test_unknown_priority_is_an_error_that_lists_the_classes(header: str) -> None:
    with pytest.raises(admission.PriorityError, match="high"):
        admission.parse_priority(header, tenant_classes={})


def test_tenant_with_a_bad_class_is_an_error() -> None:
    with pytest.raises(admission.PriorityError, match="vip"):
        admission.parse_priority(None, tenant="t", tenant_classes={"t": "vip"})


def test_order_is_priority_then_arrival_and_waiting_promotes() -> None:
    low = admission.Waiting(seq=0, priority=2, enqueued_s=0.0)
    normal = admission.Waiting(seq=1, priority=1, enqueued_s=5.0)
    high = admission.Waiting(seq=2, priority=0, enqueued_s=9.0)
    assert admission.order([low, normal, high], now=9.0, max_wait_low_s=10) == [high, normal, low]
    # after 10 s the low one counts as normal and, being older, goes before `normal`
    assert admission.order([low, normal, high], now=10.0, max_wait_low_s=10) == [high, low, normal]
    # after 20 s it is as urgent as anything and the oldest
    assert admission.order([low, normal, high], now=20.0, max_wait_low_s=10)[0] == low


@given(
    st.lists(st.tuples(st.integers(0, 2), st.floats(0, 100)), min_size=1, max_size=30),
    st.floats(0.1, 30),
)
def test_nothing_waits_forever(items: list[tuple[int, float]], max_wait: float) -> None:
    """Once a request has waited 2 * max_wait_low_s it is never behind a newer request."""
    items = sorted(items, key=lambda x: x[1])  # arrival order: seq grows with time
    waiting = [admission.Waiting(seq=i, priority=p, enqueued_s=t) for i, (p, t) in enumerate(items)]
    oldest = min(waiting, key=lambda w: (w.enqueued_s, w.seq))
    now = oldest.enqueued_s + 2 * max_wait + 1e-6
    ordered = admission.order(waiting, now=now, max_wait_low_s=max_wait)
    ahead = ordered[: ordered.index(oldest)]
    assert all(w.enqueued_s <= oldest.enqueued_s for w in ahead)


def test_admit_depth() -> None:
    assert admission.admit(0, max_depth=1)
    assert not admission.admit(1, max_depth=1)
    assert not admission.admit(0, max_depth=0)


def test_retry_budget_allows_a_fraction_plus_a_floor() -> None:
    budget = admission.RetryBudget(ratio=0.1, min_per_s=1.0)
    assert budget.try_spend(now=0.0)  # one second's worth at start
    assert not budget.try_spend(now=0.0)
    for _ in range(10):
        budget.on_request(now=0.0)  # ten requests deposit one retry
    assert budget.try_spend(now=0.0)
    assert not budget.try_spend(now=0.0)
    assert budget.try_spend(now=1.0)  # the floor refills one per second
    assert not budget.try_spend(now=1.0)


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 0.5)), max_size=200))
def test_retries_never_exceed_the_budget(events: list[tuple[bool, float]]) -> None:
    ratio, floor = 0.2, 2.0
    budget = admission.RetryBudget(ratio=ratio, min_per_s=floor)
    now = 0.0
    requests = retries = 0
    for is_request, gap in events:
        now += gap
        if is_request:
            requests += 1
            budget.on_request(now=now)
        elif budget.try_spend(now=now):
            retries += 1
    assert retries <= ratio * requests + floor * (now + 1) + 1e-9


def test_a_full_queue_sheds_the_newest_of_the_lowest_class_below_the_newcomer() -> None:
    waiting = [
        admission.Waiting(seq=0, priority=2, enqueued_s=0.0),
        admission.Waiting(seq=1, priority=1, enqueued_s=1.0),
        admission.Waiting(seq=2, priority=2, enqueued_s=2.0),
        admission.Waiting(seq=3, priority=1, enqueued_s=3.0),
    ]

    def victim(priority: int, now: float = 3.0) -> int | None:
        item = admission.make_room(waiting, priority=priority, now=now, max_wait_low_s=10)
        return None if item is None else item.seq

    assert victim(0) == 2  # high: the newest low one goes
    assert victim(1) == 2  # normal: a low one too
    assert victim(2) is None  # low: nobody below it, so the newcomer is refused
    # after 10 s of waiting the low ones count as normal: a normal newcomer sheds none of them
    assert victim(1, now=12.5) is None
    assert victim(0, now=12.5) == 3  # high sheds the newest of those that count as normal


@given(
    st.lists(st.tuples(st.integers(0, 2), st.floats(0, 50)), max_size=30),
    st.integers(0, 2),
    st.floats(50, 80),
)
def test_shedding_never_takes_an_equal_or_higher_class(
    items: list[tuple[int, float]], priority: int, now: float
) -> None:
    waiting = [admission.Waiting(seq=i, priority=p, enqueued_s=t) for i, (p, t) in enumerate(items)]

    def rank(w: admission.Waiting) -> int:
        return admission.effective_priority(w, now=now, max_wait_low_s=10)

    shed = admission.make_room(waiting, priority=priority, now=now, max_wait_low_s=10)
    below = [w for w in waiting if rank(w) > priority]
    if not below:
        assert shed is None
        return
    assert shed is not None and rank(shed) > priority
    lowest = max(rank(w) for w in below)
    assert rank(shed) == lowest
    assert shed.seq == max(w.seq for w in below if rank(w) == lowest)
