"""policies.failover: health windows, region states, backups under residency, pre-warm floors,
the failback ramp, steering and the "never all off" rule; table-driven, then invariants."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import failover
from policies.failover import (
    FailoverConfig,
    FleetState,
    Observation,
    RegionId,
    RegionInfo,
    StatusSnapshot,
    Topology,
)

CONFIG = FailoverConfig()
WINDOW_S = CONFIG.window_s


def R(name: str) -> RegionId:
    return RegionId(name)


def status(
    *,
    healthy: int = 4,
    total: int = 4,
    capacity: float = 4.0,
    error_rate: float = 0.0,
    ttft: float | None = 1.0,
    kv: float = 0.0,
) -> StatusSnapshot:
    return StatusSnapshot(
        nodes_healthy=healthy,
        nodes_total=total,
        capacity=capacity,
        error_rate=error_rate,
        ttft_p99_s=ttft,
        kv_util=kv,
    )


def ok(region: str, **kwargs: object) -> Observation:
    """A good window: lease alive, fresh status of 4/4 healthy nodes."""
    fields: dict[str, object] = {
        "region": R(region),
        "alive": True,
        "status": status(),
        "status_age_s": 5.0,
    }
    fields.update(kwargs)
    return Observation(**fields)  # type: ignore[arg-type]


# One token per window for the region under test; every other region has good windows.
KINDS: dict[str, dict[str, object]] = {
    "ok": {},
    "ok?": {"status": status(ttft=None)},  # unknown ttft: no failure by itself
    "lease": {"alive": False},
    "stale": {"status_age_s": 90.0},
    "sick": {"status": status(healthy=1)},
    "err": {"status": status(error_rate=0.2)},
    "slow": {"status": status(ttft=9.0)},
    "manual": {"manual_failover": True},
    "manual-bad": {"manual_failover": True, "alive": False},
    "drain": {"admin": "drained"},
    "drain-bad": {"admin": "drained", "alive": False},
    "draining": {"admin": "draining"},
}

TWO = Topology.build(
    [
        RegionInfo(region=R("a"), geo="x"),
        RegionInfo(region=R("b"), geo="y"),
    ],
    {(R("a"), R("b")): 10.0},
)


def run(
    tokens: Sequence[str],
    *,
    config: FailoverConfig = CONFIG,
    topology: Topology = TWO,
    region: str = "a",
) -> list[failover.Plan]:
    """One plan per token, a window apart (t = 30, 60, ...); ``region`` gets the token."""
    state, plans = FleetState(), []
    for i, token in enumerate(tokens):
        observations = [
            ok(r, **KINDS[token]) if r == region else ok(r) for r in sorted(topology.regions)
        ]
        result = failover.plan(
            state, observations, topology=topology, config=config, now=WINDOW_S * (i + 1)
        )
        plans.append(result)
        state = result.state
    return plans


# -- one window --------------------------------------------------------------------------------

WINDOWS: dict[str, tuple[Observation, bool, str]] = {
    "good": (ok("a"), True, "4/4 nodes healthy, error rate 0, ttft p99 1 s"),
    "lease gone": (ok("a", alive=False), False, "liveness lease gone"),
    "no status": (Observation(region=R("a"), alive=True), False, "no status"),
    "lease gone and no status": (
        Observation(region=R("a"), alive=False),
        False,
        "liveness lease gone; no status",
    ),
    "stale status": (ok("a", status_age_s=61.0), False, "status stale (61 s old > 60 s)"),
    "status exactly at the staleness limit": (ok("a", status_age_s=60.0), True, "4/4"),
    "too few healthy nodes": (
        ok("a", status=status(healthy=1)),
        False,
        "1/4 nodes healthy (0.25 < 0.5)",
    ),
    "half the nodes healthy is enough": (ok("a", status=status(healthy=2)), True, "2/4"),
    "no nodes": (ok("a", status=status(healthy=0, total=0)), False, "no nodes"),
    "error rate above": (ok("a", status=status(error_rate=0.06)), False, "error rate 0.06 > 0.05"),
    "error rate at the limit": (ok("a", status=status(error_rate=0.05)), True, "error rate 0.05"),
    "ttft above the slo": (ok("a", status=status(ttft=5.5)), False, "ttft p99 5.5 s > 5 s"),
    "ttft at the slo": (ok("a", status=status(ttft=5.0)), True, "ttft p99 5 s"),
    "unknown ttft is no failure": (ok("a", status=status(ttft=None)), True, "ttft p99 unknown"),
    "every problem is listed": (
        ok("a", alive=False, status=status(healthy=0, error_rate=0.5, ttft=30.0)),
        False,
        "liveness lease gone; 0/4 nodes healthy (0.00 < 0.5); error rate 0.5 > 0.05; "
        "ttft p99 30 s > 5 s",
    ),
}


@pytest.mark.parametrize("name", WINDOWS)
def test_judge_window(name: str) -> None:
    observation, expected_ok, reason = WINDOWS[name]
    result = failover.judge_window(observation, config=CONFIG)
    assert result.ok is expected_ok
    assert reason in result.reason


def test_no_ttft_slo_never_fails_on_ttft() -> None:
    config = FailoverConfig(ttft_p99_slo_s=None)
    assert failover.judge_window(ok("a", status=status(ttft=60.0)), config=config).ok


def test_an_observation_with_a_status_needs_its_age() -> None:
    with pytest.raises(ValueError, match="status_age_s"):
        Observation(region=R("a"), alive=True, status=status())


# -- region states -----------------------------------------------------------------------------

# (state, strikes, good_windows, weight) after each window
Row = tuple[str, int, int, float]
H1 = ("healthy", 0, 1, 1.0)
FAIL3 = ["lease", "lease", "lease"]
FAILED = [("suspect", 1, 0, 1.0), ("suspect", 2, 0, 1.0), ("failed", 3, 0, 0.0)]
UP = [("failed", 0, 1, 0.0), ("recovering", 0, 2, 0.05)]  # two good windows, hold served

TRANSITIONS: dict[str, tuple[FailoverConfig, list[str], list[Row]]] = {
    "healthy while windows are good": (CONFIG, ["ok", "ok?"], [H1, ("healthy", 0, 2, 1.0)]),
    "suspect, suspect, failed after exactly 3 failed windows": (CONFIG, FAIL3, FAILED),
    "a good window clears the strikes": (
        CONFIG,
        ["lease", "lease", "ok", "lease"],
        [("suspect", 1, 0, 1.0), ("suspect", 2, 0, 1.0), H1, ("suspect", 1, 0, 1.0)],
    ),
    "strikes never exceed the setting": (
        CONFIG,
        [*FAIL3, "lease", "lease"],
        [*FAILED, ("failed", 3, 0, 0.0), ("failed", 3, 0, 0.0)],
    ),
    "strikes=1 fails at the first failed window": (
        FailoverConfig(strikes=1),
        ["err", "err"],
        [("failed", 1, 0, 0.0), ("failed", 1, 0, 0.0)],
    ),
    "stale status fails windows": (CONFIG, ["stale"] * 3, FAILED),
    "too few healthy nodes fail windows": (CONFIG, ["sick"] * 3, FAILED),
    "error rate fails windows": (CONFIG, ["err"] * 3, FAILED),
    "ttft above the slo fails windows": (CONFIG, ["slow"] * 3, FAILED),
    "recovery after 2 good windows and the hold": (CONFIG, [*FAIL3, "ok", "ok"], [*FAILED, *UP]),
    "one good window is not enough": (CONFIG, [*FAIL3, "ok"], [*FAILED, ("failed", 0, 1, 0.0)]),
    "recovery waits for min_hold_s": (
        FailoverConfig(min_hold_s=120.0),  # failed at t=90: the hold ends at t=210
        [*FAIL3, "ok", "ok", "ok", "ok"],
        [
            *FAILED,
            ("failed", 0, 1, 0.0),
            ("failed", 0, 2, 0.0),  # t=150
            ("failed", 0, 3, 0.0),  # t=180
            ("recovering", 0, 4, 0.05),  # t=210
        ],
    ),
    "ramp 5 -> 25 -> 50 -> 100 %, one step per good window": (
        CONFIG,
        [*FAIL3, "ok", "ok", "ok", "ok", "ok", "ok"],
        [
            *FAILED,
            *UP,
            ("recovering", 0, 3, 0.25),
            ("recovering", 0, 4, 0.5),
            ("healthy", 0, 5, 1.0),
            ("healthy", 0, 6, 1.0),
        ],
    ),
    "a failed window mid-ramp pauses it as suspect; good windows resume it": (
        CONFIG,
        [*FAIL3, "ok", "ok", "ok", "err", "ok", "ok"],
        [
            *FAILED,
            *UP,
            ("recovering", 0, 3, 0.25),
            ("suspect", 1, 0, 0.25),
            ("recovering", 0, 1, 0.5),
            ("healthy", 0, 2, 1.0),
        ],
    ),
    "strikes mid-ramp fail it again, and the hold starts over": (
        CONFIG,
        [*FAIL3, "ok", "ok", "slow", "slow", "slow", "ok", "ok"],
        [
            *FAILED,
            *UP,
            ("suspect", 1, 0, 0.05),
            ("suspect", 2, 0, 0.05),
            ("failed", 3, 0, 0.0),
            *UP,
        ],
    ),
    "a failed window while failed restarts the good count": (
        CONFIG,
        [*FAIL3, "ok", "slow", "ok", "ok"],
        [*FAILED, ("failed", 0, 1, 0.0), ("failed", 1, 0, 0.0), *UP],
    ),
    "a ramp of one step comes straight back": (
        FailoverConfig(ramp=(1.0,)),
        [*FAIL3, "ok", "ok"],
        [*FAILED, ("failed", 0, 1, 0.0), ("healthy", 0, 2, 1.0)],
    ),
    "a manual failover holds whatever the windows say": (
        CONFIG,
        ["manual", "manual", "manual", "manual"],
        [("failed", 0, 1, 0.0), ("failed", 0, 2, 0.0), ("failed", 0, 3, 0.0), ("failed", 0, 4, 0)],
    ),
    "a manual failback goes through the ramp": (
        CONFIG,
        ["manual", "manual", "manual", "ok", "ok"],
        [
            ("failed", 0, 1, 0.0),
            ("failed", 0, 2, 0.0),
            ("failed", 0, 3, 0.0),
            ("recovering", 0, 4, 0.05),  # failed since t=30, now t=120: hold served
            ("recovering", 0, 5, 0.25),
        ],
    ),
    "a manual failback of a failing region waits for good windows": (
        CONFIG,
        ["manual-bad", "manual-bad", "lease", "ok", "ok"],
        [
            ("failed", 1, 0, 0.0),
            ("failed", 2, 0, 0.0),
            ("failed", 3, 0, 0.0),
            *UP,
        ],
    ),
    "a failed region held manually stays failed": (
        CONFIG,
        [*FAIL3, "manual", "manual", "manual"],
        [*FAILED, ("failed", 0, 1, 0.0), ("failed", 0, 2, 0.0), ("failed", 0, 3, 0.0)],
    ),
    "drained while the operator drains it": (
        CONFIG,
        ["drain", "drain", "ok", "ok"],
        [
            ("drained", 0, 1, 0.0),
            ("drained", 0, 2, 0.0),
            ("recovering", 0, 3, 0.05),  # good windows behind it: the ramp at once, no hold
            ("recovering", 0, 4, 0.25),
        ],
    ),
    "draining counts as drained": (CONFIG, ["draining"], [("drained", 0, 1, 0.0)]),
    "a drained region that fails its windows is failed when undrained, hold from then": (
        CONFIG,
        ["drain-bad", "drain-bad", "ok", "ok", "ok"],
        [
            ("drained", 1, 0, 0.0),
            ("drained", 2, 0, 0.0),
            ("failed", 0, 1, 0.0),  # t=90
            ("failed", 0, 2, 0.0),  # t=120: held 30 s of 60
            ("recovering", 0, 3, 0.05),  # t=150
        ],
    ),
    "a drain overrides failed": (CONFIG, [*FAIL3, "drain"], [*FAILED, ("drained", 0, 1, 0.0)]),
}


@pytest.mark.parametrize("name", TRANSITIONS)
def test_transitions(name: str) -> None:
    config, tokens, rows = TRANSITIONS[name]
    assert len(tokens) == len(rows), "table row mismatch"
    for i, (result, expected) in enumerate(zip(run(tokens, config=config), rows, strict=True)):
        verdict = result.state.verdicts[R("a")]
        got = (verdict.state, verdict.strikes, verdict.good_windows, verdict.weight)
        assert got == expected, f"window {i + 1} ({tokens[i]}): {verdict.reason}"
        assert verdict.reason
        assert verdict.manual is tokens[i].startswith("manual")


def test_a_new_region_starts_healthy() -> None:
    result = failover.plan(FleetState(), [], topology=TWO, config=CONFIG, now=30.0, judge=False)
    for verdict in result.state.verdicts.values():
        assert (verdict.state, verdict.weight, verdict.since) == ("healthy", 1.0, 30.0)
        assert "new region" in verdict.reason
    assert result.state.window == 0


def test_since_is_when_the_state_was_entered() -> None:
    plans = run([*FAIL3, "lease"])
    assert [p.state.verdicts[R("a")].since for p in plans] == [30.0, 30.0, 90.0, 90.0]


def test_reasons_say_why() -> None:
    plans = run([*FAIL3, "ok", "ok"], config=FailoverConfig(min_hold_s=100.0))
    reasons = [p.state.verdicts[R("a")].reason for p in plans]
    assert reasons[0] == "1/3 failed windows: liveness lease gone"
    assert reasons[2] == "3 consecutive failed windows: liveness lease gone"
    assert reasons[3] == "1/2 good windows towards recovery"
    assert reasons[4] == "2 good windows; held in failed 40 s more (min_hold_s 100)"
    manual = run(["manual", "manual", "ok"])
    assert (
        manual[0].state.verdicts[R("a")].reason == "manual failover: held until a manual failback"
    )
    assert manual[2].state.verdicts[R("a")].reason.startswith("manual failback; 3 good windows")
    drained = run(["draining"])[0].state.verdicts[R("a")]
    assert drained.reason == "operator set draining"


def test_judge_false_counts_no_window() -> None:
    first = run(["lease"])[-1].state
    again = failover.plan(
        first, [ok("b")], topology=TWO, config=CONFIG, now=40.0, judge=False
    ).state
    assert again.window == first.window == 1
    assert again.verdicts[R("a")] == first.verdicts[R("a")]


def test_judge_false_applies_a_drain_or_a_manual_failover_at_once() -> None:
    first = run(["ok"])[-1].state
    for extra in ({"admin": "drained"}, {"manual_failover": True}):
        result = failover.plan(
            first, [ok("a", **extra), ok("b")], topology=TWO, config=CONFIG, now=35.0, judge=False
        )
        verdict = result.state.verdicts[R("a")]
        assert verdict.weight == 0 and verdict.state in ("drained", "failed")
        assert result.state.serving["x"] == {R("b"): 1.0}
        # a no longer backs b up: its floor goes too
        assert [e.kind for e in result.events if e.region == "a"] == ["state", "failover", "floor"]


def test_the_hold_ends_between_windows_too() -> None:
    """Recovery is a level: a failed region with its good windows starts the ramp as soon as
    the hold is served, even on a call that judges no window."""
    config = FailoverConfig(min_hold_s=100.0)
    state = run([*FAIL3, "ok", "ok"], config=config)[-1].state  # failed at 90, now 150
    assert state.verdicts[R("a")].state == "failed"
    result = failover.plan(state, [], topology=TWO, config=config, now=190.0, judge=False)
    assert (result.state.verdicts[R("a")].state, result.state.verdicts[R("a")].weight) == (
        "recovering",
        0.05,
    )


def test_plan_rejects_observations_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="'zz', not in the topology"):
        failover.plan(FleetState(), [ok("zz")], topology=TWO, config=CONFIG, now=1.0)
    with pytest.raises(ValueError, match="two observations of region 'a'"):
        failover.plan(FleetState(), [ok("a"), ok("a")], topology=TWO, config=CONFIG, now=1.0)


def test_a_region_without_an_observation_fails_its_window() -> None:
    result = failover.plan(FleetState(), [ok("b")], topology=TWO, config=CONFIG, now=30.0)
    verdict = result.state.verdicts[R("a")]
    assert (verdict.state, verdict.strikes) == ("suspect", 1)
    assert "liveness lease gone; no status" in verdict.reason


def test_regions_leaving_the_topology_are_forgotten() -> None:
    state = run(["ok"])[-1].state
    only_b = Topology.build([RegionInfo(region=R("b"), geo="y")])
    result = failover.plan(state, [ok("b")], topology=only_b, config=CONFIG, now=60.0)
    assert set(result.state.verdicts) == {"b"}
    assert set(result.state.serving) == {"y"}


# -- backups -----------------------------------------------------------------------------------

EU = frozenset({"eu"})
DUBLIN, FRANKFURT, VIRGINIA, OREGON = (53.3, -6.3), (50.1, 8.7), (38.9, -77.0), (45.6, -121.2)


def fleet(**backups: tuple[str, ...]) -> Topology:
    """eu-west and eu-central (geo eu, residency eu), us-east and us-west (geo us, none), with
    coordinates and no latency matrix; ``backups`` configures backup lists by region (with _)."""

    def info(name: str, geo: str, tags: frozenset[str], at: tuple[float, float]) -> RegionInfo:
        configured = tuple(R(b) for b in backups.get(name.replace("-", "_"), ()))
        return RegionInfo(
            region=R(name), geo=geo, residency=tags, backups=configured, coordinates=at
        )

    return Topology.build(
        [
            info("eu-west", "eu", EU, DUBLIN),
            info("eu-central", "eu", EU, FRANKFURT),
            info("us-east", "us", frozenset(), VIRGINIA),
            info("us-west", "us", frozenset(), OREGON),
        ]
    )


def choose(
    region: str,
    topology: Topology,
    *,
    down: Mapping[str, failover.RegionState] | None = None,
    statuses: Mapping[str, StatusSnapshot] | None = None,
    config: FailoverConfig = CONFIG,
    prefer: str | None = None,
) -> failover.BackupChoice:
    states: dict[RegionId, failover.RegionState] = {r: "healthy" for r in topology.regions}
    states.update({R(r): s for r, s in (down or {}).items()})
    return failover.choose_backup(
        R(region),
        topology=topology,
        states=states,
        statuses={R(r): s for r, s in (statuses or {}).items()},
        config=config,
        prefer=None if prefer is None else R(prefer),
    )


BACKUPS: dict[str, tuple[failover.BackupChoice, str | None, str, bool]] = {
    # name: (choice, expected backup, a phrase of the reason, residency_limited)
    "nearest compliant region by great-circle distance": (
        choose("us-east", fleet()),
        "us-west",
        "nearest compliant region (37 ms)",
        False,
    ),
    "an eu region only ever gets an eu backup": (
        choose("eu-west", fleet()),
        "eu-central",
        "nearest compliant region",
        False,
    ),
    "a region without residency may use an eu region": (
        choose("us-east", fleet(), down={"us-west": "failed"}),
        "eu-west",
        "nearest compliant region (54 ms)",
        False,
    ),
    "a configured non-compliant backup is skipped and reported": (
        choose("eu-west", fleet(eu_west=("us-east", "eu-central"))),
        "eu-central",
        "configured backup #2 eu-central (skipped: us-east lacks residency eu)",
        True,
    ),
    "no compliant backup: none, reported": (
        choose("eu-west", fleet(), down={"eu-central": "failed"}),
        None,
        "no backup meets residency eu (us-east, us-west lack it)",
        True,
    ),
    "no compliant backup even when configured": (
        choose("eu-west", fleet(eu_west=("us-east",)), down={"eu-central": "drained"}),
        None,
        "no backup meets residency eu (us-east, us-west lack it) "
        "(skipped: us-east lacks residency eu)",
        True,
    ),
    "configured backups in order of preference": (
        choose("us-east", fleet(us_east=("eu-central", "us-west"))),
        "eu-central",
        "configured backup #1 eu-central",
        False,
    ),
    "a failed configured backup gives way to the next": (
        choose("us-east", fleet(us_east=("eu-central", "us-west")), down={"eu-central": "failed"}),
        "us-west",
        "configured backup #2 us-west (skipped: eu-central is failed)",
        False,
    ),
    "every configured backup down: the nearest compliant one": (
        choose("us-east", fleet(us_east=("us-west",)), down={"us-west": "drained"}),
        "eu-west",
        "nearest compliant region (54 ms) (skipped: us-west is drained)",
        False,
    ),
    "failed and drained regions are never backups": (
        choose("us-east", fleet(), down={"us-west": "failed", "eu-west": "drained"}),
        "eu-central",
        "nearest compliant region",
        False,
    ),
    "suspect regions may be backups": (
        choose("us-east", fleet(), down={"us-west": "suspect"}),
        "us-west",
        "nearest",
        False,
    ),
    "a recovering region only as a last resort": (
        choose("us-east", fleet(us_east=("us-west",)), down={"us-west": "recovering"}),
        "eu-west",
        "nearest compliant region (54 ms) (skipped: us-west is recovering)",
        False,
    ),
    "a recovering region when no other is up": (
        choose(
            "us-east",
            fleet(us_east=("us-west",)),
            down={"us-west": "recovering", "eu-west": "recovering", "eu-central": "failed"},
        ),
        "us-west",
        "configured backup #1 us-west (recovering itself: no other compliant region is up)",
        False,
    ),
    "nothing else up": (
        choose(
            "us-east", fleet(), down=dict.fromkeys(["us-west", "eu-west", "eu-central"], "failed")
        ),
        None,
        "no other region is up",
        False,
    ),
    "an operator's target comes first": (
        choose("us-east", fleet(us_east=("us-west",)), prefer="eu-central"),
        "eu-central",
        "operator's failover target eu-central",
        False,
    ),
    "an operator's non-compliant target is refused": (
        choose("eu-west", fleet(), prefer="us-east"),
        "eu-central",
        "skipped: us-east lacks residency eu",
        True,
    ),
}


@pytest.mark.parametrize("name", BACKUPS)
def test_choose_backup(name: str) -> None:
    choice, backup, reason, limited = BACKUPS[name]
    assert choice.backup == backup
    assert reason in choice.reason
    assert choice.residency_limited is limited


def _latency(**pairs: float) -> Topology:
    """us-east's candidates us-west, eu-west (no residency needed) at the given latencies."""
    base = fleet()
    matrix = {(R("us-east"), R(k.replace("_", "-"))): ms for k, ms in pairs.items()}
    return dataclasses.replace(base, latency_ms=matrix)


