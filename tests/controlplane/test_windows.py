"""The window loop against real etcd, one pass at a time with a driven clock.

Regions here are published straight into etcd the way an agent does (``meridian_wire`` keys and
models), so each test controls exactly what the controller sees; the agent's own publisher is
tested in tests/agent/test_publisher.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import meridian_etcd
from controlplane.reconcile import fleet, windows
from controlplane.settings import ControllerSettings
from meridian_wire import keys
from meridian_wire.models import FleetPlan, RegionDesired, RegionHealth, RegionLoad, RegionStatus
from tests.support import EtcdServer, ManualClock
from tests.support.etcd import client as etcd_client

WINDOW_S = 30.0


def _settings(**failover: Any) -> ControllerSettings:
    return ControllerSettings(
        etcd={"endpoints": ["http://127.0.0.1:1"]},
        failover={"window_s": WINDOW_S, "min_hold_s": 0.0, **failover},
        regions=[
            {"id": "eu-west", "geo": "eu", "residency": ["eu"], "lat": 53.3, "lon": -6.3},
            {"id": "eu-north", "geo": "eu", "residency": ["eu"], "lat": 59.3, "lon": 18.1},
            {"id": "us-east", "geo": "us", "residency": [], "lat": 39.0, "lon": -77.5},
        ],
    )  # type: ignore[arg-type]


async def _publish(
    store: meridian_etcd.Store,
    clock: ManualClock,
    region: str,
    *,
    capacity: float = 4.0,
    healthy: int = 4,
    total: int = 4,
    alive: bool = True,
    error_rate: float = 0.0,
    agent: str = "a1",
    in_flight: int = 0,
) -> None:
    geo = "us" if region.startswith("us") else "eu"
    status = RegionStatus(
        region=region,
        geo=geo,
        residency=[] if geo == "us" else ["eu"],
        endpoints=[f"http://{region}.example:8080"],
        nodes_healthy=healthy,
        nodes_total=total,
        capacity=capacity,
        load=RegionLoad(error_rate=error_rate, in_flight=in_flight),
        agent_id=agent,
        updated_at=clock.now(),
    )
    await store.put(keys.agent_status(region, agent), status.model_dump_json().encode())
    if alive:
        await store.put(keys.agent_alive(region, agent), b"")
    else:
        await store.delete(keys.agent_alive(region, agent))


async def _health(store: meridian_etcd.Store, region: str) -> RegionHealth:
    entry = await store.get(keys.health(region))
    assert entry is not None
    return RegionHealth.model_validate_json(entry.value)


async def _west_down_for_three_windows(
    store: meridian_etcd.Store, clock: ManualClock, settings: ControllerSettings
) -> list[tuple[str, int]]:
    """eu-west's (state, strikes) after each of three windows in which only the others publish."""
    states: list[tuple[str, int]] = []
    for _ in range(3):
        await _window(store, clock, settings, up=["eu-north", "us-east"])
        h = await _health(store, "eu-west")
        states.append((h.state, h.strikes))
    return states


async def _desired(store: meridian_etcd.Store, region: str) -> RegionDesired:
    entry = await store.get(keys.desired(region))
    assert entry is not None
    return RegionDesired.model_validate_json(entry.value)


async def _window(
    store: meridian_etcd.Store, clock: ManualClock, settings: ControllerSettings, *, up: list[str]
) -> windows.PassResult:
    """One window: the regions in ``up`` refresh their status, then the controller judges."""
    clock.t += WINDOW_S
    for region in up:
        await _publish(store, clock, region)
    return await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)


ALL = ["eu-west", "eu-north", "us-east"]


