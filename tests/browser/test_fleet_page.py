"""The fleet page (/ui/ on the admin port) in a real headless Chromium against a real controller
and real etcd.

Login and actions run against tests/meridianctl/stack.py (stand-in agents write the regions'
statuses); the region killed and the dry run run against tests/browser/fleet.py: real
``meridian-agent`` processes in front of simulated nodes, a real BIND9 steered by the
controller, so the page's DNS section is checked against what BIND answers.

With ``MERIDIAN_SCREENSHOTS=docs/img`` the tests write docs/img/fleet-page.png (the dry run)
and docs/img/fleet-page-failed.png (a region failed).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

import meridian_etcd
from meridian_wire import keys
from meridian_wire.models import RegionOverride
from tests.browser.conftest import OpenUi, UiPage
from tests.browser.fleet import ADDRESSES, AGENT_TTL_S, STRIKES, WINDOW_S, Fleet
from tests.controlplane.dns_helpers import API, answer
from tests.meridianctl.stack import REGIONS, TOKENS, Stack, leading
from tests.support import BindServer, EtcdServer
from tests.support.etcd import client as etcd_client

if TYPE_CHECKING:
    from playwright.async_api import Locator, Page

pytestmark = pytest.mark.browser

REGION_IDS = [r["id"] for r in REGIONS]
POLL_S = 1.5  # app.js POLL_MS
SLACK_S = 3.0  # processes and a browser on a loaded 2-core host
# a dead agent's lease runs out, then STRIKES failed windows, one window of phase, one poll
FAIL_BOUND_S = AGENT_TTL_S + STRIKES * WINDOW_S + WINDOW_S + POLL_S + SLACK_S


def expect(target: Any) -> Any:
    """Playwright's ``expect``, imported here so that ``make test`` collects this module
    without Playwright installed."""
    from playwright.async_api import expect as playwright_expect

    return playwright_expect(target)


def row(page: Page, region: str) -> Locator:
    return page.locator(f'#regions-body tr[data-region="{region}"]')


async def login(ui: UiPage, token: str) -> None:
    await ui.page.fill("#token", token)
    await ui.page.click("#login-form button[type=submit]")


async def no_region_data(page: Page) -> None:
    html = await page.content()
    for region in REGION_IDS:
        assert region not in html, f"{region} is in the page without a valid token"


async def all_healthy(page: Page, timeout_s: float = 30) -> None:
    for region in REGION_IDS:
        await expect(row(page, region)).to_have_attribute(
            "data-state", "healthy", timeout=timeout_s * 1000
        )


async def get(url: str, path: str, role: str = "operator") -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.get(path, headers={"Authorization": f"Bearer {TOKENS[role]}"})
        assert r.status_code == 200, r.text
        return r.json()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def fleet_keys(store: meridian_etcd.Store) -> dict[str, bytes]:
    """What an action would write: every region's override, desired state and health, and the
    failover policy; not the bookkeeping (audit, events, plan, DNS) nor what agents write."""
    out = {}
    for e in (await store.get_prefix(keys.PREFIX)).entries:
        if e.key.endswith(("/override", "/desired", "/health", "controller/policies")):
            out[e.key] = e.value
    return out


async def settled_keys(url: str, store: meridian_etcd.Store) -> dict[str, bytes]:
    """:func:`fleet_keys` once a whole window has passed without changing them: the regions
    show healthy before the controller's first window has judged them, and that window writes
    their first judgements (the keys' ``window`` and ``good_windows``, the models' backups)."""
    then = await fleet_keys(store)
    for _ in range(10):
        window = (await get(url, "/v1/regions"))["window"]

        async def next_window(window: int = window) -> bool:
            return bool((await get(url, "/v1/regions"))["window"] > window)

        await eventually(next_window, 5 * WINDOW_S, "the next window")
        now = await fleet_keys(store)
        if now == then:
            return now
        then = now
    raise AssertionError("the controller wrote the regions' keys in each of 10 windows")


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
async def stack(etcd: EtcdServer) -> AsyncIterator[Stack]:
    async with leading(etcd.url) as s:
        yield s


@pytest.fixture
async def fleet(
    etcd: EtcdServer, bind: BindServer, tmp_path: Path, sim_node: Callable[..., Awaitable[str]]
) -> AsyncIterator[Fleet]:
    nodes = {region: await sim_node(seed=i) for i, region in enumerate(REGION_IDS)}
    f = Fleet(etcd.url, bind, tmp_path)
    try:
        yield await f.start(nodes)
    finally:
        await f.close()


@pytest.fixture
async def store(etcd: EtcdServer) -> AsyncIterator[meridian_etcd.Store]:
    s = etcd_client(etcd.url, timeout_s=2.0)
    yield s
    await s.close()


# -- (a) no data without a valid token ------------------------------------------------------------


async def test_without_a_valid_token_the_page_asks_for_one_and_shows_no_data(
    stack: Stack, open_ui: OpenUi
) -> None:
    ui = await open_ui(stack.url("ctl-a"))
    page = ui.page
    await expect(page.locator("#login")).to_be_visible()
    await expect(page.locator("#fleet")).to_be_hidden()
    # the script has run (the actions come from the OpenAPI document, which needs no token) ...
    await expect(page.locator("#action option")).to_have_count(4)
    # ... and asked for nothing else
    await no_region_data(page)
    assert {path for path, _, _ in ui.requests} == {"/v1/openapi.json"}, ui.requests

    await login(ui, "not-a-token-of-this-controller")
    await expect(page.locator("#login-error")).to_contain_text("refused this token (401)")
    await expect(page.locator("#login")).to_be_visible()
    await expect(page.locator("#fleet")).to_be_hidden()
    await no_region_data(page)
    assert ("/v1/regions", 401) in ui.statuses and ("/v1/regions", 200) not in ui.statuses
    assert await page.evaluate("sessionStorage.getItem('meridian-token')") is None

    # a bad token left in the tab's storage: the same prompt after a reload, no data
    await page.evaluate("sessionStorage.setItem('meridian-token', 'stale-token')")
    await page.reload()
    await expect(page.locator("#login-error")).to_contain_text("(401)")
    await expect(page.locator("#fleet")).to_be_hidden()
    await no_region_data(page)

    # the same checks see the data once the token is good (so they can fail)
    await login(ui, TOKENS["viewer"])
    await expect(page.locator("#regions-body tr")).to_have_count(3)
    await expect(page.locator("#login")).to_be_hidden()
    html = await page.content()
    assert all(region in html for region in REGION_IDS)
    assert all(auth for path, _, auth in ui.requests if path == "/v1/regions")
    await page.reload()  # the token is kept for this tab
    await expect(page.locator("#regions-body tr")).to_have_count(3)

    await page.click("#logout")
    await expect(page.locator("#login")).to_be_visible()
    await no_region_data(page)
    assert await page.evaluate("sessionStorage.getItem('meridian-token')") is None
    assert not ui.csp_violations(), ui.console


# -- (b) a region killed shows failed within the window bound ---------------------------------


async def test_a_region_whose_agent_is_killed_shows_failed_within_the_window_bound(
    fleet: Fleet, bind: BindServer, open_ui: OpenUi
) -> None:
    ui = await open_ui(fleet.url)
    page = ui.page
    await login(ui, TOKENS["viewer"])
    await all_healthy(page)
    for region in REGION_IDS:
        assert await row(page, region).locator("td.alive").text_content() == "alive"
        weight = row(page, region).locator("td.weight")
        await expect(weight).to_have_text(re.compile(r"^\s*100 %$"))

    # DNS: what each geography's view answers now, on the page and from BIND itself
    eu = page.locator(f'#dns .view[data-geo="eu"] tr[data-type="A"][data-name="{API}"] td.values')
    us = page.locator(f'#dns .view[data-geo="us"] tr[data-type="A"][data-name="{API}"] td.values')
    await expect(eu).to_contain_text(ADDRESSES["eu-west"], timeout=15_000)
    await expect(eu).to_contain_text(ADDRESSES["eu-north"])
    await expect(us).to_have_text(ADDRESSES["us-east"])
    shown = set(await eu.locator("div").all_text_contents())
    assert shown == await answer(bind, "127.0.0.2", API, "A")  # the eu view (geo-a)
    assert {ADDRESSES["us-east"]} == await answer(bind, "127.0.0.1", API, "A")

    fleet.agents["eu-west"].kill()  # SIGKILL: no goodbye, its lease runs out
    killed = time.monotonic()
    await expect(row(page, "eu-west")).to_have_attribute(
        "data-state", "failed", timeout=FAIL_BOUND_S * 1000
    )
    took = time.monotonic() - killed
    assert took <= FAIL_BOUND_S, f"the page showed eu-west failed after {took:.1f} s"
    print(f"the page showed eu-west failed {took:.1f} s after the kill (bound {FAIL_BOUND_S} s)")

    await expect(row(page, "eu-west").locator("td.weight")).to_have_text(re.compile(r"^\s*0 %$"))
    await expect(row(page, "eu-west").locator("td.alive")).to_have_text("gone")
    await expect(row(page, "eu-north")).to_have_attribute("data-state", "healthy")
    await expect(row(page, "us-east")).to_have_attribute("data-state", "healthy")
    await expect(page.locator('#serving li[data-geo="eu"]')).to_contain_text("eu-north 100 %")
    timeline = page.locator('#events li[data-region="eu-west"]')
    await expect(timeline.filter(has_text="-> failed").first).to_be_visible()
    await expect(page.locator('#events li[data-kind="failover"]').first).to_contain_text("eu-west")
    # the eu view now answers eu-north alone, as BIND does; the us view did not move
    await expect(eu).to_have_text(ADDRESSES["eu-north"], timeout=10_000)
    assert await answer(bind, "127.0.0.2", API, "A") == {ADDRESSES["eu-north"]}
    await expect(us).to_have_text(ADDRESSES["us-east"])
    await ui.screenshot("fleet-page-failed.png")

    # the controller itself stops: the page says since when, and keeps what it last saw
    assert fleet.runner is not None
    await fleet.runner.cleanup()
    fleet.runner = None
    stale = page.locator("#stale")
    await expect(stale).to_contain_text("no answer from the controller since", timeout=15_000)
    await expect(page.locator("#fleet")).to_have_class(re.compile(r"\bstale\b"))
    await expect(row(page, "eu-west")).to_have_attribute("data-state", "failed")
    assert not ui.csp_violations(), ui.console


# -- (c) a dry run from the page changes nothing --------------------------------------------------


async def test_a_dry_run_failover_from_the_page_shows_the_plan_and_changes_nothing(
    fleet: Fleet, store: meridian_etcd.Store, open_ui: OpenUi
) -> None:
    ui = await open_ui(fleet.url)
    page = ui.page
    await login(ui, TOKENS["operator"])
    await all_healthy(page)
    eu = page.locator(f'#dns .view[data-geo="eu"] tr[data-type="A"][data-name="{API}"] td.values')
    await expect(eu).to_contain_text(ADDRESSES["eu-north"], timeout=15_000)
    await page.select_option("#action", "failover")
    await expect(page.locator("#target-label")).to_be_visible()  # failover takes a target
    await page.select_option("#action-region", "eu-west")
    before = await settled_keys(fleet.url, store)
    audited = len((await get(fleet.url, "/v1/audit"))["entries"])

    await page.click("#dry-run")  # no reason: refused on the page, nothing sent
    await expect(page.locator("#result")).to_contain_text("a reason is required")
    assert len((await get(fleet.url, "/v1/audit"))["entries"]) == audited
    assert not [p for p, method, _ in ui.requests if method == "POST"]

    reason = "INC-7: rehearse the eu-west failover"
    await page.fill("#reason", reason)
    await page.click("#dry-run")
    result = page.locator("#result")
    await expect(result).to_contain_text("failover eu-west: would change")
    await expect(result.locator('li[data-change="eu-west"]')).to_contain_text("healthy → failed")
    await expect(result.locator('.shares li[data-geo="eu"]')).to_contain_text("→ eu-north 100 %")
    await expect(result).to_contain_text(f"{reason} (dry run: nothing changed)")
    await expect(page.locator("#apply")).to_be_enabled()  # the plan shown may now be applied
    await ui.screenshot("fleet-page.png")

    # nothing changed: etcd, the admin API, and still so two windows later
    assert await fleet_keys(store) == before
    newest = (await get(fleet.url, "/v1/audit"))["entries"][-1]
    assert (newest["action"], newest["region"], newest["result"]) == (
        "failover",
        "eu-west",
        "dry-run",
    )
    assert newest["reason"] == reason and newest["who"] == "operator-user" and newest["dry_run"]
    window = (await get(fleet.url, "/v1/regions"))["window"]

    async def two_windows_on() -> bool:
        return bool((await get(fleet.url, "/v1/regions"))["window"] >= window + 2)

    await eventually(two_windows_on, 10 * WINDOW_S, "two more windows")
    rows = {r["region"]: r for r in (await get(fleet.url, "/v1/regions"))["regions"]}
    assert rows["eu-west"]["state"] == "healthy" and rows["eu-west"]["weight"] == 1.0
    assert not rows["eu-west"]["manual_failover"] and rows["eu-west"]["admin"] == "active"
    assert await store.get(keys.override("eu-west")) is None
    assert await fleet_keys(store) == before
    await expect(row(page, "eu-west")).to_have_attribute("data-state", "healthy")
    assert not ui.csp_violations(), ui.console


# -- actions: the role, the plan applied, the failback -------------------------------------------


async def test_an_action_needs_an_operator_and_applies_only_the_plan_shown(
    stack: Stack, open_ui: OpenUi
) -> None:
    url = stack.url("ctl-a")
    ui = await open_ui(url)
    page = ui.page
    await login(ui, TOKENS["viewer"])
    await all_healthy(page)
    before = await fleet_keys(stack.store)
    await page.select_option("#action", "failover")
    await page.select_option("#action-region", "eu-west")
    await page.fill("#reason", "a viewer tries")
    await page.click("#dry-run")
    await expect(page.locator("#result")).to_contain_text("(403)")
    await expect(page.locator("#result")).to_contain_text("needs role operator")
    await expect(page.locator("#apply")).to_be_disabled()
    await expect(page.locator("#fleet")).to_be_visible()  # a 403 is not a logout
    assert await fleet_keys(stack.store) == before

    await page.click("#logout")
    await login(ui, TOKENS["operator"])
    await all_healthy(page)
    await page.select_option("#action", "failover")
    await page.select_option("#action-region", "eu-west")
    await page.fill("#reason", "INC-9 first reason")
    await page.click("#dry-run")
    await expect(page.locator("#apply")).to_be_enabled()
    await page.fill("#reason", "INC-9 another reason")  # the plan shown no longer applies
    await expect(page.locator("#apply")).to_be_disabled()
    assert await fleet_keys(stack.store) == before
    await page.click("#dry-run")
    await expect(page.locator("#result")).to_contain_text("would change")
    await page.click("#apply")
    await expect(page.locator("#result")).to_contain_text("failover eu-west: did change")
    await expect(page.locator("#apply")).to_be_disabled()
    await expect(row(page, "eu-west")).to_have_attribute("data-state", "failed")
    await expect(row(page, "eu-west").locator("td.state")).to_contain_text("(manual)")
    entry = await stack.store.get(keys.override("eu-west"))
    assert entry is not None
    override = RegionOverride.model_validate_json(entry.value)
    assert override.failover and override.reason == "INC-9 another reason"
    assert override.by == "operator-user"
    audit = (await get(url, "/v1/audit"))["entries"]
    applied = [e for e in audit if e["result"] == "applied"]
    assert len(applied) == 1 and applied[0]["idempotency_key"]  # sent with a fresh key

    await page.select_option("#action", "failback")
    await expect(page.locator("#target-label")).to_be_hidden()  # failback takes no target
    await page.select_option("#action-region", "eu-west")
    reason = "INC-9 <b>resolved</b>"  # markup typed by an operator comes back as text
    await page.fill("#reason", reason)
    await page.click("#dry-run")
    await expect(page.locator("#result")).to_contain_text("failback eu-west: would change")
    await page.click("#apply")
    await expect(page.locator("#result")).to_contain_text("failback eu-west: did change")
    await expect(page.locator("#result")).to_contain_text(f"{reason} (applied)")
    assert await page.locator("#result b").count() == 0
    await expect(row(page, "eu-west")).not_to_have_attribute("data-state", "failed")
    assert await stack.store.get(keys.override("eu-west")) is None
    await all_healthy(page)

    # a refusal shows the controller's detail and what to do
    await page.select_option("#action", "undrain")
    await page.select_option("#action-region", "us-east")
    await page.fill("#reason", "nothing to undrain")
    await page.click("#dry-run")
    await expect(page.locator("#result")).to_contain_text("(409)")
    await expect(page.locator("#result")).to_contain_text("what to do:")
    assert not ui.csp_violations(), ui.console