def test_latency_matrix_decides_and_beats_coordinates() -> None:
    assert choose("us-east", _latency(us_west=80.0, eu_west=70.0, eu_central=90.0)).backup == (
        "eu-west"
    )
    assert choose("us-east", _latency(us_west=60.0, eu_west=70.0, eu_central=90.0)).backup == (
        "us-west"
    )


def test_latency_matrix_is_symmetric() -> None:
    topology = dataclasses.replace(
        fleet(),
        latency_ms={(R("us-west"), R("us-east")): 90.0, (R("eu-west"), R("us-east")): 70.0},
    )
    assert failover.proximity_ms(R("us-east"), R("us-west"), topology=topology) == 90.0
    assert choose("us-east", topology, down={"eu-central": "failed"}).backup == "eu-west"


def test_headroom_decides_among_regions_about_as_near() -> None:
    topology = _latency(us_west=20.0, eu_west=22.0, eu_central=90.0)
    roomy = {"us-west": status(capacity=4.0, kv=0.9), "eu-west": status(capacity=4.0, kv=0.1)}
    choice = choose("us-east", topology, statuses=roomy)
    assert choice.backup == "eu-west"
    assert "most headroom of 2 compliant regions within 5 ms" in choice.reason
    # beyond the tolerance, nearness wins
    assert (
        choose(
            "us-east", topology, statuses=roomy, config=FailoverConfig(proximity_tolerance_ms=1.0)
        ).backup
        == "us-west"
    )
    # unknown headroom ranks after known headroom
    assert choose("us-east", topology, statuses={"us-west": status(kv=0.99)}).backup == "us-west"