async def test_a_region_whose_agent_stops_is_failed_after_exactly_three_windows(
    store: meridian_etcd.Store,
) -> None:
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=ALL)
    assert (await _health(store, "eu-west")).state == "healthy"
    # eu-west's agent stops: its lease (here: the alive key) goes, its status goes stale
    await store.delete(keys.agent_alive("eu-west", "a1"))
    assert await _west_down_for_three_windows(store, clock, settings) == [
        ("suspect", 1),
        ("suspect", 2),
        ("failed", 3),
    ]
    health = await _health(store, "eu-west")
    assert health.weight == 0.0 and "lease" in health.reason
    assert health.backup == "eu-north"
    # its traffic moved to the backup in the plan DNS will apply
    plan_entry = await store.get(keys.PLAN)
    assert plan_entry is not None
    plan = FleetPlan.model_validate_json(plan_entry.value)
    assert plan.serving["eu"] == {"eu-north": 1.0}
    # events record every strike and the state changes, with reasons
    events = [json.loads(e.value) for e in (await store.get_prefix(keys.EVENTS)).entries]
    kinds = [(e["kind"], e["region"]) for e in events if e["region"] == "eu-west"]
    assert kinds.count(("strike", "eu-west")) == 3
    assert ("failover", "eu-west") in kinds
    assert all(e["reason"] for e in events)


async def test_backup_floor_is_half_the_protected_capacity_and_follows_it_up(
    store: meridian_etcd.Store,
) -> None:
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=ALL)
    desired = await _desired(store, "eu-north")
    assert "eu-west" in desired.protects
    assert desired.capacity_floor >= 0.5 * 4.0
    # eu-west grows to 10 nodes' worth of capacity: the backup's floor rises with it
    clock.t += WINDOW_S
    await _publish(store, clock, "eu-west", capacity=10.0, healthy=10, total=10)
    for region in ("eu-north", "us-east"):
        await _publish(store, clock, region)
    await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)
    assert (await _desired(store, "eu-north")).capacity_floor >= 5.0
    # eu-west dies: the floor is kept, not collapsed
    await store.delete(keys.agent_alive("eu-west", "a1"))
    for _ in range(3):
        await _window(store, clock, settings, up=["eu-north", "us-east"])
    assert (await _health(store, "eu-west")).state == "failed"
    assert (await _desired(store, "eu-north")).capacity_floor >= 5.0


async def test_residency_is_honoured_even_when_a_closer_bigger_region_exists(
    store: meridian_etcd.Store,
) -> None:
    clock = ManualClock()
    settings = _settings()
    # us-east has far more headroom; eu traffic must still stay in eu
    clock.t += WINDOW_S
    await _publish(store, clock, "us-east", capacity=100.0, healthy=100, total=100)
    await _publish(store, clock, "eu-west")
    await _publish(store, clock, "eu-north")
    await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)
    assert (await _health(store, "eu-west")).backup == "eu-north"
    # with eu-north gone too, eu-west has no compliant backup: reported, never us-east
    await store.delete(keys.agent_alive("eu-north", "a1"))
    await store.delete(keys.agent_alive("eu-west", "a1"))
    for _ in range(3):
        await _window(store, clock, settings, up=["us-east"])
    west = await _health(store, "eu-west")
    assert west.backup is None
    plan_entry = await store.get(keys.PLAN)
    assert plan_entry is not None
    plan = FleetPlan.model_validate_json(plan_entry.value)
    assert "us-east" not in plan.serving.get("eu", {})
    assert plan.alert is not None  # never all off: eu keeps its last answer, with an alert


async def test_recovery_ramps_the_weight_back(store: meridian_etcd.Store) -> None:
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=ALL)
    await store.delete(keys.agent_alive("eu-west", "a1"))
    for _ in range(3):
        await _window(store, clock, settings, up=["eu-north", "us-east"])
    assert (await _health(store, "eu-west")).state == "failed"
    seen = []
    for _ in range(6):
        await _window(store, clock, settings, up=ALL)
        h = await _health(store, "eu-west")
        seen.append((h.state, h.weight))
    assert seen[0] == ("failed", 0.0)  # one good window is not enough
    ramp = [w for s, w in seen if s == "recovering"]
    assert ramp == [0.05, 0.25, 0.5]
    assert seen[-1] == ("healthy", 1.0)


