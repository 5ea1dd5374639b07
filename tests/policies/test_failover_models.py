"""policies.failover with models: backups chosen per model (residency first, then model
coverage, then proximity and headroom), floors per model, the event of a model with no
compliant backup, and a status claiming a model with no capacity."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
NOW = 1_800_000_000.0


def _status(models: Mapping[str, float] | None) -> StatusSnapshot:
    capacity = sum(models.values()) if models else 2.0
    return StatusSnapshot(
        nodes_healthy=2, nodes_total=2, capacity=capacity, error_rate=0.0, ttft_p99_s=0.5,
        models=models,
    )  # fmt: skip


def _ok(region: str, models: Mapping[str, float] | None) -> Observation:
    return Observation(
        region=RegionId(region), alive=True, status=_status(models), status_age_s=1.0
    )


def _windows(
    topology: Topology,
    models: Mapping[str, Mapping[str, float] | None],
    *,
    down: Sequence[str] = (),
    windows: int = 4,
    state: FleetState | None = None,
) -> tuple[FleetState, list[failover.Event]]:
    """``windows`` judged windows: every region good but those in ``down`` (lease gone)."""
    state = state or FleetState()
    events: list[failover.Event] = []
    for i in range(windows):
        observations = [
            Observation(region=RegionId(r), alive=False) if r in down else _ok(r, models[r])
            for r in topology.regions
        ]
        result = failover.plan(
            state, observations, topology=topology, config=CONFIG, now=NOW + 30 * i
        )
        state = result.state
        events += result.events
    return state, events


# The loopback fleet: eu-west serves A and B, eu-central A only, us-east A and B.
FLEET = Topology.build(
    [
        RegionInfo(region=RegionId("eu-west"), geo="eu", residency=frozenset({"eu"})),
        RegionInfo(region=RegionId("eu-central"), geo="eu", residency=frozenset({"eu"})),
        RegionInfo(region=RegionId("us-east"), geo="us"),
    ],
    {
        (RegionId("eu-west"), RegionId("eu-central")): 25.0,
        (RegionId("eu-west"), RegionId("us-east")): 75.0,
        (RegionId("eu-central"), RegionId("us-east")): 90.0,
    },
)
MODELS: dict[str, Mapping[str, float] | None] = {
    "eu-west": {"A": 2.0, "B": 2.0},
    "eu-central": {"A": 2.0},
    "us-east": {"A": 1.0, "B": 1.0},
}


def test_eu_west_failing_moves_a_to_eu_central_and_b_nowhere_outside_the_eu() -> None:
    healthy, events = _windows(FLEET, MODELS, windows=2)
    west = healthy.verdicts[RegionId("eu-west")]
    assert west.backup == "eu-central"
    assert west.model_backups == (("A", "eu-central"), ("B", None))
    (no_b,) = [
        e
        for e in events
        if e.kind == "model" and e.region == "eu-west" and e.data.get("backup") is None
    ]
    assert no_b.data["model"] == "B"
    assert no_b.reason == (
        "model B has no compliant backup: no region that meets residency eu serves B "
        "(eu-central does not serve it; us-east lacks residency eu)"
    )
    # kept warm before it is needed: eu-central holds half of eu-west's A, per model
    central = healthy.verdicts[RegionId("eu-central")]
    assert central.model_floors == (("A", 1.0),)
    assert central.capacity_floor == 0.5 * 4.0  # the region's floor is the whole capacity's

    failed, events = _windows(FLEET, MODELS, down=["eu-west"], state=healthy)
    west = failed.verdicts[RegionId("eu-west")]
    assert west.state == "failed"
    assert failed.serving["eu"] == {"eu-central": 1.0}
    assert west.model_backups == (("A", "eu-central"), ("B", None))  # remembered while down
    moved = [(e.region, e.data["model"], e.data["backup"]) for e in events if e.kind == "model"]
    # said once, not every window; and the regions eu-west backed up lost their only backup
    assert moved == [
        ("eu-central", "A", None),
        ("us-east", "A", "eu-central"),
        ("us-east", "B", None),
    ]


# three eu regions: eu-central 10 ms from eu-west, eu-north 40 ms
THREE_EU = Topology.build(
    [
        RegionInfo(region=RegionId("eu-west"), geo="eu", residency=frozenset({"eu"})),
        RegionInfo(region=RegionId("eu-central"), geo="eu", residency=frozenset({"eu"})),
        RegionInfo(region=RegionId("eu-north"), geo="eu", residency=frozenset({"eu"})),
    ],
    {
        (RegionId("eu-west"), RegionId("eu-central")): 10.0,
        (RegionId("eu-west"), RegionId("eu-north")): 40.0,
    },
)


def test_a_backup_that_serves_every_model_wins_over_a_nearer_one_that_serves_some() -> None:
    topology = THREE_EU
    models = {
        "eu-west": {"A": 2.0, "B": 1.0},
        "eu-central": {"A": 4.0},
        "eu-north": {"A": 1.0, "B": 1.0},
    }
    state, _ = _windows(topology, models, windows=1)
    west = state.verdicts[RegionId("eu-west")]
    assert west.backup == "eu-north"
    assert west.model_backups == (("A", "eu-north"), ("B", "eu-north"))
    assert "all of A, B" not in west.backup_reason


def test_each_model_gets_its_own_backup_when_none_serves_them_all() -> None:
    topology = THREE_EU
    models = {"eu-west": {"A": 2.0, "B": 1.0}, "eu-central": {"A": 4.0}, "eu-north": {"B": 3.0}}
    state, _ = _windows(topology, models, windows=1)
    west = state.verdicts[RegionId("eu-west")]
    assert west.backup == "eu-central"  # the nearest that serves any of them
    assert west.model_backups == (("A", "eu-central"), ("B", "eu-north"))
    assert state.verdicts[RegionId("eu-north")].model_floors == (("B", 0.5),)


def test_a_status_claiming_a_model_with_no_capacity_is_ignored_for_it_with_an_event() -> None:
    models = {**MODELS, "eu-central": {"A": 2.0, "B": 0.0}}
    state, events = _windows(FLEET, models, windows=3)
    claims = [e for e in events if e.kind == "model" and e.data.get("ignored")]
    assert [(e.region, e.data["model"]) for e in claims] == [("eu-central", "B")]
    assert claims[0].reason == (
        "its status claims model B with no capacity (no healthy node serves it): not counted "
        "as serving B"
    )
    assert state.verdicts[RegionId("eu-west")].model_backups == (("A", "eu-central"), ("B", None))
    assert state.verdicts[RegionId("eu-central")].serving_models == (("A", 2.0),)


def test_regions_that_publish_no_models_are_backed_up_as_before() -> None:
    state, events = _windows(FLEET, dict.fromkeys(MODELS), windows=1)
    west = state.verdicts[RegionId("eu-west")]
    assert west.backup == "eu-central" and west.model_backups == ()
    assert not [e for e in events if e.kind == "model"]


# -- properties --------------------------------------------------------------------------------

TAGS = st.sampled_from([frozenset(), frozenset({"eu"}), frozenset({"eu", "de"}), frozenset({"us"})])
MODEL_SETS = st.dictionaries(
    st.sampled_from(["A", "B", "C"]), st.sampled_from([0.0, 1.0, 2.5]), max_size=3
)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[Topology, dict[str, Mapping[str, float] | None], list[str]]:
    n = draw(st.integers(min_value=2, max_value=6))
    names = [f"r{i}" for i in range(n)]
    infos = []
    for name in names:
        backups = draw(st.lists(st.sampled_from(names), max_size=2, unique=True))
        infos.append(
            RegionInfo(
                region=RegionId(name),
                geo=draw(st.sampled_from(["eu", "us"])),
                residency=draw(TAGS),
                backups=tuple(RegionId(b) for b in backups if b != name),
                coordinates=(draw(st.floats(-60, 60)), draw(st.floats(-170, 170))),
            )
        )
    models = {
        name: draw(st.none() | MODEL_SETS) for name in names
    }  # None: an older agent, no models published
    down = draw(st.lists(st.sampled_from(names), max_size=n - 1, unique=True))
    return Topology.build(infos), models, down


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_failover_never_moves_a_models_traffic_where_it_is_not_served_nor_breaks_residency(
    fleet: tuple[Topology, dict[str, Mapping[str, float] | None], list[str]],
) -> None:
    topology, models, down = fleet
    healthy, _ = _windows(topology, models, windows=1)
    state, _ = _windows(topology, models, down=down, windows=4, state=healthy)

    def serves(region: RegionId, model: str) -> bool:
        offered = models[region]
        return offered is None or offered.get(model, 0.0) > 0

    for region, verdict in state.verdicts.items():
        needs = topology.regions[region].residency
        own = [m for m, _ in verdict.serving_models]
        assert own == sorted(m for m, c in (models[region] or {}).items() if c > 0)
        for model, backup in verdict.model_backups:
            if backup is None:
                continue
            assert backup != region
            assert needs <= topology.regions[backup].residency
            assert serves(backup, model), (region, model, backup)
            assert state.verdicts[backup].state not in ("failed", "drained")
        if verdict.backup is not None:
            assert needs <= topology.regions[verdict.backup].residency
            if own:
                assert any(serves(verdict.backup, m) for m in own)
        # what moves by DNS moves to the region's backup: every model it serves there has it
        for model, backup in verdict.model_backups:
            if verdict.backup is not None and serves(verdict.backup, model):
                assert backup == verdict.backup
        # floors per model add up to what the regions relying on it serve of that model
        for model, floor in state.verdicts[region].model_floors:
            relying = sum(
                dict(v.serving_models).get(model, 0.0)
                for v in state.verdicts.values()
                if dict(v.model_backups).get(model) == region
            )
            assert abs(floor - CONFIG.prewarm_fraction * relying) < 1e-6
