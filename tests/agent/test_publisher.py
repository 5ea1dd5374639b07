"""The publisher against a real etcd: liveness under a lease, status on change and as a
heartbeat, the desired state followed, and fail static while etcd is away.

Timing comes from short settings (2 s lease, 2 s heartbeat, 0.2 s debounce); every wait is a
poll with a generous deadline, never a timed assertion.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meridian_wire import keys
from meridian_wire.models import RegionDesired, RegionLoad, RegionStatus
from policies.model import NodeId, NodeView, Telemetry
from regional_agent import cli
from regional_agent import settings as agent_settings
from regional_agent.observability import RequestTotals, quantile
from regional_agent.publisher import status as status_mod
from regional_agent.publisher.load import LoadWindow
from regional_agent.retry import Backoff, supervise
from tests.agent import publishing
from tests.agent.conftest import SimProcess
from tests.agent.publishing import REGION, alive, eventually, put_desired, region, status
from tests.conftest import NodeFactory
from tests.support import EtcdServer
from tests.support.agent import AgentFactory, AgentHandle, AgentStarter
from tests.support.process import ServerProcess

PUBLISHER_LOG = "regional_agent.publisher.publisher"
MODEL = "tiny-model"


async def _nodes(sim_node: NodeFactory, n: int) -> list[str]:
    return [await sim_node(profile_name="cpu-tiny", seed=i) for i in range(n)]


async def _complete(url: str, *, stream: bool = False, n: int = 1) -> list[int]:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": stream}
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(f"{url}/v1/completions", json=body) as r:
                await r.read()
                out.append(r.status)
    return out


async def _faults(url: str, body: dict[str, object] | None) -> None:
    async with aiohttp.ClientSession() as s:
        if body is None:
            async with s.delete(f"{url}/admin/faults") as r:
                assert r.status == 200
        else:
            async with s.post(f"{url}/admin/faults", json=body) as r:
                assert r.status == 200


# -- liveness -------------------------------------------------------------------------------------


async def test_alive_key_lives_under_a_short_lease_and_goes_with_the_agent(
    etcd: EtcdServer, sim_node: NodeFactory
) -> None:
    starter = AgentStarter()
    try:
        handle = await starter(await _nodes(sim_node, 1), region=region(etcd))
        async with publishing.client(etcd) as c:
            lease = await eventually(lambda: alive(c), what="the alive key")
            publisher = handle.publisher
            assert publisher is not None and publisher.lease is not None
            assert publisher.lease.id == lease
            got = await publishing.agent_key(c, "alive")
            assert got is not None and got.value == b""
            assert bytes(got.key).decode() == keys.agent_alive(REGION, publisher.agent_id)
            info = await c.get_lease_info(lease, keys=False)
            assert 0 < info.TTL <= 2 and info.grantedTTL == 2
            # kept alive: the same lease outlives several TTLs
            await asyncio.sleep(5)
            assert await alive(c) == lease
            await starter.close()
            assert await alive(c) is None  # a clean stop revokes the lease at once
    finally:
        await starter.close()


def test_alive_key_expires_within_the_ttl_when_the_agent_dies(
    etcd: EtcdServer, sim_processes: Callable[..., list[SimProcess]]
) -> None:
    """The CLI with the region flags; SIGKILL leaves no time to revoke: the lease expires."""
    node = sim_processes(1)[0]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "regional_agent.cli",
            "--port",
            "0",
            "--node",
            node.url,
            "--region",
            REGION,
            "--geo",
            "eu",
            "--residency",
            "eu,gdpr",
            "--endpoint",
            "https://a.example.com,https://b.example.com",
            "--etcd",
            etcd.url,
            "--log-level",
            "WARNING",
            "--workers",
            "1",  # one replica, one alive key
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MERIDIAN_AGENT_REGION__LEASE_TTL_S": "2"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("READY ")

        async def watch() -> None:
            async with publishing.client(etcd) as c:
                await eventually(lambda: alive(c), what="the alive key")
                got = await eventually(lambda: status(c), what="the status")
                st = got[0]
                assert st.residency == ["eu", "gdpr"]
                assert st.endpoints == ["https://a.example.com", "https://b.example.com"]
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)

                async def gone() -> bool:
                    return await alive(c) is None

                await eventually(gone, what="the alive key expired", timeout_s=15)
                assert await status(c) is None  # the status lived under the same lease

        asyncio.run(watch())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- status ---------------------------------------------------------------------------------------


async def test_status_reports_counts_capacity_and_identity(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 3)
    handle = await start_agent(
        [],
        nodes=[{"url": u, "weight": w} for u, w in zip(urls, (1.0, 2.0, 0.5), strict=True)],
        region=region(etcd, agent_id="agent-a"),
    )
    async with publishing.client(etcd) as c:
        got = await eventually(lambda: status(c), what="the status")
        st = got[0]
        assert st.region == REGION and st.geo == "eu"
        assert st.residency == ["eu", "gdpr"]
        assert st.endpoints == ["https://eu-west.llm.example.com"]
        assert (st.nodes_healthy, st.nodes_total) == (3, 3)
        assert st.capacity == pytest.approx(3.5)
        assert st.capacity_floor == 0.0  # no actuator: no floor honoured
        assert st.admin == "active" and st.observed_generation == 0
        assert st.agent_id == "agent-a"
        assert abs(st.updated_at - time.time()) < 60
        raw = await c.get(keys.agent_status(REGION, "agent-a").encode())
        assert raw is not None
        RegionStatus.model_validate_json(raw.value)  # the wire contract, as the controller reads
    assert handle.publisher is not None


async def test_status_is_rewritten_when_a_node_fails_and_recovers(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = await _nodes(sim_node, 3)
    await start_agent(urls, region=region(etcd, window_s=60.0))  # no heartbeat in the test
    async with publishing.client(etcd) as c:

        async def healthy(n: int) -> tuple[RegionStatus, int] | None:
            got = await status(c)
            return got if got is not None and got[0].nodes_healthy == n else None

        await eventually(lambda: healthy(3), what="3 healthy nodes")
        await _faults(urls[0], {"fail_health": True})
        st, _ = await eventually(lambda: healthy(2), what="2 healthy nodes after fail_health")
        assert st.nodes_total == 3 and st.capacity == pytest.approx(2.0)
        await _faults(urls[0], None)
        st, _ = await eventually(lambda: healthy(3), what="3 healthy nodes again")
        assert st.capacity == pytest.approx(3.0)


async def test_status_reports_each_models_capacity_and_a_model_whose_nodes_are_down_as_0(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    urls = [await sim_node(model="model-a", seed=0), await sim_node(model="model-b", seed=1)]
    await start_agent(
        [],
        nodes=[{"url": urls[0], "weight": 2.0}, {"url": urls[1], "weight": 1.0}],
        region=region(etcd, window_s=60.0),
    )
    async with publishing.client(etcd) as c:

        async def models(expected: dict[str, float]) -> RegionStatus | None:
            got = await status(c)
            return got[0] if got is not None and got[0].models == expected else None

        await eventually(lambda: models({"model-a": 2.0, "model-b": 1.0}), what="both models")
        await _faults(urls[1], {"fail_health": True})
        st = await eventually(
            lambda: models({"model-a": 2.0, "model-b": 0.0}), what="model-b at no capacity"
        )
        assert st.capacity == pytest.approx(2.0)


async def test_an_idle_region_writes_no_more_than_the_heartbeat(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await start_agent(await _nodes(sim_node, 2), region=region(etcd, window_s=1.5))
    async with publishing.client(etcd) as c:
        await eventually(lambda: status(c), what="the status")
        await asyncio.sleep(1.0)  # past the first probes and telemetry
        got = await status(c)
        assert got is not None
        began, version_before = time.monotonic(), got[1]
        await asyncio.sleep(6.0)
        got = await status(c)
        assert got is not None
        elapsed_s, writes = time.monotonic() - began, got[1] - version_before
    heartbeats = elapsed_s / 1.5
    assert 1 <= writes <= heartbeats + 2, f"{writes} writes in {elapsed_s:.1f} s"
    publisher = handle.publisher
    assert publisher is not None and publisher.writes["alive"] == 1  # one put; keep-alives after


async def test_status_reports_load_from_the_agents_own_counters(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await start_agent(await _nodes(sim_node, 2), region=region(etcd, window_s=5.0))
    assert await _complete(handle.url, stream=True, n=10) == [200] * 10
    async with publishing.client(etcd) as c:

        async def loaded() -> RegionStatus | None:
            got = await status(c)
            if got is None or got[0].load.requests_per_s <= 0:
                return None
            return got[0]

        st = await eventually(loaded, what="a status with a request rate")
        assert st.load.error_rate == 0.0
        assert st.load.ttft_p99_s is not None and 0 < st.load.ttft_p99_s < 5
    samples = await _metrics(handle)
    assert samples[("meridian_agent_etcd_writes_total", "status")] >= 1
    assert samples[("meridian_agent_etcd_writes_total", "alive")] == 1
    assert samples[("meridian_agent_etcd_connected", "")] == 1


async def _metrics(handle: AgentHandle) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as s, s.get(f"{handle.url}/metrics") as r:
        text = await r.text()
    return {
        (sample.name, sample.labels.get("kind", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# -- desired --------------------------------------------------------------------------------------


async def test_desired_admin_state_is_acknowledged_and_malformed_values_ignored(
    etcd: EtcdServer,
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=PUBLISHER_LOG)
    handle = await start_agent(await _nodes(sim_node, 1), region=region(etcd))
    publisher = handle.publisher
    assert publisher is not None
    async with publishing.client(etcd) as c:
        await eventually(lambda: status(c), what="the status")
        await put_desired(c, {"admin": "draining", "generation": 7, "reason": "maintenance"})

        async def acknowledged(generation: int) -> RegionStatus | None:
            got = await status(c)
            return got[0] if got and got[0].observed_generation == generation else None

        st = await eventually(lambda: acknowledged(7), what="generation 7 acknowledged")
        assert st.admin == "draining"
        assert await _complete(handle.url) == [200]  # draining is DNS's business: still serves

        for bad in (b"{not json", b'{"admin": "sideways", "generation": 8}', b"[1, 2]"):
            await put_desired(c, bad)
            await eventually(
                lambda: "malformed desired value ignored" in caplog.text, what="the warning"
            )
            assert keys.desired(REGION) in caplog.text
            caplog.clear()
            assert publisher.desired.generation == 7 and publisher.desired.admin == "draining"
        got = await status(c)
        assert got is not None and got[0].observed_generation == 7

        await put_desired(c, {"admin": "active", "generation": 9})
        st = await eventually(lambda: acknowledged(9), what="generation 9 acknowledged")
        assert st.admin == "active"


# -- fail static ----------------------------------------------------------------------------------


@pytest.mark.parametrize("comeback", ["empty", "same-data"])
async def test_etcd_outage_agent_keeps_serving_then_converges(
    fresh_etcd: EtcdServer,
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    caplog: pytest.LogCaptureFixture,
    comeback: str,
) -> None:
    caplog.set_level(logging.INFO, logger=PUBLISHER_LOG)
    handle = await start_agent(await _nodes(sim_node, 2), region=region(fresh_etcd))
    publisher = handle.publisher
    assert publisher is not None
    async with publishing.client(fresh_etcd) as c:
        await eventually(lambda: alive(c), what="the alive key")
        await eventually(lambda: status(c), what="the status")
    assert publisher.lease is not None
    first_lease = publisher.lease.id

    fresh_etcd.process.stop()
    await eventually(lambda: publisher.link.up is False, what="etcd seen down")
    assert await _complete(handle.url, stream=True, n=5) == [200] * 5
    await asyncio.sleep(3.0)  # several retries, past the 2 s lease TTL
    assert await _complete(handle.url, n=5) == [200] * 5
    assert caplog.text.count("etcd unreachable") == 1  # logged once, not every retry

    with _restart_etcd(fresh_etcd, keep_data=comeback == "same-data") as again:
        async with publishing.client(again) as c:
            lease = await eventually(lambda: alive(c), what="the alive key back")
            got = await eventually(lambda: status(c), what="the status back")
            assert got[0].nodes_healthy == 2
            await eventually(lambda: publisher.link.up is True, what="etcd seen back")
            # once per transition: a just-restarted etcd can time out one more watch and flap the
            # link down and up again (a CI run saw it), which logs each way once more
            back = caplog.text.count("etcd reachable again")
            assert back >= 1 and back == caplog.text.count("etcd unreachable"), caplog.text
            if comeback == "empty":
                assert lease != first_lease  # etcd forgot the lease: a new one was granted
                assert "liveness lease lost" in caplog.text
            # and the agent keeps publishing: the heartbeat moves the status on
            version = got[1]

            async def newer() -> bool:
                again_got = await status(c)
                return again_got is not None and again_got[1] > version

            await eventually(newer, what="a status written after the outage")
    assert await _complete(handle.url, n=3) == [200] * 3


@contextmanager
def _restart_etcd(server: EtcdServer, *, keep_data: bool) -> Iterator[EtcdServer]:
    """etcd again on the same client port: on its old data directory, or on an empty one (a
    member that lost its data)."""
    argv = list(server.process.argv)
    work = Path(tempfile.mkdtemp(prefix="etcd-again-", dir=server.data_dir.parent))
    data_dir = server.data_dir if keep_data else work / "data"
    argv = [f"--data-dir={data_dir}" if a.startswith("--data-dir=") else a for a in argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    if "ETCD_UNSUPPORTED_ARCH" in os.environ:
        env["ETCD_UNSUPPORTED_ARCH"] = os.environ["ETCD_UNSUPPORTED_ARCH"]
    process = ServerProcess(argv, log_path=work / "etcd.log", env=env)
    again = EtcdServer(
        host=server.host,
        port=server.port,
        peer_port=server.peer_port,
        name=server.name,
        data_dir=data_dir,
        process=process,
    )
    try:
        deadline = time.monotonic() + 30
        while not again.healthy():
            if process.exit_code() is not None or time.monotonic() > deadline:
                raise process.failure("etcd did not come back")
            time.sleep(0.05)
        yield again
    finally:
        process.stop()


# -- pure parts: the write decision and the load window -------------------------------------------

TIMING = status_mod.Timing(
    window_s=30.0, min_interval_s=1.0, load_change=0.25, load_min_interval_s=5.0
)


def _status(**kw: object) -> RegionStatus:
    base: dict[str, object] = {
        "region": "eu-west",
        "geo": "eu",
        "nodes_healthy": 3,
        "nodes_total": 3,
        "capacity": 3.0,
        "updated_at": 1.0,
    }
    return RegionStatus.model_validate({**base, **kw})


@pytest.mark.parametrize(
    ("written", "current", "since_s", "force", "expect"),
    [
        (None, {}, 0.0, None, "first status"),
        ({}, {"nodes_healthy": 2}, 0.5, None, None),  # debounced
        ({}, {"nodes_healthy": 2}, 1.0, None, "changed: nodes_healthy 3→2"),
        ({}, {"capacity": 2.5}, 2.0, None, "changed: capacity 3→2.5"),
        ({}, {"capacity_floor": 2.0}, 2.0, None, "changed: capacity_floor 0→2"),
        ({}, {"admin": "drained"}, 2.0, None, "changed: admin active→drained"),
        ({}, {"updated_at": 9.0}, 10.0, None, None),  # only time moved
        ({}, {"updated_at": 31.0}, 30.0, None, "heartbeat"),
        ({}, {}, 2.0, "etcd back", "etcd back"),
        ({}, {"load": {"in_flight": 40}}, 2.0, None, None),  # load alone: not before 5 s
        ({}, {"load": {"in_flight": 40}}, 5.0, None, "load: in_flight 0→40"),
        ({"load": {"in_flight": 40}}, {"load": {"in_flight": 45}}, 6.0, None, None),  # < 25 %
        ({"load": {"in_flight": 1}}, {"load": {"in_flight": 4}}, 6.0, None, None),  # < 4 requests
        (
            {"load": {"kv_util": 0.5}},
            {"load": {"kv_util": 0.9}},
            6.0,
            None,
            "load: kv_util 0.5→0.9",
        ),
        ({}, {"load": {"ttft_p99_s": 2.0}}, 6.0, None, "load: ttft_p99_s None→2"),
    ],
)
def test_decide_writes_on_change_debounced_else_heartbeat(
    written: dict[str, object] | None,
    current: dict[str, object],
    since_s: float,
    force: str | None,
    expect: str | None,
) -> None:
    got = status_mod.decide(
        written=None if written is None else _status(**written),
        current=_status(**current),
        since_write_s=since_s,
        force=force,
        timing=TIMING,
    )
    assert got == expect


def test_observe_builds_the_status_from_plain_values_without_an_agent() -> None:
    """``status.observe`` is pure: the publisher hands it the serving nodes' views and counts."""

    def view(node: str, *, weight: float, kv: float | None) -> NodeView:
        telemetry = None
        if kv is not None:
            telemetry = Telemetry(
                age_s=0.1, running=1, waiting=0, kv_util=kv, prefix_hit_rate=None, block_size=16
            )
        return NodeView(node_id=NodeId(node), models=frozenset({"m"}), weight=weight,
                        telemetry=telemetry)  # fmt: skip

    identity = status_mod.Identity(
        region="eu-west", geo="eu", residency=("eu",), endpoints=("https://eu.example",),
        agent_id="a1",
    )  # fmt: skip
    got = status_mod.observe(
        serving=[
            view("n1", weight=1.0, kv=0.2),
            view("n2", weight=2.0, kv=0.4),
            view("n3", weight=0.5, kv=None),
        ],
        nodes_total=5,
        in_flight=7,
        queue_depth=3,
        identity=identity,
        window=LoadWindow(window_s=10.0).load(),
        desired=RegionDesired(admin="draining", generation=4),
        floor=1.5,
        wall_now=1_800_000_000.1234,
    )
    assert (got.nodes_healthy, got.nodes_total, got.capacity) == (3, 5, 3.5)
    assert got.load.kv_util == pytest.approx(0.3)  # the mean over the nodes with telemetry
    assert (got.load.in_flight, got.load.queue_depth) == (7, 3)
    assert (got.admin, got.observed_generation, got.capacity_floor) == ("draining", 4, 1.5)
    assert (got.region, got.agent_id, got.endpoints) == ("eu-west", "a1", ["https://eu.example"])
    assert got.updated_at == 1_800_000_000.123


