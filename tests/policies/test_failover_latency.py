"""policies.failover, latency-aware backups: the round trip plus the candidate's published p99
TTFT, hysteresis so that moving TTFTs do not move backups, proximity as the option; and
policies.probing's measured round trips."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from policies import failover, probing
from policies.failover import (
    FailoverConfig,
    FleetState,
    Observation,
    RegionId,
    RegionInfo,
    StatusSnapshot,
    Topology,
)

NOW = 1_800_000_000.0
EU = frozenset({"eu"})
TOPOLOGY = Topology.build(
    [
        RegionInfo(region=RegionId("eu-west"), geo="eu", residency=EU),
        RegionInfo(region=RegionId("eu-central"), geo="eu", residency=EU),
        RegionInfo(region=RegionId("eu-north"), geo="eu", residency=EU),
    ],
    {
        (RegionId("eu-west"), RegionId("eu-central")): 10.0,
        (RegionId("eu-west"), RegionId("eu-north")): 40.0,
        (RegionId("eu-central"), RegionId("eu-north")): 30.0,
    },
)


def _ok(region: str, ttft: float | None) -> Observation:
    status = StatusSnapshot(
        nodes_healthy=2, nodes_total=2, capacity=2.0, error_rate=0.0, ttft_p99_s=ttft
    )
    return Observation(region=RegionId(region), alive=True, status=status, status_age_s=1.0)


def _backup(
    ttfts: Mapping[str, float | None],
    *,
    config: FailoverConfig | None = None,
    state: FleetState | None = None,
) -> tuple[failover.Verdict, FleetState]:
    result = failover.plan(
        state or FleetState(),
        [_ok(r, t) for r, t in ttfts.items()],
        topology=TOPOLOGY,
        config=config or FailoverConfig(),
        now=NOW,
    )
    return result.state.verdicts[RegionId("eu-west")], result.state


def test_a_farther_backup_whose_first_tokens_come_sooner_wins_and_the_reason_says_why() -> None:
    west, _ = _backup({"eu-west": 0.5, "eu-central": 3.0, "eu-north": 0.5})
    assert west.backup == "eu-north"  # 40 + 500 ms against 10 + 3000 ms
    assert west.backup_reason == (
        "soonest first token of 2 compliant regions (40 ms, p99 TTFT 0.5 s; the nearest, "
        "eu-central: 10 ms, p99 TTFT 3 s)"
    )


def test_with_equal_ttfts_the_nearest_wins_as_before() -> None:
    west, _ = _backup({"eu-west": 0.5, "eu-central": 0.5, "eu-north": 0.5})
    assert west.backup == "eu-central"
    assert west.backup_reason == "nearest compliant region (10 ms)"


def test_proximity_ranks_by_the_round_trip_alone() -> None:
    config = FailoverConfig(backup_rank="proximity")
    west, _ = _backup({"eu-west": 0.5, "eu-central": 3.0, "eu-north": 0.5}, config=config)
    assert west.backup == "eu-central"


def test_an_unknown_ttft_counts_as_the_mean_of_those_known() -> None:
    # eu-central's TTFT unknown: it counts as eu-north's 0.2 s (the only one known), so it is
    # neither favoured nor punished: 10 + 200 ms against 40 + 200 ms
    west, _ = _backup({"eu-west": 0.5, "eu-central": None, "eu-north": 0.2})
    assert west.backup == "eu-central"
    assert west.backup_reason == "nearest compliant region (10 ms)"


def test_a_backup_is_kept_until_another_is_sooner_by_the_hysteresis() -> None:
    west, state = _backup({"eu-west": 0.5, "eu-central": 3.0, "eu-north": 0.5})
    assert west.backup == "eu-north"
    # eu-central's TTFT falls, but 10 + 400 against 40 + 500 ms is only 130 ms sooner
    west, state = _backup({"eu-west": 0.5, "eu-central": 0.4, "eu-north": 0.5}, state=state)
    assert west.backup == "eu-north"
    # eu-north's TTFT rises: 40 + 900 against 10 + 400 ms is 530 ms, past 250 ms
    west, _ = _backup({"eu-west": 0.5, "eu-central": 0.4, "eu-north": 0.9}, state=state)
    assert west.backup == "eu-central"


def test_bad_latency_knobs_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="backup_rank must be one of latency, proximity"):
        FailoverConfig(backup_rank="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="latency_hysteresis_ms must be >= 0"):
        FailoverConfig(latency_hysteresis_ms=-1)


def _round(replica: str, vantage: str | None, *probes: tuple[str, bool, float]) -> probing.Round:
    return probing.Round(
        replica=replica,
        at=NOW,
        vantage=vantage,
        probes=tuple(probing.Probe(endpoint=e, ok=ok, latency_ms=ms) for e, ok, ms in probes),
    )


def test_measured_round_trips_are_the_median_of_each_vantages_fastest_probe() -> None:
    rounds = {
        "eu-west": [
            _round(
                "ctl-a", "eu-central", ("http://w1:8080", True, 30.0), ("http://w2", True, 24.0)
            ),
            _round("ctl-b", "eu-central", ("http://w1:8080", True, 40.0)),
            _round("ctl-c", "eu-central", ("http://w1:8080", True, 50.0)),
            _round("ctl-d", "us-east", ("https://w1", True, 240.0), ("http://w2", False, 1.0)),
            _round("ctl-e", None, ("http://w1:8080", True, 2.0)),  # no vantage: not counted
            _round("ctl-f", "eu-west", ("http://w1:8080", True, 0.2)),  # its own region
        ],
    }
    measured = probing.measured_rtt_ms(rounds, now=NOW, max_age_s=30)
    # eu-central: fastest per replica 24, 40, 50 ms over two round trips -> median 20 ms;
    # us-east: 240 ms over https (three round trips) -> 80 ms
    assert measured == {("eu-central", "eu-west"): 20.0, ("us-east", "eu-west"): 80.0}
    stale = probing.measured_rtt_ms(rounds, now=NOW + 31, max_age_s=30)
    assert stale == {}
