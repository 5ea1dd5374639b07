"""Node faults under streaming traffic: a node killed, failing, slow or flapping; each recovered.

One in-process agent in front of real ``meridian-sim`` processes, with the health loop fast
enough for a test (probes every 0.2 s, 2 failures to go down, a 2 s first ejection).  The
bounds are the settings' own: probes ``probe_interval_s * unhealthy_after + probe_timeout_s``,
passive ejection ``eject_consecutive_errors`` failures, re-admission ``eject_base_s`` plus one
probation trial within ``probation_every`` requests.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from policies.model import Health, NodeId
from tests.faults.harness import NodeProc, Report, Row, Traffic, seconds_until, start_nodes
from tests.support.agent import AgentFactory, AgentHandle

pytestmark = pytest.mark.faults

PROBE_S, PROBE_TIMEOUT_S, DOWN_AFTER, UP_AFTER = 0.2, 0.5, 2, 2
EJECT_S, EJECT_AFTER, TRIAL_EVERY = 2.0, 5, 8
SLACK_S = 1.0  # scheduling on a loaded 2-core host
AGENT: dict[str, Any] = {
    "health": {
        "probe_interval_s": PROBE_S,
        "probe_timeout_s": PROBE_TIMEOUT_S,
        "unhealthy_after": DOWN_AFTER,
        "healthy_after": UP_AFTER,
        "eject_consecutive_errors": EJECT_AFTER,
        "eject_base_s": EJECT_S,
        "max_ejected_fraction": 0.5,
        "slow_start_s": 1.0,
        "latency_min_samples": 8,
        "latency_outlier_min_s": 0.05,  # cpu-tiny at time scale 5: TTFT about 9 ms
    },
    "retry": {"max_attempts": 3, "budget_ratio": 1.0},
    "routing": {"tuning": {"probation_every": TRIAL_EVERY}},
}
PROBE_BOUND_S = PROBE_S * DOWN_AFTER + PROBE_TIMEOUT_S + SLACK_S


def _state(handle: AgentHandle, node: NodeProc) -> Health:
    edge = handle.edge
    node_id = next(n.node_id for n in edge.pool if n.url == node.url)
    return edge.pool.health.state(NodeId(node_id), now=edge.clock.now())


def _busiest(handle: AgentHandle, nodes: list[NodeProc]) -> NodeProc:
    """The node the agent has sent the most requests to."""
    served = {n.url: n.requests_total for n in handle.edge.pool}
    return max(nodes, key=lambda n: served[n.url])


async def _faults(node: NodeProc, body: dict[str, object] | None) -> None:
    async with aiohttp.ClientSession() as s:
        if body is None:
            async with s.delete(f"{node.url}/admin/faults") as r:
                assert r.status == 200
        else:
            async with s.post(f"{node.url}/admin/faults", json=body) as r:
                assert r.status == 200, await r.text()


async def test_a_node_killed_mid_stream(
    logs: Path, start_agent: AgentFactory, report: Report
) -> None:
    nodes = start_nodes(3, logs, time_scale=5.0)
    try:
        handle = await start_agent([n.url for n in nodes], **AGENT)
        async with Traffic(handle.url, concurrency=6, max_tokens=24) as traffic:
            await traffic.requests(20)
            victim = nodes[0]
            victim.kill()  # SIGKILL: streams on it break, queued work must go elsewhere
            detect = await seconds_until(
                lambda: _state(handle, victim) is not Health.HEALTHY,
                timeout_s=10, what="the dead node leaves the rotation",
            )  # fmt: skip
            await traffic.requests(20)
            victim.start()  # back on its port
            bound = 2 * EJECT_S + UP_AFTER * PROBE_S + PROBE_TIMEOUT_S + SLACK_S + 2.0
            recover = await seconds_until(
                lambda: _state(handle, victim) is Health.HEALTHY,
                timeout_s=30, what="the restarted node is healthy again",
            )  # fmt: skip
            await traffic.requests(10)
        t = traffic.tally
        report.add(Row(
            case="node kill -9 mid-stream", fault="SIGKILL of one of 3 nodes under 6 streams",
            detect_s=round(detect, 2), detect_bound_s=PROBE_BOUND_S,
            recover_s=round(recover, 2), recover_bound_s=round(bound, 2),
            requests=t.total, lost=t.lost, broken=t.broken,
            note=f"streams on the killed node end with an error event (broken); the rest are "
            f"retried elsewhere; statuses seen {t.statuses}",
        ))  # fmt: skip
    finally:
        for n in nodes:
            n.stop()


async def test_a_node_answering_500s_is_ejected_then_re_admitted(
    logs: Path, start_agent: AgentFactory, report: Report
) -> None:
    nodes = start_nodes(3, logs, time_scale=5.0)
    try:
        handle = await start_agent([n.url for n in nodes], **AGENT)
        async with Traffic(handle.url, concurrency=3) as traffic:
            await traffic.requests(10)
            # the node the traffic goes to: prefix affinity keeps a shared system prompt on
            # the node it first landed on, and which that is depends on whose first scrape
            # came in first (a CI run faulted an idle node, which never saw a request)
            bad = _busiest(handle, nodes)
            await _faults(bad, {"error_rate": 1.0, "error_status": 500})
            detect = await seconds_until(
                lambda: _state(handle, bad) is Health.EJECTED, timeout_s=20,
                what="the failing node is ejected",
            )  # fmt: skip
            node = next(n for n in handle.edge.pool if n.url == bad.url)
            errors_at_ejection = node.errors_total
            await _faults(bad, None)
            served_before = node.requests_total
            recover = await seconds_until(
                lambda: _state(handle, bad) is Health.HEALTHY, timeout_s=30,
                what="the recovered node is healthy again",
            )  # fmt: skip
            trials = node.requests_total - served_before
            await traffic.requests(10)
        t = traffic.tally
        # passive ejection: within eject_consecutive_errors failures (plus those in flight)
        assert errors_at_ejection <= EJECT_AFTER + traffic.concurrency, errors_at_ejection
        report.add(Row(
            case="node returning 500s", fault="error_rate 1.0 (HTTP 500) on one of 3 nodes",
            detect_s=round(detect, 2), detect_bound_s=None,
            recover_s=round(recover, 2),
            recover_bound_s=EJECT_S + SLACK_S + 3.0,
            requests=t.total, lost=t.lost, broken=t.broken,
            note=f"ejected after {errors_at_ejection} failed requests (setting "
            f"{EJECT_AFTER}); each retried on another node; re-admitted by a probation trial "
            f"after {trials} request(s) to it",
        ))  # fmt: skip
        report.add(Row(
            case="recovered node re-admitted", fault="the 500s stop while the node is ejected",
            detect_s=None, detect_bound_s=None, recover_s=round(recover, 2),
            recover_bound_s=EJECT_S + SLACK_S + 3.0, requests=t.total, lost=t.lost,
            broken=t.broken,
            note=f"meridian policy at light load; trial within {TRIAL_EVERY} decisions",
        ))  # fmt: skip
    finally:
        for n in nodes:
            n.stop()


async def test_a_node_twenty_times_slower_is_ejected_as_a_gray_failure(
    logs: Path, start_agent: AgentFactory, report: Report
) -> None:
    nodes = start_nodes(4, logs, time_scale=5.0)
    try:
        handle = await start_agent([n.url for n in nodes], policy="round_robin", **AGENT)
        async with Traffic(handle.url, concurrency=4) as traffic:
            await traffic.requests(8)
            slow = nodes[2]
            await _faults(slow, {"latency_multiplier": 20.0})
            detect = await seconds_until(
                lambda: _state(handle, slow) is Health.EJECTED, timeout_s=60,
                what="the slow node is ejected as a latency outlier",
            )  # fmt: skip
            await _faults(slow, None)
            recover = await seconds_until(
                lambda: _state(handle, slow) is Health.HEALTHY, timeout_s=60,
                what="the node is healthy again",
            )  # fmt: skip
            await traffic.requests(8)
        t = traffic.tally
        report.add(Row(
            case="node 20x slower (gray failure)",
            fault="latency_multiplier 20 on one of 4 nodes; /health keeps passing",
            detect_s=round(detect, 2), detect_bound_s=None,
            recover_s=round(recover, 2), recover_bound_s=EJECT_S + SLACK_S + 5.0,
            requests=t.total, lost=t.lost, broken=t.broken,
            note="latency outlier: median TTFT over 8 samples above 3x its peers'; detect "
            "time is the time to collect those samples at this load",
        ))  # fmt: skip
    finally:
        for n in nodes:
            n.stop()


async def test_flapping_health_does_not_flap_the_routing(
    logs: Path, start_agent: AgentFactory, report: Report
) -> None:
    """``/health`` that fails and passes every other probe: hysteresis (2 down, 2 up) keeps the
    node where it is; requests keep succeeding on it."""
    nodes = start_nodes(3, logs, time_scale=5.0)
    stop = asyncio.Event()

    async def flap() -> None:
        failing = False
        while not stop.is_set():
            failing = not failing
            await _faults(nodes[0], {"fail_health": failing})
            await asyncio.sleep(PROBE_S)

    try:
        handle = await start_agent([n.url for n in nodes], **AGENT)
        seen: set[Health] = set()
        async with Traffic(handle.url, concurrency=3) as traffic:
            flapper = asyncio.create_task(flap())
            end = time.monotonic() + 5.0
            while time.monotonic() < end:
                seen.add(_state(handle, nodes[0]))
                await asyncio.sleep(0.02)
            stop.set()
            await flapper
            await traffic.requests(5)
        t = traffic.tally
        assert Health.UNHEALTHY not in seen, seen  # one failure at a time never reaches 2
        report.add(Row(
            case="flapping health", fault="/health alternating fail/pass every probe for 5 s",
            detect_s=None, detect_bound_s=None, recover_s=None, recover_bound_s=None,
            requests=t.total, lost=t.lost, broken=t.broken,
            note=f"states seen: {sorted(s.value for s in seen)} (hysteresis "
            f"{DOWN_AFTER} down / {UP_AFTER} up)",
        ))  # fmt: skip
    finally:
        for n in nodes:
            n.stop()


async def test_an_engine_that_stops_stepping_is_cut_retried_and_ejected(
    logs: Path, start_agent: AgentFactory, report: Report
) -> None:
    """The fault probe's finding: a hung engine still answers ``/health``, and six streams
    stalled 20 s mid-stream.  Now a stream waiting longer than ``stall.first_token_s`` for its
    first token is cut and retried on another node, one silent for ``stall.inter_token_s``
    mid-stream ends with an error event, both count as node failures, and the generation probe
    takes the node out."""
    nodes = start_nodes(3, logs, time_scale=5.0)
    generate_s = 1.0
    try:
        handle = await start_agent(
            [n.url for n in nodes],
            **{**AGENT, "health": {**AGENT["health"], "probe_generate": True,
                                   "probe_generate_timeout_s": generate_s}},
            stall={"first_token_s": 2.0, "inter_token_s": 1.0},
        )  # fmt: skip
        async with Traffic(handle.url, concurrency=6, max_tokens=24) as traffic:
            await traffic.requests(20)
            hung = nodes[0]
            await _faults(hung, {"hang": True})
            detect = await seconds_until(
                lambda: _state(handle, hung) is not Health.HEALTHY, timeout_s=20,
                what="the hung node leaves the rotation",
            )  # fmt: skip
            await traffic.requests(30)  # served elsewhere meanwhile
            await _faults(hung, None)
            recover = await seconds_until(
                lambda: _state(handle, hung) is Health.HEALTHY, timeout_s=30,
                what="the node is healthy again",
            )  # fmt: skip
            await traffic.requests(10)
        t = traffic.tally
        bound = DOWN_AFTER * (PROBE_S + generate_s) + SLACK_S + 1.0
        report.add(Row(
            case="engine hung", fault="hang: the engine stops stepping, /health still 200",
            detect_s=round(detect, 2), detect_bound_s=round(bound, 2),
            recover_s=round(recover, 2), recover_bound_s=2 * EJECT_S + SLACK_S + 4.0,
            requests=t.total, lost=t.lost, broken=t.broken,
            note="streams caught mid-way end with an error event after stall.inter_token_s "
            "(broken); those without a first token are retried elsewhere (not lost)",
        ))  # fmt: skip
    finally:
        for n in nodes:
            n.stop()