def test_unknown_distance_ranks_last() -> None:
    topology = Topology.build(
        [
            RegionInfo(region=R("a"), geo="x"),
            RegionInfo(region=R("b"), geo="x"),
            RegionInfo(region=R("c"), geo="x"),
        ],
        {(R("a"), R("c")): 300.0},
    )
    choice = choose("a", topology)
    assert choice.backup == "c"
    assert choose("a", topology, down={"c": "failed"}).reason == (
        "nearest compliant region (unknown distance)"
    )


def test_great_circle_distance() -> None:
    assert failover.great_circle_km(DUBLIN, FRANKFURT) == pytest.approx(1090, rel=0.02)
    assert failover.great_circle_km(VIRGINIA, VIRGINIA) == 0.0


def test_plan_reports_a_region_without_a_compliant_backup() -> None:
    topology = fleet(eu_west=("us-east",))  # a bad configuration still never breaks residency
    state, kinds = FleetState(), []
    for i, central in enumerate(["drain", "drain", "drain"]):
        observations = [ok(r) for r in ("eu-west", "us-east", "us-west")]
        observations.append(ok("eu-central", **KINDS[central]))
        result = failover.plan(state, observations, topology=topology, config=CONFIG, now=30.0 * i)
        state = result.state
        kinds.append([e for e in result.events if e.kind == "residency" and e.region == "eu-west"])
    verdict = state.verdicts[R("eu-west")]
    assert verdict.backup is None
    assert "no backup meets residency eu" in verdict.backup_reason
    assert len(kinds[0]) == 1 and not kinds[1] and not kinds[2]  # reported once, on change
    assert "no backup" in kinds[0][0].reason