async def test_a_malformed_status_is_reported_and_ignored_for_the_window(
    store: meridian_etcd.Store, caplog: pytest.LogCaptureFixture
) -> None:
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=ALL)
    clock.t += WINDOW_S
    for region in ("eu-north", "us-east"):
        await _publish(store, clock, region)
    bad_key = keys.agent_status("eu-west", "a1")
    await store.put(bad_key, b'{"region": "eu-west", "nodes_healthy": "many"}')
    await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)
    assert (await _health(store, "eu-west")).state == "healthy"  # not a strike
    assert any(
        bad_key in r.getMessage() and "nodes_healthy" in r.getMessage() for r in caplog.records
    )


async def test_with_two_agents_one_stopping_does_not_fail_the_region(
    store: meridian_etcd.Store,
) -> None:
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=ALL)
    await _publish(store, clock, "eu-west", agent="a2", in_flight=7)
    view = await fleet.read(store)
    assert view.regions["eu-west"].status is not None
    assert set(view.regions["eu-west"].agents) == {"a1", "a2"}
    # a1 stops: its lease (here: its keys) goes; a2 keeps publishing
    await store.delete(keys.agent_alive("eu-west", "a1"))
    await store.delete(keys.agent_status("eu-west", "a1"))
    for _ in range(4):
        clock.t += WINDOW_S
        for region in ("eu-north", "us-east"):
            await _publish(store, clock, region)
        await _publish(store, clock, "eu-west", agent="a2")
        await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)
        h = await _health(store, "eu-west")
        assert (h.state, h.strikes) == ("healthy", 0), h.reason
    # a2 stops too: now the region fails after exactly three windows
    await store.delete(keys.agent_alive("eu-west", "a2"))
    assert await _west_down_for_three_windows(store, clock, settings) == [
        ("suspect", 1),
        ("suspect", 2),
        ("failed", 3),
    ]


async def test_the_single_keys_of_older_agents_still_count(store: meridian_etcd.Store) -> None:
    """An agent from before per-agent keys writes regions/<r>/alive and /status."""
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=["eu-north", "us-east"])
    old = RegionStatus(
        region="eu-west", geo="eu", residency=["eu"], nodes_healthy=3, nodes_total=4,
        capacity=3.0, updated_at=clock.now(),
    )  # fmt: skip
    for _ in range(2):
        clock.t += WINDOW_S
        old = old.model_copy(update={"updated_at": clock.now()})
        await store.put(keys.status("eu-west"), old.model_dump_json().encode())
        await store.put(keys.alive("eu-west"), b"")
        for region in ("eu-north", "us-east"):
            await _publish(store, clock, region)
        await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)
        assert (await _health(store, "eu-west")).state == "healthy"
    record = (await fleet.read(store)).regions["eu-west"]
    assert record.alive and record.status is not None and record.status.capacity == 3.0
    assert set(record.agents) == {fleet.LEGACY_AGENT}


async def test_a_new_pass_continues_from_the_stored_plan(store: meridian_etcd.Store) -> None:
    """What one leader judged, the next leader continues: state lives in etcd, not memory."""
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=ALL)
    await store.delete(keys.agent_alive("eu-west", "a1"))
    await _window(store, clock, settings, up=["eu-north", "us-east"])
    await _window(store, clock, settings, up=["eu-north", "us-east"])
    # "another controller" (a fresh store and call) takes the third window
    other = etcd_client(store.endpoint)
    try:
        clock.t += WINDOW_S
        for region in ("eu-north", "us-east"):
            await _publish(store, clock, region)
        await windows.reconcile_once(store=other, fence=None, settings=settings, clock=clock)
    finally:
        await other.close()
    assert (await _health(store, "eu-west")).state == "failed"


async def test_nothing_is_rewritten_when_nothing_changed(
    store: meridian_etcd.Store, etcd: EtcdServer
) -> None:
    clock, settings = ManualClock(), _settings()
    await _window(store, clock, settings, up=ALL)
    before = {k: (await store.get(k)) for k in (keys.health("eu-west"), keys.desired("eu-north"))}
    result = await _window(store, clock, settings, up=ALL)
    after = {k: (await store.get(k)) for k in before}
    for key in before:
        assert before[key] is not None and after[key] is not None
        assert before[key].mod_revision == after[key].mod_revision  # type: ignore[union-attr]
    assert result.writes == 1  # the plan (window counter) only


