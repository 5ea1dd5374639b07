"""The rules and dashboards against a real Prometheus (Debian's binary) scraping a live fleet on
loopback every second (tests/observability/stack.py: real etcd and BIND9, simulated nodes
behind ``meridian-agent`` processes, three ``meridian-controller`` processes, streamed traffic).

The rules are the shipped ones with every ``for:`` rewritten to 1 s (tests/observability/
prom.py); the shipped files wait minutes.  Counters that appear only with their first event
(failovers, recoveries, admin actions, ejections, DNS errors) are made to count by causing the
events: a manual failover and failback, a node killed and restarted, named killed and
restarted.  Then every panel's query and every recording rule must return data.

With ``MERIDIAN_SCREENSHOTS=docs/img`` the last test writes prometheus-region-failed.png and
prometheus-alerts.png there: Prometheus' own graph and alerts pages in Debian's chromium
(Playwright), Grafana not being installable here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.harness import MODEL, Traffic
from tests.observability.prom import Prometheus, panel_queries, recordings, substitute
from tests.observability.stack import (
    AGENT_TTL_S,
    OPERATOR_TOKEN,
    STRIKES,
    WINDOW_S,
    Fleet,
)

pytestmark = [pytest.mark.observability, pytest.mark.timeout(420)]

REGION = "eu-north"  # the region dashboard's $region: alive throughout, one node killed
SLACK_S = 6.0  # a dozen processes on a loaded 2-core host
# its lease runs out, STRIKES failed windows and one of phase, then a scrape, an evaluation
# and the rewritten 1 s `for:`, each a second
FAIL_BOUND_S = AGENT_TTL_S + (STRIKES + 1) * WINDOW_S + 3.0 + SLACK_S
STATE = (
    "max by (region) ("
    ' meridian_controller_region_state{state="suspect"}'
    ' or meridian_controller_region_state{state="recovering"} * 2'
    ' or meridian_controller_region_state{state="drained"} * 3'
    ' or meridian_controller_region_state{state="failed"} * 4)'
)  # the fleet dashboard's encoding: 0 healthy .. 4 failed


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, poll_s: float = 0.5
) -> float:
    """Seconds until ``check`` holds; fails after ``timeout_s``."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(poll_s)
    return time.monotonic() - start


async def query(prometheus: Prometheus, expr: str) -> list[dict[str, Any]]:
    return await asyncio.to_thread(prometheus.query, expr)


async def value(prometheus: Prometheus, expr: str) -> float | None:
    """The value of a query that returns one sample, ``None`` when it returns none."""
    result = await query(prometheus, expr)
    assert len(result) <= 1, (expr, result)
    return float(result[0]["value"][1]) if result else None


async def alerts(prometheus: Prometheus, name: str, state: str = "firing") -> list[dict[str, str]]:
    return await asyncio.to_thread(prometheus.alerts, name, state)


class Chats(Traffic):
    """harness.Traffic with a system prompt of two 128-token KV blocks (the cpu-tiny profile's
    block size), so the nodes' prefix cache hits."""

    SYSTEM = "You are a careful assistant who answers in plain words. " * 30

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {
                "model": MODEL,
                "stream": True,
                "max_tokens": self.max_tokens,
                "messages": [
                    {"role": "system", "content": self.SYSTEM},
                    {"role": "user", "content": f"client {i} turn {n}"},
                ],
            }
            await self._one(body, session=f"client-{i}")


@contextlib.asynccontextmanager
async def traffic(fleet: Fleet, regions: list[str]) -> AsyncIterator[dict[str, Traffic]]:
    async with contextlib.AsyncExitStack() as stack:
        yield {r: await stack.enter_async_context(Chats(fleet.agents[r].url, concurrency=2))
               for r in regions}  # fmt: skip


async def admin(fleet: Fleet, path: str) -> None:
    async with httpx.AsyncClient(base_url=fleet.controllers["ctl-a"].admin_url, timeout=10) as c:
        r = await c.post(
            path,
            json={"reason": "observability test"},
            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
        )
    assert r.status_code == 200, r.text


async def until_series(prometheus: Prometheus, expr: str, timeout_s: float = 30.0) -> None:
    async def there() -> bool:
        return bool(await query(prometheus, expr))

    await eventually(there, timeout_s, expr)