def test_load_window_rates_and_p99_over_the_window() -> None:
    window = LoadWindow(window_s=10.0)
    totals = RequestTotals()
    assert window.load().requests_per_s == 0.0 and window.load().ttft_p99_s is None
    for second in range(21):
        window.sample(totals, now=float(second))
        totals.finished += 10
        totals.failed += 1 if second >= 10 else 0
        totals.ttft[20] += 10  # 0.001 * 1.25**19 .. **20: about 69-87 ms
    load = window.load()
    assert load.span_s == pytest.approx(10.0)
    assert load.requests_per_s == pytest.approx(10.0)
    assert load.error_rate == pytest.approx(0.1)
    assert load.ttft_p99_s is not None and 0.069 < load.ttft_p99_s <= 0.087
    assert quantile([0] * 61, 0.99) is None


# -- settings and flags ---------------------------------------------------------------------------


def test_region_flags_become_settings() -> None:
    args = cli.build_parser().parse_args(
        [
            "--region",
            "us-east",
            "--geo",
            "us",
            "--residency",
            "us, hipaa",
            "--endpoint",
            "https://a.example.com",
            "--endpoint",
            "https://b.example.com",
            "--etcd",
            "http://10.0.0.1:2379,http://10.0.0.2:2379",
            "--actuator",
            "dry-run",
        ]
    )
    loaded = agent_settings.load(overrides=cli.overrides(args))
    r = loaded.region
    assert (r.id, r.geo, r.residency) == ("us-east", "us", ["us", "hipaa"])
    assert r.endpoints == ["https://a.example.com", "https://b.example.com"]
    assert r.etcd == ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
    assert r.publishing and loaded.autoscaler.actuator == "dry-run"
    assert not agent_settings.Settings().region.publishing


