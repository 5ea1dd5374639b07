"""The controller's view of several agents per region and of the regions' group tables
(controlplane/reconcile/fleet.py), on real etcd; ``combine`` table-driven."""

from __future__ import annotations

import pytest

import meridian_etcd
from controlplane.reconcile import fleet
from meridian_wire import keys
from meridian_wire.models import GroupLayout, GroupTable, RegionLoad, RegionStatus
from policies import groups

NOW = 1_800_000_000.0


def _status(region: str = "eu-west", **kw: object) -> RegionStatus:
    values: dict[str, object] = {
        "region": region,
        "geo": "eu",
        "residency": ["eu"],
        "endpoints": [f"https://{region}.example"],
        "nodes_healthy": 4,
        "nodes_total": 4,
        "capacity": 4.0,
        "updated_at": NOW,
        **kw,
    }
    return RegionStatus.model_validate(values)


# -- combine ---------------------------------------------------------------------------------------


def test_combine_takes_node_figures_once_and_sums_traffic() -> None:
    a = _status(
        agent_id="a1", nodes_healthy=3, capacity=3.0, updated_at=NOW - 5, observed_generation=7,
        load=RegionLoad(queue_depth=2, in_flight=10, kv_util=0.4, requests_per_s=10.0,
                        error_rate=0.1, ttft_p99_s=0.5),
    )  # fmt: skip
    b = _status(
        agent_id="a2", nodes_healthy=4, capacity=4.0, observed_generation=6,
        endpoints=["https://eu-west.example", "https://eu-west-2.example"],
        load=RegionLoad(queue_depth=1, in_flight=5, kv_util=0.3, requests_per_s=30.0,
                        error_rate=0.0, ttft_p99_s=None),
    )  # fmt: skip
    c = fleet.combine([a, b])
    assert (c.nodes_healthy, c.nodes_total, c.capacity) == (4, 4, 4.0)  # same nodes: max
    assert (c.load.queue_depth, c.load.in_flight) == (3, 15)  # own requests: summed
    assert c.load.requests_per_s == 40.0
    assert c.load.error_rate == pytest.approx(0.025)  # weighted by requests/s
    assert c.load.kv_util == 0.4 and c.load.ttft_p99_s == 0.5
    assert c.updated_at == NOW and c.observed_generation == 6  # freshest; what all applied
    assert c.agent_id == "a1,a2"
    assert c.endpoints == ["https://eu-west.example", "https://eu-west-2.example"]
    assert fleet.combine([a]) == a
    with pytest.raises(ValueError, match="at least one"):
        fleet.combine([])


async def test_a_region_is_alive_while_any_agent_is_and_dead_agents_do_not_count(
    store: meridian_etcd.Store,
) -> None:
    await store.put(keys.agent_alive("eu-west", "a1"), b"")
    await store.put(
        keys.agent_status("eu-west", "a1"), _status(capacity=2.0).model_dump_json().encode()
    )
    # a2 left a status but its liveness is gone: not counted while a1 lives
    await store.put(
        keys.agent_status("eu-west", "a2"), _status(capacity=9.0).model_dump_json().encode()
    )
    await store.put(keys.agent_status("eu-west", "a3"), b"{broken")
    view = await fleet.read(store)
    record = view.regions["eu-west"]
    assert record.alive and record.status is not None and record.status.capacity == 2.0
    assert set(record.agents) == {"a1", "a2", "a3"} and record.agents["a3"].status_bad
    assert [b.key for b in view.bad] == [keys.agent_status("eu-west", "a3")]
    await store.delete(keys.agent_alive("eu-west", "a1"))
    record = (await fleet.read(store)).regions["eu-west"]
    assert not record.alive  # no agent alive: the region's lease is gone


# -- group tables ----------------------------------------------------------------------------------


LAYOUT = GroupLayout(groups={"g0": 2.0, "g1": 2.0, "g2": 2.0}, n_buckets=1024)


def _range(region: str, first: int, end: int, owner: str) -> bytes:
    return (
        GroupTable(region=region, kind="prefix", first=first, end=end, owner=owner,
                   n_buckets=1024, agent="a1", updated_at=NOW - 4)
        .model_dump_json()
        .encode()
    )  # fmt: skip


async def test_the_controller_reads_tables_reports_bad_entries_and_ignores_them(
    store: meridian_etcd.Store,
) -> None:
    for region, layout in (("eu-west", LAYOUT), ("us-east", GroupLayout(groups={"u0": 1.0}))):
        await store.put(keys.agent_alive(region, "a1"), b"")
        await store.put(
            keys.agent_status(region, "a1"),
            _status(region, group_layout=layout).model_dump_json().encode(),
        )
    base = groups.assign({groups.GroupId(g): w for g, w in LAYOUT.groups.items()}, n_buckets=1024)
    bucket = 500
    home = base.lookup(bucket)
    other = next(g for g in LAYOUT.groups if g != home)
    good = keys.group("eu-west", "prefix", bucket)
    await store.put(good, _range("eu-west", bucket, bucket + 1, other))
    bad = {
        keys.group("eu-west", "prefix", 10): b"not json",
        keys.group("eu-west", "prefix", 20): _range("eu-west", 20, 21, "u0"),  # us-east's group
        keys.group("eu-west", "prefix", 30): _range("eu-west", 30, 31, "nowhere"),
        keys.group("eu-west", "prefix", 40): _range("eu-west", 41, 42, "g0"),  # key != value
        keys.group("eu-west", "prefix", 50): b'{"region": "eu-west", "first": 50, "end": 9999,'
        b' "owner": "g0", "n_buckets": 1024, "updated_at": 1}',
        keys.group("eu-north", "prefix", 0): _range("eu-north", 0, 1, "g0"),  # no agents at all
    }
    for key, value in bad.items():
        await store.put(key, value)
    await store.put(keys.ROUTING + "eu-west/groups/garbage", b"x")  # not a table key: skipped
    view = await fleet.read(store, tables=True)  # never raises on bad values
    reported = {b.key: b.problem for b in view.bad}
    assert set(reported) == set(bad), reported
    assert "not JSON" in reported[keys.group("eu-west", "prefix", 10)]
    assert (
        "'u0' is not a group of region 'eu-west'" in reported[keys.group("eu-west", "prefix", 20)]
    )
    assert "is not a non-empty span" in reported[keys.group("eu-west", "prefix", 50)]
    assert "no agent of region 'eu-north'" in reported[keys.group("eu-north", "prefix", 0)]
    table = view.regions["eu-west"].tables["prefix"]
    assert table.entries == 1  # only the good range counts
    expected = base.reassign(bucket, bucket + 1, other).shares()
    assert table.buckets == dict(sorted(expected.items()))
    assert sum(table.buckets.values()) == 1024 and set(table.buckets) <= set(LAYOUT.groups)
    # the read API's shape: groups with bucket counts, and staleness
    described = fleet.describe_tables(view.regions["eu-west"], now=NOW)
    assert described["prefix"]["stale_s"] == 4.0 and described["prefix"]["entries"] == 1
    assert described["session"]["entries"] == 0 and described["session"]["stale_s"] is None
    assert described["session"]["groups"] == dict(sorted(base.shares().items()))
    assert fleet.describe_agents(view.regions["eu-west"]) == {
        "a1": {"alive": True, "status_bad": False, "updated_at": NOW}
    }
