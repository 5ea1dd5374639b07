"""Region and control-plane faults: an agent killed or cut off from etcd, a region's public
endpoint blackholed while its agent is healthy, etcd members and quorum lost, the leading
controller killed, the DNS server killed during a failover, a clock step.

Two regions of one geography (eu-west, its backup eu-north), each one ``meridian-sim`` node
behind a ``meridian-agent`` process; ``meridian-controller`` processes (two replicas) over real
etcd.  Windows of 1 s, 2 strikes, one good window and a 0.5 → 1.0 ramp to recover, a 2 s agent
lease.  The bounds follow: a dead region is failed within ``lease_ttl_s + strikes * window_s``
plus one window of phase; it is whole again within ``(recovery_windows + len(ramp) + 1)``
windows of its agent answering; a dead leader is replaced within its lease TTL and a poll; a
region no replica can reach is failed within a probe round (interval + timeout) and the strikes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from controlplane.app import CONTROLLER, create_app
from controlplane.settings import ControllerSettings
from meridian_service.clock import WallClock
from meridian_wire import keys
from meridian_wire.models import DnsApplied, RegionHealth, RegionStatus
from tests.controlplane.dns_helpers import (
    API,
    ENDPOINTS,
    EU_ADDRESS,
    GEO,
    US_ADDRESS,
    answer,
    dns_settings,
)
from tests.controlplane.dns_helpers import REGIONS as DNS_REGIONS
from tests.faults.harness import (
    AgentProc,
    NodeProc,
    Proxy,
    Report,
    Row,
    Traffic,
    fast_agent_toml,
    seconds_until,
    start_nodes,
    wait_http,
)
from tests.support import BindServer, EtcdServer, cancel_all, relaunch_bind, start_etcd
from tests.support.etcd import client as etcd_client
from tests.support.etcd import start_etcd_cluster
from tests.support.ports import free_port
from tests.support.process import ServerProcess

pytestmark = pytest.mark.faults

WINDOW_S, STRIKES, RECOVERY, RAMP = 1.0, 2, 1, (0.5, 1.0)
AGENT_TTL_S, CONTROLLER_TTL_S, HEARTBEAT_S = 2, 2, 1.0
SLACK_S = 2.0  # processes on a loaded 2-core host
FAIL_BOUND_S = AGENT_TTL_S + STRIKES * WINDOW_S + WINDOW_S + SLACK_S
RECOVER_BOUND_S = (RECOVERY + len(RAMP) + 1) * WINDOW_S + SLACK_S
REGIONS = ("eu-west", "eu-north")
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


PROBE_INTERVAL_S, PROBE_TIMEOUT_S = 1.0, 0.8
PROBE_BOUND_S = PROBE_INTERVAL_S + PROBE_TIMEOUT_S + STRIKES * WINDOW_S + WINDOW_S + SLACK_S
PROBE_TOML = f"""
[probe]
enabled = true
interval_s = {PROBE_INTERVAL_S}
timeout_s = {PROBE_TIMEOUT_S}
"""


def _controller_toml(name: str, *, port: int, etcd: list[str], probe: bool = False) -> str:
    return (
        (PROBE_TOML if probe else "")
        + f"""
[etcd]
endpoints = {json.dumps(etcd)}
timeout_s = 1.0

[election]
id = "{name}"
lease_ttl_s = {CONTROLLER_TTL_S}

[failover]
window_s = {WINDOW_S}
strikes = {STRIKES}
recovery_windows = {RECOVERY}
ramp = {json.dumps(list(RAMP))}
min_hold_s = 0.0
status_stale_s = {3 * HEARTBEAT_S}
agent_heartbeat_s = {HEARTBEAT_S}

[server]
host = "127.0.0.1"
port = {port}

[[regions]]
id = "eu-west"
geo = "eu"
residency = ["eu"]
backups = ["eu-north"]