# -- floors ------------------------------------------------------------------------------------

PAIR = Topology.build(
    [
        RegionInfo(region=R("a"), geo="x", backups=(R("b"),)),
        RegionInfo(region=R("b"), geo="y", backups=(R("a"),)),
        RegionInfo(region=R("c"), geo="z", backups=(R("b"),)),
        RegionInfo(region=R("d"), geo="y", backups=(R("a"), R("c"))),
    ],
    {(R("a"), R("d")): 50.0, (R("c"), R("d")): 50.0, (R("b"), R("d")): 5.0},
)


def windows(
    steps: Iterable[Mapping[str, Observation]],
    *,
    topology: Topology = PAIR,
    config: FailoverConfig = CONFIG,
) -> list[failover.Plan]:
    """One plan per step; a region a step does not mention has a good window at capacity 4."""
    state, plans = FleetState(), []
    for i, step in enumerate(steps):
        observations = [step.get(r) or ok(r) for r in sorted(topology.regions)]
        result = failover.plan(
            state, observations, topology=topology, config=config, now=WINDOW_S * (i + 1)
        )
        plans.append(result)
        state = result.state
    return plans


def floor(result: failover.Plan, region: str) -> float:
    return result.state.verdicts[R(region)].capacity_floor


def test_floor_is_prewarm_fraction_of_what_it_protects_summed() -> None:
    big_a = {"a": ok("a", status=status(capacity=8.0))}
    result = windows([big_a])[-1]
    b = result.state.verdicts[R("b")]
    assert b.protects == ("a", "c")
    assert b.capacity_floor == pytest.approx(0.5 * (8.0 + 4.0))
    assert result.state.verdicts[R("a")].protects == ("b", "d")
    assert floor(result, "a") == pytest.approx(4.0)
    assert floor(result, "c") == floor(result, "d") == 0.0
    quarter = windows([big_a], config=FailoverConfig(prewarm_fraction=0.25))[-1]
    assert floor(quarter, "b") == pytest.approx(3.0)


