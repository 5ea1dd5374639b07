"""policies.probing: the replicas' votes on a region, and what they do to its window."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import failover, probing
from policies.failover import RegionId

NOW = 1_800_000_000.0
ENDPOINTS = ("http://a.example:8080", "http://b.example:8080")


def _round(replica: str, *oks: bool, age_s: float = 1.0) -> probing.Round:
    return probing.Round(
        replica=replica,
        at=NOW - age_s,
        probes=tuple(
            probing.Probe(endpoint=e, ok=ok, error="" if ok else "no answer within 2 s")
            for e, ok in zip(ENDPOINTS, oks, strict=False)
        ),
    )


def _tally(rounds: list[probing.Round], max_age_s: float = 30.0) -> probing.Reach | None:
    return probing.tally("eu-west", rounds, endpoints=ENDPOINTS, now=NOW, max_age_s=max_age_s)


rounds_strategy = st.lists(
    st.tuples(
        st.lists(st.booleans(), min_size=1, max_size=2),  # each endpoint ok or not
        st.floats(min_value=0, max_value=60),  # the round's age
    ),
    max_size=7,
).map(lambda rs: [_round(f"ctl-{i}", *oks, age_s=age) for i, (oks, age) in enumerate(rs)])


@given(rounds_strategy)
def test_a_region_is_unreachable_exactly_when_most_fresh_voters_reached_none_of_its_endpoints(
    rounds: list[probing.Round],
) -> None:
    reach = _tally(rounds)
    fresh = [r for r in rounds if NOW - r.at <= 30.0]
    if not fresh:
        assert reach is None
        return
    assert reach is not None
    failed = [r.replica for r in fresh if not any(p.ok for p in r.probes)]
    assert list(reach.failed) == failed
    assert reach.voters == len(fresh)
    assert reach.unreachable == (len(failed) > len(fresh) / 2)


@given(rounds_strategy, st.booleans())
def test_one_more_replica_that_reaches_the_region_never_makes_it_unreachable(
    rounds: list[probing.Round], second_endpoint_ok: bool
) -> None:
    before = _tally(rounds)
    after = _tally([*rounds, _round("ctl-new", True, second_endpoint_ok)])
    assert after is not None and not (after.unreachable and not (before and before.unreachable))


def test_one_replica_alone_cannot_fail_a_region_that_two_others_reach() -> None:
    reach = _tally([_round("ctl-a", True), _round("ctl-b", True, False), _round("ctl-c", False)])
    assert reach is not None and not reach.unreachable
    assert reach.reason == "reached by 2 of 3 controller replicas"


def test_a_tie_is_not_a_majority() -> None:
    reach = _tally([_round("ctl-a", True), _round("ctl-b", False)])
    assert reach is not None and not reach.unreachable


def test_the_reason_names_the_replicas_and_what_failed() -> None:
    reach = _tally([_round("ctl-a", False, False), _round("ctl-b", False), _round("ctl-c", True)])
    assert reach is not None and reach.unreachable
    assert reach.reason == (
        "unreachable from 2 of 3 controller replicas (ctl-a: http://a.example:8080 no answer "
        "within 2 s; ctl-a: http://b.example:8080 no answer within 2 s; ctl-b: "
        "http://a.example:8080 no answer within 2 s)"
    )


def test_stale_rounds_rounds_from_the_future_and_unpublished_endpoints_do_not_vote() -> None:
    assert _tally([_round("ctl-a", False, age_s=31)]) is None
    assert _tally([_round("ctl-a", False, age_s=-31)]) is None  # a replica's clock far ahead
    moved = probing.Round(
        replica="ctl-a",
        at=NOW,
        probes=(probing.Probe(endpoint="http://old.example:8080", ok=False),),
    )
    assert _tally([moved]) is None
    with pytest.raises(ValueError, match="max_age_s"):
        _tally([], max_age_s=0)


def _observation(reach: probing.Reach | None) -> failover.Observation:
    status = failover.StatusSnapshot(
        nodes_healthy=2, nodes_total=2, capacity=2.0, error_rate=0.0, ttft_p99_s=0.2
    )
    return failover.Observation(
        region=RegionId("eu-west"), alive=True, status=status, status_age_s=1.0, reach=reach
    )


def test_an_unreachable_region_fails_its_window_though_its_agents_say_healthy() -> None:
    config = failover.FailoverConfig()
    unreachable = _tally([_round("ctl-a", False), _round("ctl-b", False)])
    window = failover.judge_window(_observation(unreachable), config=config)
    assert not window.ok
    assert window.reason.startswith("unreachable from 2 of 2 controller replicas")
    reached = _tally([_round("ctl-a", True), _round("ctl-b", False)])
    assert failover.judge_window(_observation(reached), config=config).ok
    assert failover.judge_window(_observation(None), config=config).ok