[[regions]]
id = "eu-north"
geo = "eu"
residency = ["eu"]
backups = ["eu-west"]
"""
    )


class ControllerProc:
    def __init__(self, name: str, logs: Path, etcd: list[str], *, probe: bool = False) -> None:
        self.name = name
        self.port = free_port()
        self.config = logs / f"{name}.toml"
        self.config.write_text(_controller_toml(name, port=self.port, etcd=etcd, probe=probe))
        self.logs = logs
        self.process: ServerProcess | None = None

    def start(self) -> ControllerProc:
        argv = [sys.executable, "-m", "controlplane.cli", "--config", str(self.config)]
        log = self.logs / f"{self.name}-{time.monotonic_ns()}.log"
        self.process = ServerProcess(argv, log_path=log)
        wait_http(f"http://127.0.0.1:{self.port}/health", what=self.name, process=self.process)
        return self

    def health(self) -> dict[str, Any]:
        with _HTTP.open(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
            body: dict[str, Any] = json.loads(r.read())
        return body

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class Fleet:
    """Regions (node + agent processes) and controller processes over ``etcd``."""

    def __init__(
        self,
        logs: Path,
        etcd: list[str],
        *,
        agent_etcd: dict[str, list[str]],
        fronts: dict[str, Proxy] | None = None,
        probe: bool = False,
    ) -> None:
        """``fronts``: a region whose published endpoint is this proxy (started by the test),
        which ``start`` points at the region's agent; ``probe``: the controllers probe."""
        self.logs = logs
        self.etcd = etcd
        self.store = etcd_client(*etcd, timeout_s=1.0)
        self.nodes: dict[str, NodeProc] = {}
        self.agents: dict[str, AgentProc] = {}
        self.controllers: dict[str, ControllerProc] = {}
        self._agent_etcd = agent_etcd
        self._fronts = fronts or {}
        self._probe = probe

    def start(self, controllers: int = 2) -> Fleet:
        for i, region in enumerate(REGIONS):
            (node,) = start_nodes(1, self.logs, time_scale=5.0, seed=i)
            self.nodes[region] = node
            port = free_port()
            front = self._fronts.get(region)
            endpoint = f"http://127.0.0.1:{port}"
            if front is not None:
                front.target, endpoint = ("127.0.0.1", port), front.url
            config = fast_agent_toml(
                region=region, geo="eu", residency=["eu"], endpoint=endpoint,
                etcd=self._agent_etcd[region], nodes=[node.url], lease_ttl_s=AGENT_TTL_S,
                window_s=HEARTBEAT_S,
            )  # fmt: skip
            self.agents[region] = AgentProc(port=port, log_dir=self.logs, config=config).start()
        for i in range(controllers):
            name = f"ctl-{'ab'[i]}"
            self.controllers[name] = ControllerProc(
                name, self.logs, self.etcd, probe=self._probe
            ).start()
        return self

    async def health(self, region: str) -> RegionHealth | None:
        with contextlib.suppress(Exception):
            entry = await self.store.get(keys.health(region))
            return None if entry is None else RegionHealth.model_validate_json(entry.value)
        return None

    async def is_state(self, region: str, state: str, weight: float | None = None) -> bool:
        h = await self.health(region)
        return h is not None and h.state == state and (weight is None or h.weight == weight)

    def leader(self) -> str | None:
        for name, c in self.controllers.items():
            if c.process is not None and c.process.exit_code() is None:
                with contextlib.suppress(Exception):
                    if c.health()["leading"]:
                        return name
        return None

    async def all_healthy(self) -> bool:
        return all([await self.is_state(r, "healthy", 1.0) for r in REGIONS])

    async def close(self) -> None:
        for c in self.controllers.values():
            c.stop()
        for a in self.agents.values():
            a.stop()
        for n in self.nodes.values():
            n.stop()
        await self.store.close()