def test_floor_rises_when_the_protected_region_grows() -> None:
    plans = windows([{}, {"a": ok("a", status=status(capacity=10.0))}])
    assert [floor(p, "b") for p in plans] == pytest.approx([4.0, 7.0])
    event = next(e for e in plans[1].events if e.kind == "floor")
    assert event.region == "b"
    assert event.reason == "capacity floor 4 -> 7: 0.5 x the capacity it protects (a 10, c 4)"
    assert event.data == {"from": 4.0, "to": 7.0, "protects": ("a", "c")}


def test_floor_is_kept_when_the_protected_region_dies() -> None:
    dead = ok("a", alive=False, status=status(healthy=0, capacity=0.0))
    plans = windows([{"a": ok("a", status=status(capacity=8.0))}, *[{"a": dead}] * 4])
    assert plans[-1].state.verdicts[R("a")].state == "failed"
    assert [floor(p, "b") for p in plans] == pytest.approx([6.0] * 5)
    assert plans[-1].state.verdicts[R("a")].serving_capacity == 8.0
    # and a recovering region does not lower it either until it is healthy again
    small = ok("a", status=status(capacity=2.0))
    later = windows(
        [{"a": ok("a", status=status(capacity=8.0))}, *[{"a": dead}] * 3, *[{"a": small}] * 6]
    )
    states = [p.state.verdicts[R("a")].state for p in later]
    first_healthy = states.index("healthy", 1)
    assert [floor(p, "b") for p in later[:first_healthy]] == pytest.approx([6.0] * first_healthy)
    assert floor(later[first_healthy], "b") == pytest.approx(0.5 * (2.0 + 4.0))


def test_floor_moves_with_the_backup() -> None:
    dead = ok("b", alive=False)
    plans = windows([{}, {"b": dead}, {"b": dead}, {"b": dead}])
    last = plans[-1].state.verdicts
    assert last[R("b")].state == "failed"
    assert last[R("a")].backup == last[R("c")].backup == "d"
    assert (last[R("d")].protects, last[R("d")].capacity_floor) == (("a", "c"), 4.0)
    assert (last[R("a")].protects, last[R("a")].capacity_floor) == (("b", "d"), 4.0)
    assert (last[R("b")].protects, last[R("b")].capacity_floor) == ((), 0.0)
    assert {e.region for e in plans[-1].events if e.kind == "floor"} == {"b", "d"}


# -- steering and never all off ----------------------------------------------------------------


def eu_steps(*tokens: str) -> list[dict[str, Observation]]:
    return [{"eu-west": ok("eu-west", **KINDS[t])} for t in tokens]


def test_a_failed_region_s_share_moves_to_its_backup() -> None:
    plans = windows(eu_steps("ok", *FAIL3, "ok", "ok", "ok"), topology=fleet())
    serving = [p.state.serving["eu"] for p in plans]
    assert serving[0] == {"eu-central": 0.5, "eu-west": 0.5}
    assert serving[2] == {"eu-central": 0.5, "eu-west": 0.5}  # suspect keeps its share
    assert serving[3] == {"eu-central": 1.0}
    assert serving[5] == pytest.approx({"eu-central": 0.975, "eu-west": 0.025})  # 5 %
    assert serving[6] == pytest.approx({"eu-central": 0.875, "eu-west": 0.125})  # 25 %
    assert all(p.alert is None for p in plans)
    assert plans[0].recheck_after_s == 30.0