async def test_every_panel_query_and_recording_rule_returns_data(
    fleet: Fleet, prometheus: Prometheus
) -> None:
    async with traffic(fleet, list(fleet.agents)):

        async def one_leader() -> bool:
            return await value(prometheus, "sum(meridian_controller_leader)") == 1

        await eventually(one_leader, 60, "one leader scraped")

        # counters that only appear with their first event: cause the events
        await admin(fleet, "/v1/regions/us-east/failover")
        await until_series(prometheus, 'meridian_controller_failovers_total{region="us-east"}')
        await admin(fleet, "/v1/regions/us-east/failback")
        await until_series(prometheus, 'meridian_controller_recoveries_total{region="us-east"}')
        await until_series(prometheus, 'meridian_controller_admin_actions_total{verb="failback"}')

        node = fleet.nodes[REGION][1]
        node.kill()
        await until_series(prometheus, "meridian_agent_node_ejections_total")
        await asyncio.to_thread(node.start)

        fleet.kill_bind()
        await until_series(prometheus, "meridian_controller_dns_update_errors_total")
        await asyncio.to_thread(fleet.restart_bind)

        variables = {"region": REGION}
        pending = {q.where: substitute(q.expr, variables) for q in panel_queries()}
        pending |= {f"recording rule {r['record']}": r["record"] for r in recordings()}
        assert len(pending) >= 45

        async def all_answer() -> bool:
            for where, expr in list(pending.items()):
                if await query(prometheus, expr):
                    del pending[where]
            return not pending

        with contextlib.suppress(AssertionError):
            await eventually(all_answer, 60, "every query", poll_s=1.0)
        assert pending == {}, "queries that returned no data"

        # the region variable lists the regions; a few values that must be what they are
        data = await asyncio.to_thread(
            prometheus.api, "label/region/values", **{"match[]": "meridian_agent_build_info"}
        )
        assert sorted(data) == ["eu-north", "eu-west", "us-east"]
        judged = STATE.replace("{state=", f'{{region="{REGION}", state=')
        assert await value(prometheus, judged) == 0  # healthy
        alive = f'max(meridian_controller_region_agents_alive{{region="{REGION}"}})'
        assert await value(prometheus, alive) == 1
        (hits,) = [
            q.expr for q in panel_queries() if "Prefix-cache" in q.where and "(A)" in q.where
        ]
        hit = await value(prometheus, substitute(hits, variables))
        assert hit is not None and 0 < hit <= 1, hit  # the traffic repeats a system prompt


async def test_a_replica_cut_off_from_etcd_fires_its_alert_and_no_other(
    fleet: Fleet, prometheus: Prometheus
) -> None:
    cut = fleet.controllers["ctl-c"].url.removeprefix("http://")

    async def fired() -> bool:
        return [
            a["instance"] for a in await alerts(prometheus, "MeridianControllerEtcdUnreachable")
        ] == [cut]

    await eventually(fired, 60, "ctl-c's etcd alert")
    assert await value(prometheus, f'meridian_controller_etcd_connected{{instance="{cut}"}}') == 0
    assert await query(prometheus, f'meridian_controller_etcd_errors_total{{instance="{cut}"}}')
    for state in ("pending", "firing"):
        assert await alerts(prometheus, "MeridianNoLeader", state) == []


async def test_region_failed_fires_after_its_agent_is_killed(
    fleet: Fleet, prometheus: Prometheus
) -> None:
    async def failed_alerts(state: str = "firing") -> set[str]:
        return {a["region"] for a in await alerts(prometheus, "MeridianRegionFailed", state)}

    async with traffic(fleet, ["eu-north", "us-east"]):

        async def all_healthy() -> bool:
            states = await query(prometheus, STATE)
            return len(states) == 3 and all(float(s["value"][1]) == 0 for s in states)

        await eventually(all_healthy, 60, "every region healthy")

        async def quiet() -> bool:
            return not await failed_alerts("firing") and not await failed_alerts("pending")

        await eventually(quiet, 30, "MeridianRegionFailed neither firing nor pending")

        agent = fleet.agents["eu-west"]
        agent.kill()  # SIGKILL

        async def fired() -> bool:
            return "eu-west" in await failed_alerts()

        took = await eventually(fired, FAIL_BOUND_S, "MeridianRegionFailed for eu-west")
        print(
            f"\nMeridianRegionFailed firing {took:.1f} s after the kill (bound {FAIL_BOUND_S:g} s)"
        )
        assert await failed_alerts() == {"eu-west"}

        async def consequences() -> bool:
            down = {a["region"] for a in await alerts(prometheus, "MeridianRegionAgentsDown")}
            geos = {a["geo"] for a in await alerts(prometheus, "MeridianGeoOnLastRegion")}
            targets = {a["instance"] for a in await alerts(prometheus, "MeridianAgentDown")}
            return (down == {"eu-west"} and geos == {"eu"}
                    and targets == {agent.url.removeprefix("http://")})  # fmt: skip

        await eventually(consequences, 20, "the agent, geography and target alerts")
        await screenshots(prometheus)


async def screenshots(prometheus: Prometheus) -> None:
    """Prometheus' graph of the regions' states and its alerts page, when
    ``MERIDIAN_SCREENSHOTS`` names a directory."""
    where = os.environ.get("MERIDIAN_SCREENSHOTS")
    if not where:
        return
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("MERIDIAN_SCREENSHOTS needs Playwright: `make test-browser` installs it")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("MERIDIAN_SCREENSHOTS needs chromium: `make test-browser` installs it")
    out = Path(where)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    graph = urllib.parse.urlencode({"g0.expr": STATE, "g0.tab": "0", "g0.range_input": "1m"})
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1300, "height": 900})
            await page.goto(f"{prometheus.url}/classic/graph?{graph}")
            await page.wait_for_selector(".graph_area svg path", state="attached", timeout=15000)
            await page.wait_for_load_state("networkidle")
            await page.screenshot(path=str(out / "prometheus-region-failed.png"), full_page=True)
            await page.goto(f"{prometheus.url}/classic/alerts")
            await page.wait_for_load_state("networkidle")
            # open MeridianRegionFailed (its rule, labels, state, since) with its annotations
            await page.click("tr.alert_header:has-text('MeridianRegionFailed')")
            await page.click("button.show-annotations")
            await page.screenshot(path=str(out / "prometheus-alerts.png"), full_page=True)
        finally:
            await browser.close()