@pytest.fixture
async def etcd1(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    with start_etcd(tmp_path) as server:
        yield server


async def _started(fleet: Fleet) -> Fleet:
    fleet.start()
    await seconds_until(fleet.all_healthy, timeout_s=30, what="both regions healthy")
    await seconds_until(lambda: fleet.leader() is not None, timeout_s=15, what="a leader")
    return fleet


async def test_an_agent_killed_fails_its_region_to_the_backup_and_it_ramps_back(
    logs: Path, etcd1: EtcdServer, report: Report
) -> None:
    fleet = Fleet(logs, [etcd1.url], agent_etcd={r: [etcd1.url] for r in REGIONS})
    try:
        await _started(fleet)
        fleet.agents["eu-west"].kill()
        detect = await seconds_until(
            lambda: fleet.is_state("eu-west", "failed"), timeout_s=30, what="eu-west failed"
        )
        north = await fleet.health("eu-north")
        assert north is not None and north.state == "healthy"
        fleet.agents["eu-west"].start()
        recover = await seconds_until(
            lambda: fleet.is_state("eu-west", "healthy", 1.0), timeout_s=60,
            what="eu-west healthy at full weight",
        )  # fmt: skip
        report.add(Row(
            case="agent killed", fault="SIGKILL of eu-west's only agent, then a restart",
            detect_s=round(detect, 2), detect_bound_s=FAIL_BOUND_S,
            recover_s=round(recover, 2), recover_bound_s=RECOVER_BOUND_S + 3.0,
            note="detect: lease TTL + strikes x window; recover counts the agent's start",
        ))  # fmt: skip
    finally:
        await fleet.close()


async def test_an_agent_cut_off_from_etcd_keeps_serving_and_its_region_fails_over(
    logs: Path, etcd1: EtcdServer, report: Report
) -> None:
    proxy = await Proxy("127.0.0.1", etcd1.port).start()
    agent_etcd = {"eu-west": [proxy.url], "eu-north": [etcd1.url]}
    fleet = Fleet(logs, [etcd1.url], agent_etcd=agent_etcd)
    try:
        await _started(fleet)
        async with Traffic(fleet.agents["eu-west"].url, concurrency=2) as traffic:
            await traffic.requests(5)
            proxy.partition()
            detect = await seconds_until(
                lambda: fleet.is_state("eu-west", "failed"), timeout_s=30, what="eu-west failed"
            )
            await traffic.requests(10)  # the agent serves on what it knows: fail static
            proxy.heal()
            recover = await seconds_until(
                lambda: fleet.is_state("eu-west", "healthy", 1.0), timeout_s=60,
                what="eu-west healthy again",
            )  # fmt: skip
        t = traffic.tally
        report.add(Row(
            case="agent partitioned from etcd",
            fault="a TCP proxy between eu-west's agent and etcd blackholes every connection",
            detect_s=round(detect, 2), detect_bound_s=FAIL_BOUND_S,
            recover_s=round(recover, 2), recover_bound_s=RECOVER_BOUND_S + 5.0,
            requests=t.total, lost=t.lost, broken=t.broken,
            note="clients of the cut-off agent kept being served; recover includes the agent's "
            "etcd retry backoff (retry_max_s 0.5 s) and a fresh lease",
        ))  # fmt: skip
    finally:
        await fleet.close()
        await proxy.close()


async def test_a_region_whose_public_endpoint_is_blackholed_is_failed_by_the_probes(
    logs: Path, etcd1: EtcdServer, report: Report
) -> None:
    """eu-west's agent and node stay healthy and keep publishing so; only the address clients
    use (a TCP proxy standing in for its load balancer) goes dead.  Both controller replicas
    probe it, fail to reach it, and the leader fails the region to eu-north; healed, it ramps
    back."""
    front = await Proxy("127.0.0.1", 1).start()  # pointed at eu-west's agent by Fleet.start
    fleet = Fleet(
        logs, [etcd1.url], agent_etcd={r: [etcd1.url] for r in REGIONS},
        fronts={"eu-west": front}, probe=True,
    )  # fmt: skip
    try:
        await _started(fleet)
        async with Traffic(front.url, concurrency=2) as traffic:
            await traffic.requests(5)
        front.partition()
        detect = await seconds_until(
            lambda: fleet.is_state("eu-west", "failed"), timeout_s=30, what="eu-west failed"
        )
        west = await fleet.health("eu-west")
        assert west is not None and "unreachable from 2 of 2 controller replicas" in west.reason
        north = await fleet.health("eu-north")
        assert north is not None and north.state == "healthy"
        entry = await fleet.store.get(keys.agent_status("eu-west", "eu-west-a1"))
        assert entry is not None
        status = RegionStatus.model_validate_json(entry.value)
        assert status.nodes_healthy == status.nodes_total == 1  # the agent says all is well
        async with Traffic(fleet.agents["eu-west"].url, concurrency=2) as direct:
            await direct.requests(5)  # and it serves whoever reaches it
        assert direct.tally.lost == 0
        front.heal()
        recover = await seconds_until(
            lambda: fleet.is_state("eu-west", "healthy", 1.0), timeout_s=60,
            what="eu-west healthy again",
        )  # fmt: skip
        report.add(Row(
            case="region endpoint blackholed",
            fault="a TCP proxy standing in for eu-west's load balancer blackholes every "
            "connection; its agent and node stay healthy",
            detect_s=round(detect, 2), detect_bound_s=PROBE_BOUND_S,
            recover_s=round(recover, 2), recover_bound_s=RECOVER_BOUND_S + PROBE_INTERVAL_S,
            note="detect: a probe round (interval + timeout) + strikes x window; both "
            "controller replicas probe",
        ))  # fmt: skip
        assert detect <= PROBE_BOUND_S
    finally:
        await fleet.close()
        await front.close()


def _relaunch_member(member: EtcdServer) -> ServerProcess:
    """Start a stopped member again without waiting for /health (it needs a quorum)."""
    log = member.process.log_path.with_name(f"etcd-again-{time.monotonic_ns()}.log")
    return ServerProcess(member.process.argv, log_path=log)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[EtcdServer]]:
    with start_etcd_cluster(tmp_path) as members:
        yield members