def test_shares_follow_serving_capacity_and_a_failover_moves_the_region_s_own() -> None:
    """eu-west at 6 node-equivalents and eu-central at 4: 60/40; eu-west failing moves its 6 to
    eu-central; at its first ramp step it keeps 5 % of its 6.  us: 4 and 4, 50/50."""
    big = ok("eu-west", status=status(capacity=6.0))
    dead = ok("eu-west", alive=False)
    plans = windows([{"eu-west": big}, {"eu-west": dead}, {"eu-west": dead}, {"eu-west": dead}]
                    + [{"eu-west": ok("eu-west", status=status(capacity=6.0))}] * 3,
                    topology=fleet())  # fmt: skip
    serving = [p.state.serving["eu"] for p in plans]
    assert serving[0] == pytest.approx({"eu-west": 0.6, "eu-central": 0.4})
    assert serving[2] == pytest.approx({"eu-west": 0.6, "eu-central": 0.4})  # suspect
    assert serving[3] == {"eu-central": 1.0}
    assert plans[5].state.verdicts[R("eu-west")].weight == 0.05
    assert serving[5] == pytest.approx({"eu-west": 0.03, "eu-central": 0.97})
    assert plans[0].state.serving["us"] == {"us-east": 0.5, "us-west": 0.5}
    # equal shares as an option
    equal = dataclasses.replace(CONFIG, shares="equal")
    plans = windows([{"eu-west": big}], topology=fleet(), config=equal)
    assert plans[0].state.serving["eu"] == {"eu-west": 0.5, "eu-central": 0.5}


def test_a_region_not_measured_yet_counts_as_the_mean_of_its_geography() -> None:
    """A region whose status has no capacity yet (0) is not starved: it counts as the mean of
    the measured members; a geography measured nowhere is equal."""
    topology = fleet()
    empty = status(capacity=0.0)
    plans = windows(
        [{"eu-west": ok("eu-west", status=empty), "eu-central": ok("eu-central", status=status(
            capacity=8.0)), "us-east": ok("us-east", status=empty),
          "us-west": ok("us-west", status=empty)}],
        topology=topology,
    )  # fmt: skip
    assert plans[0].state.serving["eu"] == {"eu-central": 0.5, "eu-west": 0.5}
    assert plans[0].state.serving["us"] == {"us-east": 0.5, "us-west": 0.5}
    base = failover.base_shares(
        [R("a"), R("b"), R("c")],
        {
            R(r): failover.Verdict(region=R(r), state="healthy", since=0.0, reason="",
                                   serving_capacity=c)
            for r, c in (("a", 2.0), ("b", 4.0), ("c", 0.0))
        },
        rule="capacity",
    )  # fmt: skip
    assert base == {"a": 2.0, "b": 4.0, "c": 3.0}


def test_an_unknown_share_rule_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"FailoverConfig\.shares must be one of capacity, equal"):
        FailoverConfig(shares="biggest")  # type: ignore[arg-type]


def test_every_region_failing_keeps_the_last_good_plan_and_alerts() -> None:
    topology = fleet()
    dead = {str(r): ok(r, alive=False) for r in topology.regions}
    plans = windows([{}, dead, dead, dead, dead], topology=topology)
    good = plans[0].state.serving
    assert all(v.state == "failed" for v in plans[3].state.verdicts.values())
    assert all(v.weight == 0 for v in plans[3].state.verdicts.values())
    assert plans[3].state.serving == good == plans[4].state.serving
    assert plans[3].alert is not None
    assert plans[3].alert.startswith("never all off: every region is failed or drained")
    assert "keeping eu-central, eu-west" in plans[3].alert
    alerts = [e for p in plans for e in p.events if e.kind == "alert"]
    assert len(alerts) == 1 and alerts[0].data["active"] is True  # raised once
    # a region of each geography back: the alert clears with an event
    back = {**dead, "us-east": ok("us-east"), "eu-west": ok("eu-west")}
    state = plans[-1].state
    for t in (150.0, 180.0):
        result = failover.plan(state, back.values(), topology=topology, config=CONFIG, now=t)
        state = result.state
    assert result.alert is None
    verdicts = result.state.verdicts
    assert (verdicts[R("us-east")].state, verdicts[R("us-east")].weight) == ("recovering", 0.05)
    assert result.state.serving["eu"] == {"eu-west": 1.0}  # at 5 %, but no backup is up
    # every survivor is recovering: backups are last resorts, so us-west's whole share goes to
    # us-east and 95 % of us-east's to eu-west (us has no residency)
    assert verdicts[R("us-west")].backup == "us-east"
    assert "recovering itself" in verdicts[R("us-west")].backup_reason
    assert verdicts[R("us-east")].backup == "eu-west"
    assert result.state.serving["us"] == pytest.approx({"us-east": 0.525, "eu-west": 0.475})
    cleared = [e for e in result.events if e.kind == "alert"]
    assert cleared and cleared[0].reason.startswith("cleared: ")


def test_a_geography_without_a_compliant_backup_keeps_its_last_good_answer() -> None:
    topology = fleet()
    dead = {r: ok(r, alive=False) for r in ("eu-west", "eu-central")}
    plans = windows([{}, dead, dead, dead], topology=topology)
    last = plans[-1]
    assert last.state.serving["eu"] == {"eu-central": 0.5, "eu-west": 0.5}
    assert last.state.serving["us"] == {"us-east": 0.5, "us-west": 0.5}
    assert last.alert is not None
    assert "geography eu has no region to serve it" in last.alert
    assert "eu-central failed without a backup" in last.alert
    assert "every region" not in last.alert


def test_a_geography_with_no_earlier_answer_says_so() -> None:
    drained = {"a": ok("a", admin="drained"), "b": ok("b", admin="drained")}
    result = windows([drained], topology=TWO)[0]
    assert result.state.serving == {"x": {}, "y": {}}  # no earlier plan to keep
    assert result.alert is not None
    assert result.alert.startswith("never all off: every region is failed or drained")
    assert "keeping nothing: there is no earlier answer" in result.alert


# -- events ------------------------------------------------------------------------------------


