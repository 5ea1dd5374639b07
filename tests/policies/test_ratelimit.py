"""policies.ratelimit: the sliding window, admission and settlement, replica shares, durations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import ratelimit
from policies.ratelimit import Limiter, Limits, Ticket, Window

W = ratelimit.WINDOW_S

# One step of a client: wait dt seconds, then ask for `tokens`; `settle_with` is the fraction of
# its reservation an earlier admitted request really used (above 1: more than it reserved).
steps = st.lists(
    st.tuples(
        st.floats(0, 25, allow_nan=False),  # dt
        st.integers(0, 400),  # tokens asked
        st.booleans(),  # settle the oldest open ticket now?
        st.floats(0, 3, allow_nan=False),  # what it used, as a fraction of its reservation
    ),
    min_size=1,
    max_size=80,
)


def _max_in_any_window(ledger: list[tuple[float, int]]) -> int:
    """The most any window (t - W, t] holds; windows ending at an entry are enough."""
    best = 0
    for t, _ in ledger:
        best = max(best, sum(a for s, a in ledger if t - W < s <= t))
    return best


@settings(max_examples=300, deadline=None)
@given(steps, st.integers(1, 12), st.integers(1, 1500))
def test_no_window_ever_holds_more_than_the_limit(
    script: list[tuple[float, int, bool, float]], rpm: int, tpm: int
) -> None:
    limiter = Limiter()
    limits = Limits(requests=rpm, tokens=tpm)
    now = 1000.0
    requests: list[tuple[float, int]] = []  # (time, 1) per admitted request
    tokens: list[list[float]] = []  # [time, amount]: what the window really holds
    open_tickets: list[tuple[Ticket, int]] = []  # (ticket, index of its ledger entry)
    for dt, asked, settle, fraction in script:
        now += dt
        if settle and open_tickets:
            ticket, at = open_tickets.pop(0)
            charged = limiter.settle(
                ticket, used=round(ticket.tokens * fraction), limit=tpm, now=now
            )
            if charged < ticket.tokens:
                tokens[at][1] -= ticket.tokens - charged  # given back to its own bucket
            elif charged > ticket.tokens:
                tokens.append([now, charged - ticket.tokens])  # charged now
        verdict = limiter.admit(tokens=asked, limits=limits, now=now)
        if verdict.ticket is not None:
            requests.append((now, 1))
            tokens.append([now, asked])
            open_tickets.append((verdict.ticket, len(tokens) - 1))
        for state, limit in ((verdict.requests, rpm), (verdict.tokens, tpm)):
            assert state is not None
            assert 0 <= state.remaining <= limit
    assert _max_in_any_window(requests) <= rpm
    assert _max_in_any_window([(t, int(a)) for t, a in tokens]) <= tpm
    assert all(a >= 0 for _, a in tokens)


@settings(max_examples=200, deadline=None)
@given(steps, st.integers(1, 5), st.integers(1, 800))
def test_a_refused_request_takes_nothing(
    script: list[tuple[float, int, bool, float]], rpm: int, tpm: int
) -> None:
    limiter = Limiter()
    limits = Limits(requests=rpm, tokens=tpm)
    now = 0.0
    for dt, asked, _, _ in script:
        now += dt
        before = (limiter.requests.used(now=now), limiter.tokens.used(now=now))
        verdict = limiter.admit(tokens=asked, limits=limits, now=now)
        after = (limiter.requests.used(now=now), limiter.tokens.used(now=now))
        if verdict.admitted:
            assert after == (before[0] + 1, before[1] + asked)
        else:
            assert after == before
            assert verdict.exceeded in ("requests", "tokens")
            assert verdict.retry_after_s > 0
            # it was refused for a reason: one of the two really did not fit
            assert before[0] + 1 > rpm or before[1] + asked > tpm


@settings(max_examples=200, deadline=None)
@given(steps, st.integers(1, 2000), st.integers(0, 2000))
def test_corrections_keep_the_window_between_zero_and_the_limit(
    script: list[tuple[float, int, bool, float]], tpm: int, new_limit: int
) -> None:
    """Whatever the real usage (none, less, far more than reserved), and even when the limit
    shrinks (a replica joined), remaining stays in [0, limit]."""
    limiter = Limiter()
    now = 0.0
    tickets: list[Ticket] = []
    for i, (dt, asked, settle, fraction) in enumerate(script):
        now += dt
        limit = tpm if i % 2 else min(tpm, new_limit)
        verdict = limiter.admit(tokens=asked, limits=Limits(tokens=limit), now=now)
        if verdict.ticket is not None:
            tickets.append(verdict.ticket)
        if settle and tickets:
            ticket = tickets.pop()
            limiter.settle(ticket, used=round(ticket.tokens * fraction * 10), limit=limit, now=now)
        used = limiter.tokens.used(now=now)
        assert used >= 0
        assert 0 <= limiter.tokens.remaining(limit=limit, now=now) <= limit
        assert used <= max(tpm, limit)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 5, allow_nan=False), st.integers(1, 50)), max_size=40),
    st.integers(1, 60),
    st.integers(1, 120),
)
def test_free_in_is_when_it_fits_and_not_before(
    takes: list[tuple[float, int]], amount: int, limit: int
) -> None:
    def replay() -> tuple[Window, float]:
        window, now = Window(), 0.0
        for dt, a in takes:
            now += dt
            if window.fits(a, limit=limit, now=now):
                window.take(a, now=now)
        return window, now

    window, now = replay()
    wait = window.free_in(amount, limit=limit, now=now)
    if amount > limit:
        assert wait == math.inf
        return
    if wait > 0:
        early, _ = replay()  # the same window, asked a little before the promised time
        assert not early.fits(amount, limit=limit, now=now + wait - 1e-6)
    assert window.fits(amount, limit=limit, now=now + wait)


def test_the_window_slides() -> None:
    window = Window(window_s=60, bucket_s=1)
    window.take(5, now=0.2)
    window.take(5, now=30.5)
    assert window.used(now=59.9) == 10
    assert window.remaining(limit=10, now=59.9) == 0
    # the bucket [0, 1) leaves the window at 61: a bucket counts while any of it is inside
    assert window.free_in(5, limit=10, now=59.9) == pytest.approx(1.1)
    assert window.used(now=61.0) == 5
    assert window.empty_in(now=61.0) == pytest.approx(30.0)
    assert window.used(now=91.0) == 0


def test_settle_gives_back_and_charges_more_only_up_to_the_limit() -> None:
    limiter = Limiter()
    first = limiter.admit(tokens=600, limits=Limits(tokens=1000), now=0.0)
    assert first.ticket is not None and first.tokens is not None
    assert first.tokens.remaining == 400
    assert limiter.settle(first.ticket, used=100, limit=1000, now=1.0) == 100
    assert limiter.tokens.remaining(limit=1000, now=1.0) == 900
    second = limiter.admit(tokens=500, limits=Limits(tokens=1000), now=2.0)
    assert second.ticket is not None
    # used 5000, reserved 500: charged 500 + the 400 left, never past the limit
    assert limiter.settle(second.ticket, used=5000, limit=1000, now=3.0) == 900
    assert limiter.tokens.remaining(limit=1000, now=3.0) == 0
    # a reservation whose bucket left the window gives nothing back
    third = Limiter()
    old = third.admit(tokens=10, limits=Limits(tokens=100), now=0.0)
    assert old.ticket is not None
    assert third.settle(old.ticket, used=0, limit=100, now=200.0) == 10


def test_requests_and_tokens_refuse_separately() -> None:
    limiter = Limiter()
    limits = Limits(requests=2, tokens=100)
    assert limiter.admit(tokens=10, limits=limits, now=0).admitted
    too_many_tokens = limiter.admit(tokens=95, limits=limits, now=0)
    assert too_many_tokens.exceeded == "tokens" and too_many_tokens.needed == 95
    assert limiter.admit(tokens=10, limits=limits, now=0).admitted
    third = limiter.admit(tokens=1, limits=limits, now=1)
    assert third.exceeded == "requests"
    assert third.requests is not None and third.requests.remaining == 0
    assert third.retry_after_s == pytest.approx(60.0)
    never = Limiter().admit(tokens=101, limits=limits, now=0)
    assert never.exceeded == "tokens" and never.retry_after_s == math.inf
    assert Limiter().admit(tokens=10**9, limits=Limits(), now=0).admitted  # no limits


@given(st.integers(0, 10**6), st.integers(1, 64))
def test_shares_sum_to_the_limit_and_differ_by_at_most_one(limit: int, replicas: int) -> None:
    shares = [ratelimit.share(limit, replicas=replicas, rank=r) for r in range(replicas)]
    assert sum(shares) == limit
    assert max(shares) - min(shares) <= 1
    assert all(s >= 0 for s in shares)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (math.inf, "0s"),
        (0.0004, "1ms"),
        (0.25, "250ms"),
        (1, "1s"),
        (6, "6s"),
        (1.5, "1.5s"),
        (17.25, "17.25s"),
        (59.9999, "1m0s"),
        (60, "1m0s"),
        (90.5, "1m30.5s"),
        (360, "6m0s"),
        (3723, "1h2m3s"),
    ],
)
def test_durations_as_openai_writes_them(seconds: float, text: str) -> None:
    assert ratelimit.duration(seconds) == text
