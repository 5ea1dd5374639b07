"""policies.spill: spill-over never crosses residency, never targets home, a region that does
not serve the model, one out of service or over the latency budget; best first."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from policies import spill
from policies.spill import Region

TAGS = ("eu", "de", "us")
MODELS = ("A", "B")


def _region(name: str, **kw: object) -> Region:
    base: dict[str, object] = {
        "name": name,
        "residency": frozenset({"eu"}),
        "endpoints": (f"http://{name}.example",),
        "models": {"A": 2.0, "B": 1.0},
        "in_service": True,
    }
    base.update(kw)
    return Region(**base)  # type: ignore[arg-type]


def _rank(regions: list[Region], **kw: object) -> spill.Choice:
    args: dict[str, object] = {
        "home": "eu-west",
        "model": "A",
        "needs": frozenset({"eu"}),
        "latency_ms": {},
        "budget_ms": 100.0,
        "max_age_s": 30.0,
    }
    args.update(kw)
    return spill.rank(regions, **args)  # type: ignore[arg-type]


def test_the_issue_case_a_spills_to_eu_central_and_b_has_nowhere_in_the_eu() -> None:
    regions = [
        _region("eu-west"),
        _region("eu-central", models={"A": 2.0}),
        _region("us-east", residency=frozenset({"us"})),
    ]
    a = _rank(regions, latency_ms={"eu-central": 12.0, "us-east": 80.0})
    assert [t.region for t in a.targets] == ["eu-central"]
    assert a.targets[0].endpoint == "http://eu-central.example"
    assert "us-east: lacks residency eu" in a.ruled_out
    b = _rank(regions, model="B")
    assert b.targets == ()
    assert "eu-central: does not serve B" in b.why_none()


def test_ruled_out_reasons_name_each_cause() -> None:
    regions = [
        _region("r-none", models=None),
        _region("r-drained", admin="drained"),
        _region("r-failed", in_service=False),
        _region("r-dark", reachable=False),
        _region("r-down", nodes_healthy=0),
        _region("r-noend", endpoints=()),
        _region("r-old", age_s=31.0),
        _region("r-far"),
        _region("r-tried"),
        _region("r-busy", queue_depth=40, requests_per_s=10.0),
    ]
    choice = _rank(
        regions,
        latency_ms={"r-far": 150.0},
        exclude=frozenset({"r-tried"}),
        home_wait_ms=2_000.0,
    )
    assert choice.targets == ()
    why = dict(line.split(": ", 1) for line in choice.ruled_out)
    assert why == {
        "r-none": "publishes no models",
        "r-drained": "is drained",
        "r-failed": "has no share of traffic (failed, drained or not yet serving)",
        "r-dark": "the controller's probes cannot reach it",
        "r-down": "has no healthy node",
        "r-noend": "publishes no endpoint",
        "r-old": "its status is 31 s old (over 30 s)",
        "r-far": "round trip 150 ms over the budget of 100 ms",
        "r-tried": "failed recently (ejected) or already tried",
        "r-busy": "its queue (40 waiting, ~4000 ms) and the round trip start it no sooner "
        "than here (~2000 ms)",
    }


def test_best_first_by_round_trip_plus_wait_and_unknown_latency_counts_as_the_budget() -> None:
    regions = [
        _region("near-busy", queue_depth=5, requests_per_s=10.0),  # 10 + 500
        _region("far-idle"),  # 90
        _region("unknown"),  # the budget, 100
        _region("near-idle"),  # 10
    ]
    choice = _rank(regions, latency_ms={"near-busy": 10.0, "far-idle": 90.0, "near-idle": 10.0})
    assert [t.region for t in choice.targets] == ["near-idle", "far-idle", "unknown", "near-busy"]
    assert choice.targets[2].latency_ms is None
    assert choice.targets[2].score_ms == 100.0


def test_a_queue_without_a_rate_counts_a_second_per_request() -> None:
    assert _region("r", queue_depth=3).wait_ms() == 3 * spill.UNKNOWN_WAIT_MS
    assert _region("r").wait_ms() == 0.0


def test_needs_adds_the_requests_tags_to_homes_never_fewer() -> None:
    assert spill.needs(["eu"], ["de"]) == {"eu", "de"}
    assert spill.needs(["eu"]) == {"eu"}


_regions = st.lists(
    st.builds(
        Region,
        name=st.sampled_from([f"r{i}" for i in range(8)]),
        residency=st.frozensets(st.sampled_from(TAGS)),
        endpoints=st.sampled_from([(), ("http://x",)]),
        models=st.one_of(
            st.none(),
            st.dictionaries(st.sampled_from(MODELS), st.floats(0, 4, allow_nan=False)),
        ),
        in_service=st.booleans(),
        reachable=st.booleans(),
        admin=st.sampled_from(["active", "drained"]),
        nodes_healthy=st.integers(0, 3),
        queue_depth=st.integers(0, 50),
        requests_per_s=st.floats(0, 100, allow_nan=False),
        age_s=st.floats(0, 60, allow_nan=False),
    ),
    max_size=8,
    unique_by=lambda r: r.name,
)


@settings(max_examples=300, deadline=None)
@given(
    regions=_regions,
    model=st.sampled_from(MODELS),
    needs=st.frozensets(st.sampled_from(TAGS)),
    latency=st.dictionaries(
        st.sampled_from([f"r{i}" for i in range(8)]), st.floats(0, 300, allow_nan=False)
    ),
    budget=st.floats(0, 300, allow_nan=False),
    home_wait=st.one_of(st.just(math.inf), st.floats(0, 5_000, allow_nan=False)),
    exclude=st.frozensets(st.sampled_from([f"r{i}" for i in range(8)])),
)
def test_a_target_is_always_allowed_and_every_allowed_region_is_a_target(
    regions: list[Region],
    model: str,
    needs: frozenset[str],
    latency: dict[str, float],
    budget: float,
    home_wait: float,
    exclude: frozenset[str],
) -> None:
    choice = spill.rank(
        regions,
        home="r0",
        model=model,
        needs=needs,
        latency_ms=latency,
        budget_ms=budget,
        max_age_s=30.0,
        home_wait_ms=home_wait,
        exclude=exclude,
    )
    by_name = {r.name: r for r in regions}
    allowed = set()
    for r in regions:
        rtt = latency.get(r.name, budget)
        if (
            r.name != "r0"
            and r.name not in exclude
            and needs <= r.residency  # residency is never crossed
            and r.models is not None
            and r.models.get(model, 0) > 0  # never a region that does not serve the model
            and r.in_service
            and r.reachable
            and r.admin == "active"
            and r.nodes_healthy > 0
            and r.endpoints
            and r.age_s <= 30.0
            and rtt <= budget
            and rtt + r.wait_ms() < home_wait
        ):
            allowed.add(r.name)
    assert {t.region for t in choice.targets} == allowed
    assert len(choice.targets) + len(choice.ruled_out) == len(
        [r for r in regions if r.name != "r0"]
    )
    scores = [t.score_ms for t in choice.targets]
    assert scores == sorted(scores)
    for t in choice.targets:
        assert needs <= by_name[t.region].residency


def test_the_controller_says_once_when_a_region_starts_and_stops_spilling() -> None:
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

    topology = Topology.build(
        [
            RegionInfo(region=RegionId("eu-west"), geo="eu"),
            RegionInfo(region=RegionId("x"), geo="eu"),
        ]
    )

    def window(state: FleetState, spilled: float, i: int) -> tuple[FleetState, list[str]]:
        status = StatusSnapshot(
            nodes_healthy=1, nodes_total=1, capacity=1.0, error_rate=0.0, ttft_p99_s=0.5,
            spilled_per_s=spilled,
        )  # fmt: skip
        observations = [
            Observation(region=RegionId(r), alive=True, status=status, status_age_s=1.0)
            if r == "eu-west"
            else Observation(
                region=RegionId(r),
                alive=True,
                status=dataclasses.replace(status, spilled_per_s=0),
                status_age_s=1.0,
            )
            for r in topology.regions
        ]
        result = failover.plan(
            state, observations, topology=topology, config=FailoverConfig(), now=1e9 + 30 * i
        )
        return result.state, [e.reason for e in result.events if e.kind == "spill"]

    state, said = window(FleetState(), 0.0, 0)
    assert said == []
    state, said = window(state, 2.5, 1)
    assert said == [
        "spilling 2.5 requests/s to other regions: its queue is over spill.queue_depth, full, "
        "or lacks the model"
    ]
    state, said = window(state, 3.0, 2)
    assert said == []  # still spilling: said once
    assert state.verdicts[RegionId("eu-west")].spilling
    state, said = window(state, 0.0, 3)
    assert said == ["stopped spilling to other regions"]