async def test_one_etcd_member_killed_changes_nothing(
    logs: Path, cluster: list[EtcdServer], report: Report
) -> None:
    urls = [m.url for m in cluster]
    fleet = Fleet(logs, urls, agent_etcd={r: urls for r in REGIONS})
    try:
        await _started(fleet)
        leader = fleet.leader()
        assert leader is not None
        window = fleet.controllers[leader].health()["window"]
        cluster[0].process.kill()
        resumed = await seconds_until(
            lambda: (fleet.controllers[leader].health()["window"] or 0) >= window + 3,
            timeout_s=30, what="three more windows judged",
        )  # fmt: skip
        for region in REGIONS:
            h = await fleet.health(region)
            assert h is not None and h.state == "healthy" and h.strikes == 0, h
        report.add(Row(
            case="one of three etcd members killed", fault="SIGKILL of etcd member 0",
            detect_s=None, detect_bound_s=None,
            recover_s=round(resumed, 2), recover_bound_s=3 * WINDOW_S + 3.0 + SLACK_S,
            note="recover: time for three more windows; every call fails over to the next "
            "member within one call (1 s timeout); no region earned a strike",
        ))  # fmt: skip
    finally:
        await fleet.close()


async def test_etcd_quorum_lost_fails_static_and_regained_converges(
    logs: Path, cluster: list[EtcdServer], report: Report
) -> None:
    urls = [m.url for m in cluster]
    fleet = Fleet(logs, urls, agent_etcd={r: urls for r in REGIONS})
    again: list[ServerProcess] = []
    try:
        await _started(fleet)
        for member in cluster[:2]:
            member.process.kill()
        detect = await seconds_until(
            lambda: all(c.health()["etcd"] == "unavailable" for c in fleet.controllers.values()),
            timeout_s=30, what="every controller replica reports etcd unavailable",
        )  # fmt: skip
        async with Traffic(fleet.agents["eu-west"].url, concurrency=2) as traffic:
            await traffic.requests(10)  # the regions keep serving meanwhile
        await asyncio.sleep(2 * WINDOW_S)
        again = [_relaunch_member(m) for m in cluster[:2]]
        recover = await seconds_until(
            lambda: fleet.leader() is not None
            and all(c.health()["etcd"] == "ok" for c in fleet.controllers.values()),
            timeout_s=60, what="a leader and etcd ok on every replica",
        )  # fmt: skip
        await asyncio.sleep(3 * WINDOW_S)  # windows after the outage
        for region in REGIONS:
            h = await fleet.health(region)
            assert h is not None and h.state == "healthy" and h.strikes == 0, h
        t = traffic.tally
        report.add(Row(
            case="etcd quorum lost and regained", fault="SIGKILL of 2 of 3 members, restarted",
            detect_s=round(detect, 2), detect_bound_s=CONTROLLER_TTL_S + 3.0 + SLACK_S,
            recover_s=round(recover, 2), recover_bound_s=CONTROLLER_TTL_S + 10.0 + SLACK_S,
            requests=t.total, lost=t.lost, broken=t.broken,
            note="fail static: no window judged while etcd was gone, no strike after; "
            "recover includes two members' restart and raft election",
        ))  # fmt: skip
    finally:
        for p in again:
            p.stop()
        await fleet.close()


