"""The autoscaler: the controller's capacity floor (``regions/<r>/desired`` in a real etcd)
turned into capacity by the simulator actuator's ``meridian-sim`` processes; the dry-run and
command actuators; the pure up-fast, down-slow plan."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meridian_wire import keys
from meridian_wire.models import RegionStatus
from regional_agent.autoscaler import Autoscaler, Command, DryRun, SimulatorActuator, plan
from regional_agent.errors import ActuatorError
from tests.agent import publishing
from tests.agent.publishing import REGION, eventually, put_desired, region, status
from tests.conftest import NodeFactory
from tests.support import EtcdServer
from tests.support.agent import ADMIN, AgentFactory, AgentHandle, AgentStarter

MODEL = "tiny-model"
AUTOSCALER_LOG = "regional_agent.autoscaler"


def _simulator(**overrides: object) -> dict[str, object]:
    return {
        "actuator": "simulator",
        "profile": "cpu-tiny",
        "time_scale": 20.0,
        "max_nodes": 3,
        "interval_s": 0.2,
        "scale_down_delay_s": 0.5,
        **overrides,
    }


def _actuator(handle: AgentHandle) -> SimulatorActuator:
    scaler = handle.autoscaler
    assert scaler is not None and isinstance(scaler.actuator, SimulatorActuator)
    return scaler.actuator


async def _complete(url: str, n: int) -> list[int]:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(f"{url}/v1/completions", json=body) as r:
                await r.read()
                out.append(r.status)
    return out


async def test_desired_floor_starts_sim_nodes_that_serve_then_scale_down_to_own_nodes(
    etcd: EtcdServer, sim_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUTOSCALER_LOG)
    own_url = await sim_node(profile_name="cpu-tiny")
    starter = AgentStarter()
    try:
        handle = await starter(
            [own_url], policy="round_robin", region=region(etcd), autoscaler=_simulator()
        )
        scaler = handle.autoscaler
        actuator = _actuator(handle)
        pool = handle.edge.pool
        async with publishing.client(etcd) as c:
            await eventually(lambda: status(c), what="the first status")
            await put_desired(c, {"capacity_floor": 3, "generation": 1})

            await eventually(lambda: len(pool) == 3, what="two nodes started", timeout_s=60)
            assert scaler is not None and scaler.floor == 3
            await eventually(lambda: scaler.current() >= 3, what="capacity 3")
            assert len(actuator.started) == 2

            async def published() -> RegionStatus | None:
                got = await status(c)
                return got[0] if got and got[0].capacity >= 3 else None

            st = await eventually(published, what="capacity 3 in the status")
            assert st.capacity_floor == 3 and st.nodes_healthy == 3

            # the new nodes serve traffic
            await eventually(lambda: pool.models() == {MODEL}, what="models known")
            assert await _complete(handle.url, 12) == [200] * 12
            for node_id in actuator.started:
                node = pool.get(node_id)
                assert node is not None and node.requests_total > 0, node_id

            processes = [s.process for s in actuator.started.values()]
            await put_desired(c, {"capacity_floor": 1, "generation": 2})
            await eventually(
                lambda: not actuator.started, what="the started nodes stopped", timeout_s=60
            )
            assert [n.url for n in pool] == [own_url]  # the node it did not start stays
            assert all(p.returncode is not None for p in processes)
            assert "autoscaler draining" in caplog.text and "autoscaler stopped" in caplog.text
    finally:
        await starter.close()


async def test_a_model_short_of_its_floor_gets_nodes_of_that_model_that_serve_it(
    etcd: EtcdServer, sim_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The region serves tiny-model; the controller asks it to keep 1 of "other" warm (it backs
    up a region that serves it): a node serving "other" starts, serves "other" through the
    agent, is published, also meets the region floor, and stops when the floor goes."""
    caplog.set_level(logging.INFO, logger=AUTOSCALER_LOG)
    own_url = await sim_node(profile_name="cpu-tiny")
    starter = AgentStarter()
    try:
        handle = await starter(
            [own_url], policy="round_robin", region=region(etcd), autoscaler=_simulator()
        )
        actuator, pool = _actuator(handle), handle.edge.pool
        async with publishing.client(etcd) as c:
            await eventually(lambda: status(c), what="the first status")
            floors = {"capacity_floor": 2, "model_floors": {"other": 1}, "generation": 1}
            await put_desired(c, floors)
            await eventually(
                lambda: pool.models() == {MODEL, "other"}, what="a node of other", timeout_s=60
            )
            assert [s.model for s in actuator.started.values()] == ["other"]

            async def published() -> RegionStatus | None:
                got = await status(c)
                return got[0] if got and got[0].models.get("other") == 1.0 else None

            st_ = await eventually(published, what="other's capacity in the status")
            assert st_.models == {MODEL: 1.0, "other": 1.0} and st_.capacity == 2
            await asyncio.sleep(1.0)  # a few ticks: the "other" node also met the region floor
            assert len(actuator.started) == 1
            assert handle.autoscaler is not None
            shown = handle.autoscaler.describe()["model_floors"]
            assert shown == [{"model": "other", "floor": 1.0, "current": 1.0, "short": 0.0}]

            body = {"model": "other", "prompt": "hello there", "max_tokens": 4}
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{handle.url}/v1/completions", json=body) as r,
            ):
                assert r.status == 200, await r.text()
                assert (await r.json())["model"] == "other"

            await put_desired(c, {"capacity_floor": 1, "generation": 2})
            await eventually(
                lambda: not actuator.started, what="the other node stopped", timeout_s=60
            )
            assert pool.models() == {MODEL}
            assert "model=other" in caplog.text
    finally:
        await starter.close()