def test_events_for_every_change_with_reasons() -> None:
    plans = windows(eu_steps("ok", *FAIL3, "ok", "ok", "ok", "ok", "ok"), topology=fleet())
    by_window = [[(e.kind, e.region, e.reason) for e in p.events] for p in plans]
    assert not [e for e in by_window[0] if e[0] != "floor"]  # first window: floors only
    assert by_window[1] == [
        ("strike", "eu-west", "failed window 1/3: liveness lease gone"),
        ("state", "eu-west", "healthy -> suspect: 1/3 failed windows: liveness lease gone"),
    ]
    # eu-central's only compliant backup is gone: reported, and its floor goes
    assert [e for e in by_window[3] if e[1] != "eu-west"] == [
        (
            "residency",
            "eu-central",
            "no backup: no backup meets residency eu (us-east, us-west lack it)",
        ),
    ]
    assert (
        "floor",
        "eu-west",
        "capacity floor 2 -> 0: 0.5 x the capacity it protects (nothing)",
    ) in [e for e in by_window[3]]
    assert [e for e in by_window[3] if e[1] == "eu-west" and e[0] != "floor"] == [
        ("strike", "eu-west", "failed window 3/3: liveness lease gone"),
        (
            "state",
            "eu-west",
            "suspect -> failed: 3 consecutive failed windows: liveness lease gone",
        ),
        (
            "failover",
            "eu-west",
            "failed: eu-west's traffic moves to backup eu-central (nearest compliant region "
            "(11 ms))",
        ),
    ]
    assert by_window[4] == []  # one good window while failed: nothing changes but counters
    # eu-west backs eu-central up again (as a last resort while it recovers)
    assert [(k, r) for k, r, _ in by_window[5]] == [
        ("state", "eu-west"),
        ("recovery", "eu-west"),
        ("floor", "eu-west"),
    ]
    assert by_window[5][1][2] == (
        "weight 0 -> 0.05: 2 good windows after 60 s failed: ramp starts at weight 0.05"
    )
    assert [r for k, _, r in by_window[6]] == [
        "weight 0.05 -> 0.25: good window: ramp to weight 0.25"
    ]
    assert [(k, r) for k, _, r in by_window[8]] == [
        ("state", "recovering -> healthy: ramp complete: weight 1"),
        ("recovery", "weight 0.5 -> 1: ramp complete: weight 1"),
    ]
    for i, plan in enumerate(plans):
        for event in plan.events:
            assert event.kind in failover.EVENT_KINDS
            assert event.reason
            assert event.at == WINDOW_S * (i + 1)


def test_a_steady_fleet_emits_nothing() -> None:
    plans = windows([{}, {}, {}])
    assert plans[0].events  # floors on the first window
    assert plans[1].events == plans[2].events == ()


def test_a_backup_change_during_a_failover_is_an_event() -> None:
    dead_a, dead_b = ok("a", alive=False), ok("b", alive=False)
    plans = windows([{"a": dead_a}] * 3 + [{"a": dead_a, "b": dead_b}] * 3)
    moved = [e for e in plans[-1].events if e.kind == "failover" and e.region == "a"]
    assert plans[-1].state.verdicts[R("a")].backup == "d"
    assert moved and "moves from b to backup d" in moved[0].reason
    assert "(skipped: b is failed)" in moved[0].reason


# -- configuration -----------------------------------------------------------------------------

CONFIG_ERRORS: dict[str, tuple[dict[str, object], str]] = {
    "strikes 0": ({"strikes": 0}, "FailoverConfig.strikes must be an integer of at least 1"),
    "recovery_windows 0": ({"recovery_windows": 0}, "FailoverConfig.recovery_windows"),
    "negative window": ({"window_s": -30.0}, "FailoverConfig.window_s must be a positive"),
    "zero staleness": ({"status_stale_s": 0.0}, "FailoverConfig.status_stale_s"),
    "negative hold": ({"min_hold_s": -1.0}, "FailoverConfig.min_hold_s must be >= 0"),
    "fraction above 1": ({"min_healthy_fraction": 1.5}, "FailoverConfig.min_healthy_fraction"),
    "error rate NaN": ({"max_error_rate": math.nan}, "FailoverConfig.max_error_rate"),
    "prewarm above 1": ({"prewarm_fraction": 2.0}, "FailoverConfig.prewarm_fraction"),
    "slo 0": ({"ttft_p99_slo_s": 0.0}, "FailoverConfig.ttft_p99_slo_s"),
    "empty ramp": ({"ramp": ()}, "FailoverConfig.ramp must not be empty"),
    "ramp not ending at 1.0": ({"ramp": (0.1, 0.5)}, "FailoverConfig.ramp must end at 1.0"),
    "ramp not increasing": ({"ramp": (0.5, 0.25, 1.0)}, "ramp must be strictly increasing"),
    "ramp step 0": ({"ramp": (0.0, 1.0)}, "ramp steps must be within"),
    "negative tolerance": ({"proximity_tolerance_ms": -1.0}, "proximity_tolerance_ms"),
}


@pytest.mark.parametrize("name", CONFIG_ERRORS)
def test_config_errors_name_the_field(name: str) -> None:
    fields, message = CONFIG_ERRORS[name]
    with pytest.raises(ValueError, match=message):
        FailoverConfig(**fields)  # type: ignore[arg-type]


def _bad(**changes: object) -> Topology:
    """fleet() with eu-west changed."""
    topology = fleet()
    regions = dict(topology.regions)
    regions[R("eu-west")] = dataclasses.replace(regions[R("eu-west")], **changes)  # type: ignore[arg-type]
    return Topology(regions=regions)


TOPOLOGY_ERRORS: dict[str, tuple[Topology, str]] = {
    "backup naming an unknown region": (
        _bad(backups=(R("mars"),)),
        r"Topology.regions\['eu-west'\].backups\[0\]: unknown region 'mars'",
    ),
    "backup breaking residency": (
        _bad(backups=(R("eu-central"), R("us-east"))),
        r"backups\[1\]: us-east breaks residency: it lacks eu that eu-west requires",
    ),
    "backup naming itself": (_bad(backups=(R("eu-west"),)), "cannot back itself up"),
    "backup listed twice": (
        _bad(backups=(R("eu-central"), R("eu-central"))),
        "eu-central is listed twice",
    ),
    "region under another key": (_bad(region=R("eu-north")), "must equal its key"),
    "no geography": (_bad(geo=""), r"\.geo must not be empty"),
    "coordinates out of range": (_bad(coordinates=(95.0, 0.0)), r"\.coordinates must be"),
    "latency naming an unknown region": (
        dataclasses.replace(fleet(), latency_ms={(R("eu-west"), R("mars")): 5.0}),
        r"Topology.latency_ms\[\('eu-west', 'mars'\)\]: unknown region 'mars'",
    ),
    "negative latency": (
        dataclasses.replace(fleet(), latency_ms={(R("eu-west"), R("us-east")): -5.0}),
        "must be a latency >= 0 ms",
    ),
}


@pytest.mark.parametrize("name", TOPOLOGY_ERRORS)
def test_validate_config_names_the_bad_field(name: str) -> None:
    topology, message = TOPOLOGY_ERRORS[name]
    with pytest.raises(ValueError, match=message):
        failover.validate_config(CONFIG, topology)


def test_validate_config_accepts_a_good_topology() -> None:
    topology = dataclasses.replace(
        fleet(eu_west=("eu-central",), us_east=("us-west", "eu-west")),
        latency_ms={(R("eu-west"), R("eu-central")): 11.0},
    )
    failover.validate_config(CONFIG, topology)