async def test_the_leading_controller_killed_is_replaced_within_its_lease(
    logs: Path, etcd1: EtcdServer, report: Report
) -> None:
    fleet = Fleet(logs, [etcd1.url], agent_etcd={r: [etcd1.url] for r in REGIONS})
    try:
        await _started(fleet)
        leader = fleet.leader()
        assert leader is not None
        fleet.controllers[leader].kill()
        other = next(n for n in fleet.controllers if n != leader)
        takeover = await seconds_until(
            lambda: fleet.leader() == other, timeout_s=30, what="the other replica leads"
        )
        await asyncio.sleep(3 * WINDOW_S)
        assert await fleet.all_healthy()  # nothing undone, nothing judged wrongly
        report.add(Row(
            case="leader controller killed", fault="SIGKILL of the leading replica of two",
            detect_s=round(takeover, 2),
            detect_bound_s=CONTROLLER_TTL_S + CONTROLLER_TTL_S / 3 + SLACK_S,
            recover_s=None, recover_bound_s=None,
            note="detect: until the follower leads; the regions stayed healthy",
        ))  # fmt: skip
    finally:
        await fleet.close()


# -- in-process controllers: DNS and clocks -----------------------------------------------------


class _StandIns:
    """Stand-in agents writing statuses straight into etcd (the DNS case's regions)."""

    def __init__(self, etcd: EtcdServer) -> None:
        self.store = etcd_client(etcd.url, timeout_s=1.0)
        self.up = {"eu-west": True, "us-east": True}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._run(r)) for r in self.up]

    async def _run(self, region: str) -> None:
        while True:
            if self.up[region]:
                status = RegionStatus(
                    region=region, geo=GEO[region], endpoints=[ENDPOINTS[region]],
                    nodes_healthy=2, nodes_total=2, capacity=2.0, updated_at=time.time(),
                )  # fmt: skip
                with contextlib.suppress(Exception):
                    await self.store.put(
                        keys.agent_status(region, "a1"), status.model_dump_json().encode()
                    )
                    await self.store.put(keys.agent_alive(region, "a1"), b"")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await cancel_all(self.tasks)
        await self.store.close()


