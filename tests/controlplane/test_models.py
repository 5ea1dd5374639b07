"""Models in the global plane, end to end on loopback: real agents over real simulated nodes
publish their capacity per model into real etcd, and the controller's window passes choose
backups per model.

eu-west serves models A and B, eu-central A only, us-east A and B (outside the eu).  When
eu-west fails (its nodes' health checks fail: a real fault on the real nodes), its traffic goes
to eu-central, which serves A; B has no backup the eu residency allows, and an event says so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

import meridian_etcd
from controlplane.reconcile import fleet, windows
from controlplane.settings import ControllerSettings
from meridian_service.clock import WallClock
from meridian_wire import keys
from meridian_wire.models import Event, FleetPlan, RegionDesired, RegionHealth
from tests.conftest import NodeFactory
from tests.support import EtcdServer
from tests.support.agent import AgentFactory

WINDOW_S = 0.5
FLEET = {
    "eu-west": ("eu", ["eu"], ["A", "B"]),
    "eu-central": ("eu", ["eu"], ["A"]),
    "us-east": ("us", [], ["A", "B"]),
}


def _settings(etcd: EtcdServer) -> ControllerSettings:
    return ControllerSettings(
        etcd={"endpoints": [etcd.url]},
        failover={
            "window_s": WINDOW_S,
            "strikes": 2,
            "min_hold_s": 0.0,
            "agent_heartbeat_s": 1.0,
            "status_stale_s": 3.0,
        },
        regions=[
            {"id": r, "geo": geo, "residency": residency}
            for r, (geo, residency, _) in FLEET.items()
        ],
        latency_ms={"eu-west": {"eu-central": 25.0, "us-east": 75.0}},
    )  # type: ignore[arg-type]


def _region(etcd: EtcdServer, region: str, geo: str, residency: list[str]) -> dict[str, Any]:
    return {
        "id": region, "geo": geo, "residency": residency, "etcd": [etcd.url],
        "endpoints": [f"http://{region}.example:8080"], "agent_id": f"{region}-a1",
        "lease_ttl_s": 2, "window_s": 1.0, "min_interval_s": 0.1, "load_min_interval_s": 0.5,
        "retry_base_s": 0.1, "retry_max_s": 0.5, "etcd_timeout_s": 1.0,
    }  # fmt: skip


async def _health(store: meridian_etcd.Store, region: str) -> RegionHealth | None:
    entry = await store.get(keys.health(region))
    return None if entry is None else RegionHealth.model_validate_json(entry.value)


async def _passes_until(
    store: meridian_etcd.Store, settings: ControllerSettings, what: str, done: Any
) -> None:
    """Window passes every WINDOW_S until ``await done()`` (at most 30 s)."""
    for _ in range(int(30 / WINDOW_S)):
        await windows.reconcile_once(store=store, fence=None, settings=settings, clock=WallClock())
        if await done():
            return
        await asyncio.sleep(WINDOW_S)
    raise AssertionError(f"timed out waiting for {what}")


async def test_eu_west_failing_moves_a_to_eu_central_and_b_nowhere_outside_the_eu(
    store: meridian_etcd.Store,
    etcd: EtcdServer,
    sim_node: NodeFactory,
    start_agent: AgentFactory,
) -> None:
    nodes: dict[str, list[str]] = {}
    for region, (geo, residency, models) in FLEET.items():
        nodes[region] = [await sim_node(model=m, seed=i) for i, m in enumerate(models)]
        await start_agent(
            nodes[region],
            region=_region(etcd, region, geo, residency),
            health={"probe_interval_s": 0.2, "probe_timeout_s": 0.5},
        )
    settings = _settings(etcd)

    async def published() -> bool:
        view = await fleet.read(store)
        return all(
            (r := view.regions.get(region)) is not None
            and r.status is not None
            and r.status.models == dict.fromkeys(models, 1.0)
            for region, (_, _, models) in FLEET.items()
        )

    await _passes_until(store, settings, "every region's models published", published)

    async def chosen() -> bool:
        west = await _health(store, "eu-west")
        return west is not None and west.model_backups == {"A": "eu-central", "B": None}

    await _passes_until(store, settings, "eu-west's backups per model", chosen)
    entry = await store.get(keys.desired("eu-central"))
    assert entry is not None
    central = RegionDesired.model_validate_json(entry.value)
    assert central.model_floors == {"A": 0.5}  # half of eu-west's A kept warm in eu-central
    assert "eu-west" in central.protects

    async with aiohttp.ClientSession() as session:  # eu-west's nodes fail their health checks
        for url in nodes["eu-west"]:
            async with session.post(f"{url}/admin/faults", json={"fail_health": True}) as r:
                assert r.status == 200

    async def west_failed() -> bool:
        west = await _health(store, "eu-west")
        return west is not None and west.state == "failed"

    await _passes_until(store, settings, "eu-west failed", west_failed)
    west = await _health(store, "eu-west")
    assert west is not None and west.backup == "eu-central"
    assert west.model_backups == {"A": "eu-central", "B": None}
    plan_entry = await store.get(keys.PLAN)
    assert plan_entry is not None
    plan = FleetPlan.model_validate_json(plan_entry.value)
    assert plan.serving["eu"] == {"eu-central": 1.0}  # A's traffic; B's has nowhere to go
    assert plan.serving["us"] == {"us-east": 1.0}  # never across the residency line

    events = [
        Event.model_validate_json(e.value) for e in (await store.get_prefix(keys.EVENTS)).entries
    ]
    west_events = [e for e in events if e.kind == "model" and e.region == "eu-west"]
    no_b = sorted(
        (e for e in west_events if "backup" in e.data), key=lambda e: str(e.data["model"])
    )
    assert [(e.data["model"], e.data["backup"]) for e in no_b] == [
        ("A", "eu-central"),
        ("B", None),
    ]
    assert no_b[1].reason == (
        "model B has no compliant backup: no region that meets residency eu serves B "
        "(eu-central does not serve it; us-east lacks residency eu)"
    )
    # its dead nodes' models are published with no capacity: not counted, said once each
    ignored = sorted(e.data["model"] for e in west_events if e.data.get("ignored"))
    assert ignored == ["A", "B"]


async def test_a_backup_starts_nodes_of_the_model_it_keeps_warm(
    store: meridian_etcd.Store,
    etcd: EtcdServer,
    sim_node: NodeFactory,
    start_agent: AgentFactory,
) -> None:
    """eu-west serves A on 1 node and B on 3; eu-central, its backup for both, A and B on one
    each.  The controller asks eu-central to keep half of each warm: A 0.5 (met), B 1.5 (short
    by 0.5), and a region floor of 2 (met).  A region floor alone would start nothing; eu-central's
    autoscaler starts one node serving B, and the controller sees B's capacity grow to 2."""
    fleet_models = {"eu-west": ["A", "B", "B", "B"], "eu-central": ["A", "B"]}
    agents = {}
    for region, models in fleet_models.items():
        urls = [await sim_node(model=m, seed=i) for i, m in enumerate(models)]
        autoscaler = (
            {"actuator": "simulator", "profile": "cpu-tiny", "time_scale": 20.0,
             "max_nodes": 3, "interval_s": 0.2, "scale_down_delay_s": 3600}
            if region == "eu-central"
            else {}
        )  # fmt: skip
        agents[region] = await start_agent(
            urls,
            region=_region(etcd, region, "eu", ["eu"]),
            health={"probe_interval_s": 0.2, "probe_timeout_s": 0.5},
            autoscaler=autoscaler,
        )
    settings = ControllerSettings(
        etcd={"endpoints": [etcd.url]},
        failover={"window_s": WINDOW_S, "strikes": 2, "min_hold_s": 0.0,
                  "agent_heartbeat_s": 1.0, "status_stale_s": 3.0},
        regions=[{"id": r, "geo": "eu", "residency": ["eu"]} for r in fleet_models],
    )  # type: ignore[arg-type]  # fmt: skip

    async def central_models() -> dict[str, float]:
        view = await fleet.read(store)
        r = view.regions.get("eu-central")
        return {} if r is None or r.status is None else r.status.models

    async def b_kept_warm() -> bool:
        return (await central_models()).get("B") == 2.0

    await _passes_until(store, settings, "eu-central serving B on 2 nodes", b_kept_warm)
    entry = await store.get(keys.desired("eu-central"))
    assert entry is not None
    central = RegionDesired.model_validate_json(entry.value)
    assert central.model_floors == {"A": 0.5, "B": 1.5} and central.capacity_floor == 2.0
    assert await central_models() == {"A": 1.0, "B": 2.0}
    scaler = agents["eu-central"].autoscaler
    assert scaler is not None
    started = scaler.actuator.started  # type: ignore[attr-defined]
    assert [s.model for s in started.values()] == ["B"]  # one node, of the model that was short
    assert agents["eu-west"].autoscaler is None