async def test_a_clock_step_on_the_controller_fails_no_region_a_stopped_status_still_ages(
    store: meridian_etcd.Store,
) -> None:
    """The controller's wall clock jumps an hour ahead (NTP fixing a drifted VM): every status
    is an hour old by the wall clocks.  The window loop's own monotonic memory says they keep
    changing, so nobody fails; a status that stops changing still ages and fails its windows."""
    settings = _settings()
    agents = ManualClock()  # the agents' wall clock
    controller = ManualClock(agents.t)
    mono = ManualClock(0.0)
    freshness = windows.Freshness(monotonic=mono.now)

    async def window(up: list[str]) -> None:
        agents.t += WINDOW_S
        controller.t += WINDOW_S
        mono.t += WINDOW_S
        for region in up:
            await _publish(store, agents, region)
        await windows.reconcile_once(
            store=store, fence=None, settings=settings, clock=controller, freshness=freshness
        )

    for _ in range(2):
        await window(ALL)
    controller.t += 3600.0  # the step
    for _ in range(4):
        await window(ALL)
    for region in ALL:
        h = await _health(store, region)
        assert (h.state, h.strikes) == ("healthy", 0), (region, h)
    # eu-west's agent stays alive but its status stops changing: it ages by the monotonic clock
    for _ in range(5):  # stale after 60 s (two windows), then three strikes
        await window(["eu-north", "us-east"])
        await store.put(keys.agent_alive("eu-west", "a1"), b"")
    west = await _health(store, "eu-west")
    assert west.state == "failed" and "status" in west.reason, west
    assert (await _health(store, "eu-north")).state == "healthy"


async def test_a_fleet_bigger_than_one_etcd_transaction_is_judged_and_written(
    store: meridian_etcd.Store,
) -> None:
    """100 regions: the first pass writes 2 keys per region, the plan and the events, more than
    etcd takes in one transaction (--max-txn-ops 128); found by the scale benchmark, where the
    controller lost its leadership over and over on "too many operations in txn request"."""
    clock = ManualClock()
    names = [f"r{i:03d}" for i in range(100)]
    settings = ControllerSettings(
        etcd={"endpoints": ["http://127.0.0.1:1"]},
        failover={"window_s": WINDOW_S, "min_hold_s": 0.0},
        regions=[
            {"id": r, "geo": f"g{i // 10}", "backups": [names[i + 1 if i % 10 < 9 else i - 9]]}
            for i, r in enumerate(names)
        ],
    )  # type: ignore[arg-type]
    for region in names:
        await _publish(store, clock, region)
    lease = await store.grant(ttl_s=30)
    holder = await store.claim(keys.LEADER, b"ctl-a", lease=lease)
    assert holder is not None
    fence = meridian_etcd.Fence(
        key=keys.LEADER, value=holder.value, create_revision=holder.create_revision
    )
    first = await windows.reconcile_once(
        store=store, fence=fence, settings=settings, clock=clock, judge=False
    )
    assert first.writes > settings.etcd.max_txn_ops
    healths = (await store.get_prefix(keys.REGIONS)).entries
    assert sum(e.key.endswith("/health") for e in healths) == 100
    assert sum(e.key.endswith("/desired") for e in healths) == 100
    plan_entry = await store.get(keys.PLAN)
    assert plan_entry is not None  # written last, after the keys it describes
    assert plan_entry.mod_revision == max(e.mod_revision for e in (*healths, plan_entry))
    plan = FleetPlan.model_validate_json(plan_entry.value)
    assert len(plan.last_status) == 100 and sum(len(s) for s in plan.serving.values()) == 100
    clock.t += WINDOW_S
    for region in names:
        await _publish(store, clock, region)
    second = await windows.reconcile_once(store=store, fence=fence, settings=settings, clock=clock)
    assert second.window == first.window + 1
    assert (await _health(store, "r042")).state == "healthy"