async def test_the_dns_server_killed_during_a_failover_is_brought_up_to_date(
    etcd: EtcdServer, bind: BindServer, report: Report
) -> None:
    agents = _StandIns(etcd)
    agents.start()
    settings = ControllerSettings(
        etcd={"endpoints": [etcd.url], "timeout_s": 1.0},
        election={"id": "ctl-dns", "lease_ttl_s": 2},
        failover={"window_s": 0.5, "strikes": 2, "status_stale_s": 2.0,
                  "agent_heartbeat_s": 0.5, "min_hold_s": 0.0},
        regions=DNS_REGIONS, dns=dns_settings(bind),
    )  # type: ignore[arg-type]  # fmt: skip
    runner = web.AppRunner(create_app(settings))
    await runner.setup()
    again: BindServer | None = None
    try:
        eu_both = {EU_ADDRESS}

        async def eu_answer() -> set[str]:
            with contextlib.suppress(Exception):
                return set(await answer(bind, "127.0.0.2", API, "A"))
            return set()

        await seconds_until(lambda: _eq(eu_answer(), eu_both), timeout_s=20, what="eu answer")
        bind.process.kill()  # the DNS server dies ...
        agents.up["eu-west"] = False  # ... and eu-west fails while it is down
        await agents.store.delete(keys.agent_alive("eu-west", "a1"))
        store = agents.store

        async def failed() -> bool:
            entry = await store.get(keys.health("eu-west"))
            return entry is not None and RegionHealth.model_validate_json(entry.value).state == (
                "failed"
            )

        detect = await seconds_until(failed, timeout_s=20, what="eu-west failed")

        async def apply_error() -> bool:
            entry = await store.get(keys.DNS_APPLIED)
            applied = None if entry is None else DnsApplied.model_validate_json(entry.value)
            return applied is not None and bool(applied.error)

        await seconds_until(apply_error, timeout_s=20, what="the DNS apply failing")
        again = relaunch_bind(bind)
        recover = await seconds_until(
            lambda: _eq(eu_answer(), {US_ADDRESS}), timeout_s=30,
            what="the eu view answers with the backup once named is back",
        )  # fmt: skip
        report.add(Row(
            case="DNS server killed during a failover",
            fault="SIGKILL of named, then eu-west's agent stops",
            detect_s=round(detect, 2), detect_bound_s=2 + 2 * 0.5 + 0.5 + SLACK_S,
            recover_s=round(recover, 2), recover_bound_s=5.0 + SLACK_S,
            note="the desired records were kept while named was down (dns/applied carries the "
            "error) and applied once it answered",
        ))  # fmt: skip
    finally:
        await runner.cleanup()
        await agents.close()
        if again is not None:
            again.process.stop()


async def _eq(got: Any, want: set[str]) -> bool:
    return bool(await got == want)


async def test_a_clock_step_on_the_leading_replica_fails_no_region(
    etcd: EtcdServer, report: Report
) -> None:
    """The leader's wall clock jumps an hour ahead mid-run (NTP fixing a drifted VM)."""

    class SteppedClock(WallClock):
        offset_s = 0.0

        def now(self) -> float:
            return super().now() + self.offset_s

    agents = _StandIns(etcd)
    agents.start()
    clock = SteppedClock()
    settings = ControllerSettings(
        etcd={"endpoints": [etcd.url], "timeout_s": 1.0},
        election={"id": "ctl-clock", "lease_ttl_s": 2},
        failover={"window_s": 0.5, "strikes": 2, "status_stale_s": 2.0,
                  "agent_heartbeat_s": 0.5, "min_hold_s": 0.0},
        regions=DNS_REGIONS,
    )  # type: ignore[arg-type]  # fmt: skip
    app = create_app(settings, clock=clock)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        controller = app[CONTROLLER]
        await seconds_until(lambda: controller.passes >= 3, timeout_s=20, what="passes")
        clock.offset_s = 3600.0
        passes = controller.passes
        await seconds_until(lambda: controller.passes >= passes + 6, timeout_s=20, what="passes")
        for region in ("eu-west", "us-east"):
            entry = await agents.store.get(keys.health(region))
            assert entry is not None
            h = RegionHealth.model_validate_json(entry.value)
            assert h.state == "healthy" and h.strikes == 0, (region, h)
        report.add(Row(
            case="clock step on one replica", fault="the leader's wall clock +3600 s mid-run",
            detect_s=None, detect_bound_s=None, recover_s=None, recover_bound_s=None,
            note="six windows after the step: no strike (status age is the smaller of the wall "
            "clocks' and the leader's monotonic view of the status changing)",
        ))  # fmt: skip
    finally:
        await runner.cleanup()
        await agents.close()