def test_duplicate_regions_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate region 'a'"):
        Topology.build([RegionInfo(region=R("a"), geo="x"), RegionInfo(region=R("a"), geo="y")])


# -- invariants --------------------------------------------------------------------------------

NAMES = [R(f"r{i}") for i in range(6)]
GEOS = ("eu", "us", "ap")


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    size = draw(st.integers(2, 6))
    names = NAMES[:size]
    infos = []
    for name in names:
        geo = draw(st.sampled_from(GEOS))
        tags = set(draw(st.sets(st.sampled_from(["eu", "de", "pci"]), max_size=2)))
        if geo == "eu":
            tags.add("eu")  # eu regions carry eu traffic; others may be eu-compliant too
        others = [n for n in names if n != name]
        backups = draw(st.lists(st.sampled_from(others), max_size=2, unique=True))
        coordinates = draw(st.none() | st.tuples(st.floats(-90, 90), st.floats(-180, 180)))
        infos.append(
            RegionInfo(
                region=name,
                geo=geo,
                residency=frozenset(tags),
                backups=tuple(backups),  # possibly non-compliant: plan must still comply
                coordinates=coordinates,
            )
        )
    pairs = [(a, b) for a in names for b in names if a < b]
    latency = draw(st.dictionaries(st.sampled_from(pairs), st.floats(0, 300), max_size=6))
    return Topology.build(infos, latency)


# A palette of windows; each step draws one per region (cheap to generate, covers every check).
PALETTE: list[dict[str, object]] = [
    *[KINDS[k] for k in ("ok", "ok", "ok", "ok?", "lease", "stale", "sick", "err", "slow")],
    {"status": status(capacity=16.0, kv=0.9)},
    {"status": status(capacity=1.0, kv=0.1)},
    {"status": status(capacity=0.0, healthy=0), "alive": False},
    {"status": None, "status_age_s": None, "alive": False},
    KINDS["manual"],
    KINDS["manual-bad"],
    KINDS["drain"],
    KINDS["draining"],
]


@st.composite
def configs(draw: st.DrawFn) -> FailoverConfig:
    return FailoverConfig(
        strikes=draw(st.integers(1, 4)),
        recovery_windows=draw(st.integers(1, 3)),
        ramp=draw(st.sampled_from([(1.0,), (0.5, 1.0), (0.05, 0.25, 0.5, 1.0)])),
        min_hold_s=draw(st.sampled_from([0.0, 60.0, 200.0])),
        prewarm_fraction=draw(st.floats(0, 1)),
        proximity_tolerance_ms=draw(st.sampled_from([0.0, 5.0, 1000.0])),
    )


@settings(max_examples=75, deadline=None)
@given(
    topology=topologies(),
    config=configs(),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, len(PALETTE) - 1), min_size=6, max_size=6),
            st.sampled_from([True, True, True, False]),  # judge
            st.sampled_from([30.0, 30.0, 5.0, 120.0]),  # seconds since the last call
        ),
        min_size=1,
        max_size=20,
    ),
)
def test_invariants(
    topology: Topology,
    config: FailoverConfig,
    steps: list[tuple[list[int], bool, float]],
) -> None:
    state, now = FleetState(), 0.0
    regions = topology.regions
    for observed, judge, dt in steps:
        now += dt
        observations = [
            ok(name, **PALETTE[i]) for name, i in zip(sorted(regions), observed, strict=False)
        ]
        result = failover.plan(
            state, observations, topology=topology, config=config, now=now, judge=judge
        )
        new = result.state
        verdicts = new.verdicts
        assert set(verdicts) == set(regions)
        for name, v in verdicts.items():
            assert v.state in failover.STATES
            assert 0 <= v.weight <= 1
            assert 0 <= v.strikes <= config.strikes
            assert v.good_windows >= 0
            assert (v.weight == 0) == (v.state in ("failed", "drained"))
            if v.state == "healthy":
                assert v.weight == 1
            if v.backup is not None:
                # residency: the backup meets every tag of the region it backs up
                assert regions[name].residency <= regions[v.backup].residency
                assert v.backup != name
                assert verdicts[v.backup].state not in ("failed", "drained")
            protected = sum(verdicts[p].serving_capacity for p in v.protects)
            assert v.capacity_floor >= config.prewarm_fraction * protected - 1e-9
            assert set(v.protects) == {r for r, w in verdicts.items() if w.backup == name}
            before = state.verdicts.get(name)
            if before is not None and v.state != "healthy":
                assert v.serving_capacity == before.serving_capacity  # memory kept
        for geo, shares in new.serving.items():
            assert all(0 <= s <= 1 for s in shares.values())
            if shares:
                assert sum(shares.values()) == pytest.approx(1.0)
            else:  # never all off: dark only when the last good plan was dark too
                assert not state.serving.get(geo)
                assert result.alert is not None
            members = [r for r, i in regions.items() if i.geo == geo]
            if geo == "eu":  # EU traffic never leaves EU-tagged regions
                assert all("eu" in regions[s].residency for s in shares)
            if f"geography {geo} has" not in (result.alert or ""):
                for s in shares:
                    assert verdicts[s].weight > 0
                    assert s in members or any(verdicts[m].backup == s for m in members)
        for event in result.events:
            assert event.kind in failover.EVENT_KINDS and event.reason and event.at == now
        state = new


@settings(max_examples=200, deadline=None)
@given(
    topology=topologies(),
    states=st.lists(st.sampled_from(sorted(failover.STATES)), min_size=6, max_size=6),
    prefer=st.none() | st.sampled_from([*NAMES, R("mars-1")]),
)
def test_the_wanted_region_shortcut_chooses_what_the_full_look_chooses(
    topology: Topology,
    states: list[failover.RegionState],
    prefer: RegionId | None,
) -> None:
    """``choose_backup`` answers from the wanted regions alone when one is up (O(wanted), not
    O(regions)): the same backup, reason and residency flag as looking at every region."""
    by_region = dict(zip(sorted(topology.regions), states, strict=False))
    config = FailoverConfig()
    for region in topology.regions:
        kw = {"topology": topology, "states": by_region, "statuses": {}, "config": config,
              "prefer": prefer}  # fmt: skip
        quick = failover.choose_backup(region, **kw)  # type: ignore[arg-type]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(failover, "_wanted_and_up", lambda *a, **k: None)
            full = failover.choose_backup(region, **kw)  # type: ignore[arg-type]
        assert quick == full