@pytest.mark.parametrize(
    ("region_values", "field_text"),
    [
        ({"id": "EU West", "geo": "eu"}, "region id"),
        ({"id": "eu-west"}, "region.geo is required"),
        ({"etcd": ["http://127.0.0.1:2379"]}, "region.id is not"),
        ({"id": "eu-west", "geo": "eu", "etcd": ["https://e:2379"]}, "TLS to etcd"),
        ({"id": "eu-west", "geo": "eu", "residency": ["EU"]}, "residency tag"),
        ({"id": "eu-west", "geo": "eu", "lease_ttl_s": 1}, "lease_ttl_s"),
    ],
)
def test_bad_region_settings_name_the_field(
    region_values: dict[str, object], field_text: str
) -> None:
    with pytest.raises(pydantic.ValidationError, match=field_text):
        agent_settings.Settings.model_validate({"region": region_values})


def test_load_figures_are_valid_region_load() -> None:
    # the absolute steps name real RegionLoad fields
    assert set(status_mod._LOAD_STEPS) <= set(RegionLoad.model_fields)


# -- retry pacing ----------------------------------------------------------------------------------


def test_backoff_doubles_with_jitter_up_to_its_cap_and_resets() -> None:
    backoff = Backoff(base_s=0.5, max_s=4.0, rng=random.Random(1))
    waits = [backoff.next_s() for _ in range(6)]
    for wait, step in zip(waits, (0.5, 1.0, 2.0, 4.0, 4.0, 4.0), strict=True):
        assert step / 2 <= wait <= step
    backoff.reset()
    assert backoff.next_s() <= 0.5
    with pytest.raises(ValueError):
        Backoff(base_s=2.0, max_s=1.0, rng=random.Random(1))


async def test_supervise_restarts_a_loop_that_fails(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"bug {runs}")

    await supervise("flaky", flaky, backoff=Backoff(base_s=0.01, max_s=0.02, rng=random.Random()))
    assert runs == 3
    assert caplog.text.count("background loop failed loop=flaky") == 2