async def test_a_node_is_not_stopped_while_its_model_needs_it(
    start_agent: AgentFactory, sim_node: NodeFactory
) -> None:
    """The region floor drops to 0 but "other" still has a floor of 1: its node stays."""
    handle = await start_agent(
        [await sim_node(profile_name="cpu-tiny")], autoscaler=_simulator(scale_down_delay_s=0.2)
    )
    scaler, actuator = handle.autoscaler, _actuator(handle)
    assert scaler is not None
    scaler.set_floor(0, {"other": 1})
    await eventually(lambda: len(actuator.started) == 1, what="a node of other", timeout_s=60)
    await eventually(lambda: scaler.needs() and scaler.needs()[0].short == 0, what="other met")
    await asyncio.sleep(1.5)  # many times the delay: the region floor alone would stop it
    assert len(actuator.started) == 1
    scaler.set_floor(0, {})
    await eventually(lambda: not actuator.started, what="stopped once not needed", timeout_s=60)


async def test_an_actuator_of_one_kind_of_node_gets_the_floor_raised_for_its_models(
    start_agent: AgentFactory, sim_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A dry-run actuator whose nodes serve tiny-model: tiny-model's floor of 3 raises the
    region's floor of 0.5 to 3 (1 serving + 2 short); "other", which its nodes do not serve, is
    said once as unmet."""
    caplog.set_level(logging.INFO, logger=AUTOSCALER_LOG)
    handle = await start_agent(
        [await sim_node(profile_name="cpu-tiny")],
        autoscaler={"actuator": "dry-run", "interval_s": 0.05, "models": [MODEL]},
    )
    scaler = handle.autoscaler
    assert scaler is not None
    await eventually(lambda: scaler.current() == 1, what="the node serving")
    scaler.set_floor(0.5, {MODEL: 3, "other": 1})
    await eventually(lambda: scaler.target == 3, what="the raised floor")
    assert scaler.unmet == ("other",)
    await asyncio.sleep(0.3)
    assert caplog.text.count("cannot meet model other's floor=1") == 1
    assert "would add capacity=2 to reach floor=3" in caplog.text
    assert f"model {MODEL} short by 2 (floor=3 current=1)" in caplog.text
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{handle.url}/admin/autoscaler", headers=ADMIN) as r,
    ):
        shown = await r.json()
    assert shown["unmet_models"] == ["other"] and shown["target"] == 3
    assert [m["model"] for m in shown["model_floors"]] == ["other", MODEL]


async def test_autoscaler_respects_max_nodes_and_stops_its_nodes_with_the_agent(
    etcd: EtcdServer, sim_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUTOSCALER_LOG)
    starter = AgentStarter()
    try:
        handle = await starter(
            [await sim_node(profile_name="cpu-tiny")],
            region=region(etcd),
            autoscaler=_simulator(max_nodes=2, scale_down_delay_s=3600),
        )
        actuator = _actuator(handle)
        async with publishing.client(etcd) as c:
            await put_desired(c, {"capacity_floor": 10})
            await eventually(
                lambda: "no room for another node" in caplog.text, what="the warning", timeout_s=60
            )
        assert len(actuator.started) == 2 and len(handle.edge.pool) == 3
        assert caplog.text.count("no room for another node") == 1  # said once, not every tick
        processes = [s.process for s in actuator.started.values()]
    finally:
        await starter.close()
    assert all(p.returncode is not None for p in processes)


async def test_a_started_node_that_exits_is_removed_and_replaced(
    start_agent: AgentFactory, sim_node: NodeFactory
) -> None:
    handle = await start_agent(
        [await sim_node(profile_name="cpu-tiny")], autoscaler=_simulator(max_nodes=1)
    )
    scaler = handle.autoscaler
    actuator = _actuator(handle)
    assert scaler is not None
    scaler.set_floor(2)  # as the publisher does with the desired floor
    first = await eventually(lambda: next(iter(actuator.started.values()), None), what="a node")
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{first.url}/admin/faults", json={"exit": True}) as r,
    ):
        assert r.status == 200
    second = await eventually(
        lambda: next((x for x in actuator.started.values() if x.url != first.url), None),
        what="a replacement",
        timeout_s=60,
    )
    assert first.node_id not in handle.edge.pool and second.node_id in handle.edge.pool


async def test_admin_autoscaler_says_when_there_is_none(
    start_agent: AgentFactory, sim_node: NodeFactory
) -> None:
    handle = await start_agent([await sim_node()])
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{handle.url}/admin/autoscaler") as r:
            assert r.status == 401
        async with s.get(f"{handle.url}/admin/autoscaler", headers=ADMIN) as r:
            assert r.status == 404
            body = await r.json()
    assert "set autoscaler.actuator" in body["error"]["message"]


async def test_without_an_actuator_no_floor_is_honoured(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await start_agent([await sim_node(profile_name="cpu-tiny")], region=region(etcd))
    assert handle.autoscaler is None
    async with publishing.client(etcd) as c:
        await put_desired(c, {"capacity_floor": 4, "generation": 3})

        async def seen() -> RegionStatus | None:
            got = await status(c)
            return got[0] if got and got[0].observed_generation == 3 else None

        st = await eventually(seen, what="generation 3 acknowledged")
    assert st.capacity_floor == 0.0  # read, but nothing acts on it: the controller can tell
    assert len(handle.edge.pool) == 1


# -- dry run and command ----------------------------------------------------------------------


async def test_dry_run_logs_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=AUTOSCALER_LOG)
    dry = DryRun()
    await dry.ensure(floor=3, current=1)
    await dry.ensure(floor=3, current=1)
    await dry.ensure(floor=3, current=3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "autoscaler dry run: would add capacity=2 to reach floor=3 (current=1)",
        "autoscaler dry run: floor=3 met (current=3)",
    ]


async def test_command_runs_with_the_floor_when_it_changes(tmp_path: Path) -> None:
    out = tmp_path / "calls.txt"
    script = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n')"
    command = Command(
        argv=[sys.executable, "-c", script, str(out), "{region}", "{floor}", "{current}"],
        timeout_s=30,
        region="eu-west",
    )
    await command.ensure(floor=0, current=1)  # nothing asked yet: nothing run
    await command.ensure(floor=2.5, current=1)
    await command.ensure(floor=2.5, current=2)  # same floor: not again
    await command.ensure(floor=0, current=2)
    assert out.read_text().splitlines() == ["eu-west 2.5 1", "eu-west 0 2"]
    assert command.runs == 2


async def test_command_runs_again_when_a_model_floor_changes(tmp_path: Path) -> None:
    out = tmp_path / "calls.txt"
    script = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n')"
    command = Command(
        argv=[sys.executable, "-c", script, str(out), "{floor}", "models={model_floors}"],
        timeout_s=30,
        region="eu-west",
    )
    a = plan.ModelNeed(model="A", floor=0.5, current=0.0)
    b = plan.ModelNeed(model="B", floor=2.0, current=1.0)
    await command.ensure(floor=2, current=1, models=(a, b))
    await command.ensure(floor=2, current=1, models=(a, b))  # the same: not again
    await command.ensure(floor=2, current=1, models=(a,))
    assert out.read_text().splitlines() == ["2 models=A=0.5,B=2", "2 models=A=0.5"]


async def test_a_failing_command_is_retried_and_reported_once(
    start_agent: AgentFactory, sim_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUTOSCALER_LOG)
    failing = Command(
        argv=[sys.executable, "-c", "import sys; print('quota exceeded'); sys.exit(3)"],
        timeout_s=30,
        region=None,
    )
    with pytest.raises(ActuatorError, match="status 3: quota exceeded"):
        await failing.ensure(floor=1, current=0)

    handle = await start_agent(
        [await sim_node(profile_name="cpu-tiny")],
        autoscaler={
            "actuator": "command",
            "command": [sys.executable, "-c", "import sys; sys.exit(1)"],
            "interval_s": 0.05,
        },
    )
    scaler = handle.autoscaler
    assert isinstance(scaler, Autoscaler) and isinstance(scaler.actuator, Command)
    scaler.set_floor(2)
    await eventually(lambda: scaler.actuator.runs >= 3, what="retries")  # type: ignore[attr-defined]
    assert caplog.text.count("autoscaler actuator failed") == 1
    assert scaler.failing is not None


def test_command_actuator_needs_a_command() -> None:
    from regional_agent.settings import AutoscalerSettings

    with pytest.raises(ValueError, match=r"autoscaler\.command is required"):
        AutoscalerSettings(actuator="command")


# -- the plan ---------------------------------------------------------------------------------

_BASE = {
    "node_weight": 1.0,
    "room": 4,
    "victim_weight": None,
    "excess_since": None,
    "now": 100.0,
    "scale_down_delay_s": 60.0,
}


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ({"floor": 3, "current": 1}, ("start", 2, 0, None)),
        ({"floor": 2.5, "current": 1}, ("start", 2, 0, None)),  # whole nodes, rounded up
        ({"floor": 3, "current": 1, "node_weight": 2.0}, ("start", 1, 0, None)),
        ({"floor": 9, "current": 1, "room": 2}, ("start", 2, 0, None)),
        ({"floor": 9, "current": 1, "room": 0}, ("short", 0, 0, None)),
        ({"floor": 3, "current": 3}, ("met", 0, 0, None)),  # no own node: nothing to stop
        ({"floor": 3, "current": 3.5, "victim_weight": 1.0}, ("met", 0, 0, None)),
        ({"floor": 2, "current": 3, "victim_weight": 1.0}, ("excess", 0, 0, 100.0)),
        (
            {"floor": 2, "current": 3, "victim_weight": 1.0, "excess_since": 50.0},
            ("excess", 0, 0, 50.0),
        ),
        (
            {"floor": 2, "current": 3, "victim_weight": 1.0, "excess_since": 40.0},
            ("stop", 0, 1, 100.0),  # a full delay over the floor: one node, then wait again
        ),
        (
            {"floor": 0, "current": 0, "victim_weight": 0.0, "excess_since": 40.0},
            ("stop", 0, 1, 100.0),  # an unhealthy own node adds nothing: it goes first
        ),
    ],
)
def test_plan_scales_up_fast_and_down_slowly(
    case: dict[str, float], expect: tuple[str, int, int, float | None]
) -> None:
    step = plan.step(**{**_BASE, **case})  # type: ignore[arg-type]
    assert (step.kind, step.start, step.stop, step.excess_since) == expect
    assert step.reason


_NEED = st.builds(
    plan.ModelNeed,
    model=st.sampled_from(["A", "B", "C"]),
    floor=st.floats(0, 8, allow_nan=False),
    current=st.floats(0, 8, allow_nan=False),
)


@given(
    floor=st.floats(0, 16, allow_nan=False),
    extra=st.floats(0, 8, allow_nan=False),
    models=st.lists(_NEED, max_size=3, unique_by=lambda n: n.model).map(tuple),
    serves=st.frozensets(st.sampled_from(["A", "B", "C"])),
)
def test_the_raised_floor_covers_every_model_the_nodes_serve_and_names_the_rest(
    floor: float,
    extra: float,
    models: tuple[plan.ModelNeed, ...],
    serves: frozenset[str],
) -> None:
    current = max((n.current for n in models), default=0.0) + extra  # a node may serve several
    raised, unmet = plan.raised(floor=floor, current=current, models=models, serves=serves)
    assert raised >= floor
    added = max(0.0, raised - current)
    for n in models:
        if not serves or n.model in serves:
            assert n.current + added >= n.floor - plan.EPSILON  # new nodes serve it
        else:
            assert (n.model in unmet) == (n.short > plan.EPSILON)
    if all(n.short <= plan.EPSILON for n in models):
        assert raised == floor and not unmet


async def test_set_floor_wakes_the_loop(start_agent: AgentFactory, sim_node: NodeFactory) -> None:
    handle = await start_agent(
        [await sim_node(profile_name="cpu-tiny")],
        autoscaler={"actuator": "dry-run", "interval_s": 3600},
    )
    scaler = handle.autoscaler
    assert scaler is not None and isinstance(scaler.actuator, DryRun)
    await asyncio.sleep(0.2)
    scaler.set_floor(5)
    await eventually(
        lambda: scaler.actuator._said == (5, 4.0, ()),  # type: ignore[attr-defined]
        what="the actuator called at once, not an hour later",
    )


# -- the load policy (autoscaler.load) ---------------------------------------------------------


async def test_the_load_policy_starts_a_node_for_a_queue_that_lasts_and_stops_it_when_quiet(
    sim_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """No controller floor here: the region's own queue (one slot on the static node, twenty
    requests at once) raises the floor, the started node takes its share, and once the queue has
    stayed empty for scale_down_for_s the floor falls back and the node is stopped."""
    caplog.set_level(logging.INFO, logger=AUTOSCALER_LOG)
    own_url = await sim_node(profile_name="cpu-tiny", time_scale=1.0)
    load = {
        "policy": "reactive",
        "scale_up_queue": 4,
        "scale_up_queue_for_s": 0.4,
        "scale_up_cooldown_s": 1.0,
        "scale_up_step": 1.0,
        "scale_down_queue": 1,
        "scale_down_for_s": 1.0,
        "max_nodes": 2,
    }
    starter = AgentStarter()
    try:
        handle = await starter(
            [own_url],
            policy="least_connections",
            nodes=[{"url": own_url, "slots": 1}],
            autoscaler=_simulator(max_nodes=1, load=load),
        )
        scaler = handle.autoscaler
        assert scaler is not None
        actuator = _actuator(handle)
        pool = handle.edge.pool
        await eventually(lambda: pool.models() == {MODEL}, what="models known")
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 200, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:

            async def one() -> int:
                async with s.post(f"{handle.url}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status

            burst = [asyncio.ensure_future(one()) for _ in range(20)]
            started = await eventually(
                lambda: next(iter(actuator.started.values()), None),
                what="a node started for the queue",
                timeout_s=60,
            )
            async with s.get(f"{handle.url}/admin/autoscaler", headers=ADMIN) as r:
                assert r.status == 200
                shown = await r.json()
            assert await asyncio.gather(*burst) == [200] * 20
        # what an operator reads: the decision, its reason and what it read
        assert shown["actuator"] == "simulator" and shown["policy"] == "reactive"
        assert shown["acting"] is True and shown["floor"] == 0.0
        assert shown["decision"]["kind"] in ("up", "hold")
        assert shown["last_change"]["kind"] == "up" and "queue" in shown["last_change"]["reason"]
        assert shown["last_change"]["target_nodes"] == 2 and shown["last_change"]["age_s"] >= 0
        assert shown["load_target_nodes"] == 2 and shown["target"] == 2.0
        assert shown["signals"]["serving"] >= 1 and shown["signals"]["queue"] >= 0
        assert shown["failing"] is None
        # a tick woken early takes no rate sample: a span of milliseconds would blow up the trend
        scaler.signals()
        assert scaler.signals().arrival_rps is None
        node = pool.get(started.node_id)
        assert node is not None and node.requests_total > 0  # it took some of the queue
        assert scaler.floor == 0.0  # the controller asked for nothing
        assert "decision=up target=2" in caplog.text and "queue" in caplog.text
        await eventually(lambda: not actuator.started, what="the node stopped", timeout_s=60)
        assert "decision=down target=1" in caplog.text
        assert [n.url for n in pool] == [own_url]
    finally:
        await starter.close()


def test_load_settings_that_would_scale_both_ways_are_refused_naming_both_fields() -> None:
    from regional_agent.settings import Settings

    with pytest.raises(ValueError, match=r"scale_down_kv_util \(0.8\).*scale_up_kv_util"):
        Settings(nodes=[], autoscaler={"load": {"policy": "combined", "scale_down_kv_util": 0.8}})
    # with the policy off, the thresholds are not read
    Settings(nodes=[], autoscaler={"load": {"scale_down_kv_util": 0.8}})


# -- one acting replica per region ---------------------------------------------------------------


async def test_one_replica_of_a_region_acts_and_another_takes_over_when_it_stops(
    etcd: EtcdServer, sim_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Two replicas of a region, each with an actuator: only the one holding
    regions/<r>/agents/_autoscaler (under its lease, in a real etcd) acts; when it stops, its
    lease is revoked and the other one takes over."""
    caplog.set_level(logging.INFO, logger="regional_agent")
    url = await sim_node(profile_name="cpu-tiny")
    first, second = AgentStarter(), AgentStarter()
    try:
        scalers = []
        for starter, name in ((first, "agent-a"), (second, "agent-b")):
            handle = await starter(
                [url],
                region=region(etcd, agent_id=name),
                autoscaler={"actuator": "dry-run", "interval_s": 0.1},
            )
            assert handle.autoscaler is not None
            scalers.append(handle.autoscaler)
        a, b = scalers
        await eventually(lambda: a.acting or b.acting or None, what="an actor")
        for _ in range(30):  # several claims: never both (a loaded host may see neither)
            assert not (a.acting and b.acting)
            await asyncio.sleep(0.05)
        await eventually(lambda: a.acting != b.acting or None, what="exactly one actor")
        actor, other = (a, b) if a.acting else (b, a)
        assert other.actor == ("agent-a" if actor is a else "agent-b")
        async with publishing.client(etcd) as c:
            got = await c.get(keys.autoscaler_actor(REGION).encode())
            assert got is not None and got.value.decode() == other.actor
        await (first if actor is a else second).close()
        await eventually(lambda: other.acting or None, what="the other replica acts", timeout_s=10)
        assert "autoscaler actor: this replica acts" in caplog.text
        assert "autoscaler standing by" in caplog.text
    finally:
        await first.close()
        await second.close()
