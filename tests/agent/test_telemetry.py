"""Telemetry: parsing real vLLM pages, and the scraper against real servers on loopback.

Simulated nodes (``sim_node``, or ``meridian_sim.node`` where a test controls a node's lifetime)
give real values; a small page server gives exact counter sequences.  Time is a fake clock the
test sets, so ages and staleness never depend on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from meridian_sim import node as sim
from meridian_sim import profile
from policies.model import NodeId
from regional_agent.nodes import Node, NodePool
from regional_agent.settings import TelemetrySettings
from regional_agent.telemetry import Scrape, Scraper, TelemetryError
from regional_agent.telemetry.parse import parse
from regional_agent.upstream.client import NodeClient
from regional_agent.workers.shared import SAMPLE_FIELDS, SAMPLE_VALUES, LoadShare, LoadTable
from tests.conftest import NodeFactory
from tests.support import ManualClock
from tests.support.process import in_child

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
LONG_PROMPT = " ".join(f"word{i % 50} alpha beta gamma" for i in range(80))  # 400 tokens
CPU_BLOCK = 128
SCRAPER_LOG = "regional_agent.telemetry.scraper"


# -- parse ---------------------------------------------------------------------------------------


def test_parses_real_vllm_idle_page() -> None:
    scrape = parse((FIXTURES / "vllm-0.32.0-cpu-metrics.txt").read_text())
    assert scrape.ttft_sum_s == pytest.approx(0.0411, abs=1e-4)
    assert dataclasses.replace(scrape, ttft_sum_s=None) == Scrape(
        running=0.0,
        waiting=0.0,
        kv_util=0.0,
        prefix_queries=14.0,
        prefix_hits=0.0,
        preemptions=0.0,
        block_size=128,
        num_gpu_blocks=8192,
        ttft_sum_s=None,
        ttft_count=2.0,
    )


def test_parses_real_vllm_page_after_load() -> None:
    scrape = parse((FIXTURES / "vllm-0.32.0-cpu-metrics-after-load.txt").read_text())
    assert scrape.preemptions == 17.0
    assert scrape.kv_util == 0.0
    assert scrape.block_size == 128
    assert scrape.num_gpu_blocks == 16
    assert scrape.prefix_queries == 1548.0
    assert scrape.prefix_hits == 0.0
    assert (scrape.running, scrape.waiting) == (0.0, 0.0)
    assert scrape.ttft_count == 36.0
    assert scrape.ttft_sum_s == pytest.approx(1.1308, abs=1e-4)


LEGACY_TYPED = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 800.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 320.0
"""
# The same page as an exporter that writes no TYPE lines would: families keep ``_total``.
LEGACY_UNTYPED = "\n".join(line for line in LEGACY_TYPED.splitlines() if line[0] != "#")


@pytest.mark.parametrize("page", [LEGACY_TYPED, LEGACY_UNTYPED], ids=["typed", "untyped"])
def test_reads_pre_0_10_names(page: str) -> None:
    scrape = parse(page)
    assert (scrape.running, scrape.waiting, scrape.kv_util) == (3.0, 2.0, 0.25)
    assert (scrape.prefix_queries, scrape.prefix_hits) == (800.0, 320.0)
    assert scrape.preemptions is None
    assert scrape.block_size is None and scrape.num_gpu_blocks is None
    assert scrape.ttft_sum_s is None and scrape.ttft_count is None


async def test_reads_a_simulated_legacy_page_current_names_first(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny", legacy_metrics=True)
    await _complete(url, LONG_PROMPT)
    text = await _get(f"{url}/metrics")
    assert "vllm:gpu_prefix_cache_queries_total" in text
    scrape = parse(text)
    assert scrape.prefix_queries == 400.0  # not 800: the two generations are not added up
    assert scrape.block_size == CPU_BLOCK
    # Without the current names, the older ones give the same numbers.
    older_only = "\n".join(
        line
        for line in text.splitlines()
        if not any(
            name in line
            for name in (
                "kv_cache_usage_perc",
                "vllm:prefix_cache_queries",
                "vllm:prefix_cache_hits",
            )
        )
    )
    assert parse(older_only) == scrape


def test_sums_engines_and_averages_kv_usage() -> None:
    page = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_queries_created{engine="1",model_name="m"} 1.7e+09
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
"""
    scrape = parse(page)
    assert (scrape.running, scrape.waiting) == (5.0, 5.0)
    assert scrape.kv_util == pytest.approx(0.4)
    assert scrape.prefix_queries == 400.0
    assert scrape.prefix_hits is None
    assert (scrape.block_size, scrape.num_gpu_blocks) == (16, 2000)


def test_cache_config_not_yet_resolved_is_unknown() -> None:
    page = (
        "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        "vllm:kv_cache_usage_perc 0\n"
        'vllm:cache_config_info{block_size="None",num_gpu_blocks="None"} 1.0\n'
    )
    scrape = parse(page)
    assert scrape.block_size is None and scrape.num_gpu_blocks is None


@pytest.mark.parametrize(
    "page",
    ["<html><body>502 Bad Gateway</body></html>", "hello world\n", '{"status": "ok"}'],
    ids=["html", "words", "json"],
)
def test_garbage_is_a_telemetry_error(page: str) -> None:
    with pytest.raises(TelemetryError, match="not a Prometheus text page"):
        parse(page)


def test_missing_metrics_are_named() -> None:
    with pytest.raises(TelemetryError) as info:
        parse("# a page with nothing on it\n")
    message = str(info.value)
    assert "vllm:num_requests_running" in message
    assert "vllm:num_requests_waiting" in message
    assert "vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc" in message

    with pytest.raises(TelemetryError) as info:
        parse("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nprocess_open_fds 9\n")
    assert str(info.value) == (
        "metrics page lacks vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc;"
        " is this a vLLM node?"
    )


def test_a_nan_gauge_is_an_error() -> None:
    page = (
        "vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
    )
    with pytest.raises(TelemetryError, match="vllm:num_requests_running is nan"):
        parse(page)


# -- scraper: fixtures and helpers -------------------------------------------------------------


class Rounds:
    """Counts ``pool.notify()`` calls; ``await rounds.reach(n)`` waits for the n-th."""

    def __init__(self, pool: NodePool) -> None:
        self.count = 0
        self._changed = asyncio.Event()
        pool.subscribe(self._notified)

    def _notified(self) -> None:
        self.count += 1
        self._changed.set()

    async def reach(self, n: int) -> None:
        async with asyncio.timeout(30):
            while self.count < n:
                self._changed.clear()
                await self._changed.wait()


class PageServer:
    """A real HTTP server on loopback whose ``/metrics`` answers whatever the test sets."""

    def __init__(self) -> None:
        self.page = vllm_page()
        self.status = 200
        self.hold: asyncio.Event | None = None  # set: answer; unset: the scrape hangs
        self.hits = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner, port = await sim.start(app)
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.hold is not None:
            self.hold.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.hold is not None:
            await self.hold.wait()
        return web.Response(text=self.page, status=self.status, content_type="text/plain")


def vllm_page(
    *, running: int = 0, waiting: int = 0, kv: float = 0.0, queries: float = 0, hits: float = 0
) -> str:
    return f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="100"}} 1.0
"""


ScraperFactory = Callable[..., Scraper]
PageStarter = Callable[[], Awaitable[PageServer]]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(100.0)


@pytest.fixture
def pool() -> NodePool:
    return NodePool()


@pytest.fixture
async def client() -> AsyncIterator[NodeClient]:
    client = NodeClient(connect_timeout_s=1.0, first_byte_timeout_s=5.0, read_timeout_s=5.0)
    yield client
    await client.close()


@pytest.fixture
async def make_scraper(
    pool: NodePool, client: NodeClient, clock: ManualClock
) -> AsyncIterator[ScraperFactory]:
    def make(**settings: float) -> Scraper:
        scraper = Scraper(
            pool=pool,
            client=client,
            settings=TelemetrySettings(**settings),
            clock=clock,
        )
        pool.telemetry = scraper
        return scraper

    yield make
    leaked = [t for t in asyncio.all_tasks() if t.get_name().startswith("telemetry-")]
    assert not leaked, f"scrape tasks left running: {leaked}"


@pytest.fixture
async def pages() -> AsyncIterator[PageStarter]:
    servers: list[PageServer] = []

    async def start() -> PageServer:
        server = PageServer()
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


def add(pool: NodePool, node_id: str, url: str) -> NodeId:
    pool.add(Node(node_id=NodeId(node_id), url=url))
    return NodeId(node_id)


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.text()


async def _complete(url: str, prompt: str) -> None:
    body = {"model": "tiny-model", "prompt": prompt, "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        await response.read()


# -- scraper against simulated nodes -------------------------------------------------------------


async def test_scrapes_live_nodes_and_derives_the_prefix_hit_rate(
    sim_node: NodeFactory, pool: NodePool, clock: ManualClock, make_scraper: ScraperFactory
) -> None:
    url_a = await sim_node(profile_name="cpu-tiny")
    a = add(pool, "a", url_a)
    b = add(pool, "b", await sim_node(profile_name="cpu-tiny", legacy_metrics=True))
    scraper = make_scraper()
    rounds = Rounds(pool)

    await scraper.scrape_once()
    assert rounds.count == 1
    for node_id in (a, b):
        first = scraper.snapshot(node_id, now=clock.t)
        assert first is not None
        assert (first.running, first.waiting, first.kv_util) == (0, 0, 0.0)
        assert first.block_size == CPU_BLOCK
        assert first.prefix_hit_rate is None  # one sample: no interval yet
        assert first.age_s == 0.0

    await _complete(url_a, LONG_PROMPT)
    clock.t += 0.25
    await scraper.scrape_once()
    cold = scraper.snapshot(a, now=clock.t)
    assert cold is not None and cold.prefix_hit_rate == 0.0  # 400 tokens queried, none cached

    await _complete(url_a, LONG_PROMPT)
    clock.t += 0.25
    await scraper.scrape_once()
    warm = scraper.snapshot(a, now=clock.t + 0.1)
    assert warm is not None
    cached = (400 - 1) // CPU_BLOCK * CPU_BLOCK  # whole blocks, never the last token
    assert warm.prefix_hit_rate == pytest.approx(cached / 400)
    assert warm.age_s == pytest.approx(0.1)
    idle = scraper.snapshot(b, now=clock.t)
    assert idle is not None and idle.prefix_hit_rate is None  # no queries in the interval

    described = scraper.describe(a)
    assert described["prefix_queries_total"] == 800.0
    assert described["prefix_hits_total"] == float(cached)
    assert described["num_gpu_blocks"] == 16
    assert described["consecutive_failures"] == 0 and described["last_error"] is None
    assert described["stale"] is False
    ttft_mean_s = described["ttft_mean_s"]
    assert isinstance(ttft_mean_s, float) and ttft_mean_s > 0
    assert rounds.count == 3

    views = {v.node_id: v for v in pool.views(now=clock.t)}
    assert views[a].telemetry == scraper.snapshot(a, now=clock.t)
    assert views[a].queue_depth == 0


async def test_stopped_node_goes_stale_then_recovers(
    pool: NodePool,
    clock: ManualClock,
    make_scraper: ScraperFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = sim.NodeConfig(profile=profile.load("cpu-tiny"), model="tiny-model", time_scale=20)
    runner, port = await sim.start(sim.create_app(config))
    node_id = add(pool, "n1", f"http://127.0.0.1:{port}")
    scraper = make_scraper(stale_after_s=1.0)
    caplog.set_level(logging.DEBUG, logger=SCRAPER_LOG)
    try:
        await scraper.scrape_once()
        assert scraper.snapshot(node_id, now=clock.t) is not None
    finally:
        await runner.cleanup()

    clock.t += 0.5
    await scraper.scrape_once()  # refused: recorded, and the last sample is still young
    assert scraper.snapshot(node_id, now=clock.t) is not None
    described = scraper.describe(node_id)
    assert described["consecutive_failures"] == 1
    assert "n1" in str(described["last_error"]) and "/metrics" in str(described["last_error"])
    assert described["stale"] is False

    clock.t += 0.6  # 1.1 s since the last good sample
    assert scraper.snapshot(node_id, now=clock.t) is None  # unknown, not idle
    for _ in range(3):
        await scraper.scrape_once()
        clock.t += 0.25
    assert scraper.snapshot(node_id, now=clock.t) is None
    described = scraper.describe(node_id)
    assert described["stale"] is True
    assert described["consecutive_failures"] == 4
    assert described["running"] == 0.0  # the last values stay visible to the operator
    stale_logs = [r for r in caplog.records if "telemetry stale" in r.getMessage()]
    assert len(stale_logs) == 1  # a state change, not every failure
    assert stale_logs[0].levelno == logging.WARNING
    assert "node=n1" in stale_logs[0].getMessage()

    runner, _ = await sim.start(sim.create_app(config), port=port)  # the node comes back
    try:
        await scraper.scrape_once()
    finally:
        await runner.cleanup()
    back = scraper.snapshot(node_id, now=clock.t)
    assert back is not None and back.age_s == 0.0
    assert scraper.describe(node_id)["consecutive_failures"] == 0
    recovered = [r for r in caplog.records if "telemetry fresh" in r.getMessage()]
    assert [r.levelno for r in recovered] == [logging.DEBUG, logging.INFO]  # first, then back


async def test_unreachable_from_the_start_is_unknown_and_logged_once(
    pool: NodePool,
    clock: ManualClock,
    make_scraper: ScraperFactory,
    pages: PageStarter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = await pages()
    await server.stop()  # a closed port
    node_id = add(pool, "gone", server.url)
    scraper = make_scraper()
    caplog.set_level(logging.INFO, logger=SCRAPER_LOG)
    await scraper.scrape_once()
    await scraper.scrape_once()
    assert scraper.snapshot(node_id, now=clock.t) is None
    described = scraper.describe(node_id)
    assert described["stale"] is True and described["age_s"] is None
    assert described["consecutive_failures"] == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if m.startswith("telemetry unavailable node=gone")]) == 1


# -- scraper against exact pages ---------------------------------------------------------------


async def test_hit_rate_per_interval_and_counter_resets(
    pool: NodePool,
    clock: ManualClock,
    make_scraper: ScraperFactory,
    pages: PageStarter,
) -> None:
    server = await pages()
    node_id = add(pool, "p", server.url)
    scraper = make_scraper()

    expected: list[tuple[str, float | None]] = [
        (vllm_page(queries=1000, hits=500), None),  # first sample
        (vllm_page(queries=1400, hits=800), 0.75),  # 300 of 400
        (vllm_page(queries=1400, hits=800), None),  # nothing queried
        (vllm_page(queries=100, hits=0), None),  # restarted: counters went down
        (vllm_page(queries=300, hits=100), 0.5),
    ]
    for page, rate in expected:
        server.page = page
        clock.t += 0.25
        await scraper.scrape_once()
        snapshot = scraper.snapshot(node_id, now=clock.t)
        assert snapshot is not None
        assert snapshot.prefix_hit_rate == rate, page

    server.page = vllm_page(running=7, waiting=3, kv=0.5)
    await scraper.scrape_once()
    snapshot = scraper.snapshot(node_id, now=clock.t)
    assert snapshot is not None
    assert (snapshot.running, snapshot.waiting, snapshot.kv_util) == (7, 3, 0.5)
    assert snapshot.block_size == 16


async def test_bad_pages_and_statuses_are_recorded_not_raised(
    pool: NodePool,
    clock: ManualClock,
    make_scraper: ScraperFactory,
    pages: PageStarter,
) -> None:
    server = await pages()
    node_id = add(pool, "p", server.url)
    scraper = make_scraper()
    await scraper.scrape_once()

    server.page = "<html>oops</html>"
    await scraper.scrape_once()
    described = scraper.describe(node_id)
    assert described["consecutive_failures"] == 1
    assert "not a Prometheus text page" in str(described["last_error"])

    server.page, server.status = vllm_page(), 500
    await scraper.scrape_once()
    described = scraper.describe(node_id)
    assert described["consecutive_failures"] == 2
    assert described["failures_total"] == 2
    assert "500" in str(described["last_error"])
    assert scraper.snapshot(node_id, now=clock.t) is not None  # the good sample is still young

    server.status = 200
    await scraper.scrape_once()
    assert scraper.describe(node_id)["consecutive_failures"] == 0
    assert scraper.describe(node_id)["last_error"] is not None  # kept for the operator


async def test_removed_nodes_are_forgotten(
    pool: NodePool,
    clock: ManualClock,
    make_scraper: ScraperFactory,
    pages: PageStarter,
) -> None:
    one, two = await pages(), await pages()
    a, b = add(pool, "a", one.url), add(pool, "b", two.url)
    scraper = make_scraper()
    await scraper.scrape_once()
    assert scraper.snapshot(b, now=clock.t) is not None

    pool.remove(b)
    await scraper.scrape_once()
    assert scraper.snapshot(b, now=clock.t) is None
    assert scraper.describe(b)["scrapes_total"] == 0
    assert (one.hits, two.hits) == (2, 1)
    assert scraper.snapshot(a, now=clock.t) is not None

    scraper.forget(a)
    assert scraper.snapshot(a, now=clock.t) is None


async def test_run_keeps_scraping_past_a_hung_node(
    pool: NodePool,
    clock: ManualClock,
    make_scraper: ScraperFactory,
    pages: PageStarter,
) -> None:
    fast, slow = await pages(), await pages()
    slow.hold = asyncio.Event()  # its scrape hangs until the test ends
    add(pool, "fast", fast.url)
    hung = add(pool, "slow", slow.url)
    scraper = make_scraper(scrape_interval_s=0.01, scrape_timeout_s=30.0)
    rounds = Rounds(pool)

    task = asyncio.create_task(scraper.run())
    try:
        await rounds.reach(4)
        fast.page = vllm_page(waiting=5)
        seen = fast.hits
        while fast.hits <= seen + 1:  # a scrape that started after the page changed
            await rounds.reach(rounds.count + 1)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert slow.hits == 1  # one scrape in flight the whole time, not one per tick
    snapshot = scraper.snapshot(NodeId("fast"), now=clock.t)
    assert snapshot is not None and snapshot.waiting == 5
    assert scraper.snapshot(hung, now=clock.t) is None
    assert scraper.describe(hung)["consecutive_failures"] == 0  # not failed: still waiting


async def test_telemetry_is_unknown_before_any_scrape(
    pool: NodePool, clock: ManualClock, make_scraper: ScraperFactory
) -> None:
    scraper = make_scraper()
    node_id = add(pool, "new", "http://127.0.0.1:9")
    assert scraper.snapshot(node_id, now=clock.t) is None
    described = scraper.describe(node_id)
    assert described["stale"] is True
    assert described["age_s"] is None and described["scrapes_total"] == 0
    assert described["running"] is None and described["prefix_hit_rate"] is None


# -- several workers: one scrape of each node for all of them -----------------------------------


def _two_workers(
    servers: list[PageServer], client: NodeClient, clock: ManualClock, tmp_path: Path
) -> tuple[list[NodeId], tuple[Scraper, Scraper]]:
    """Two workers' scrapers over the same nodes (``node-<i>``), sharing a table."""
    table = LoadTable(workers=2, slots=64)
    ids = [NodeId(f"node-{i}") for i in range(len(servers))]
    settings = TelemetrySettings(scrape_interval_s=1.0, scrape_timeout_s=1.0, stale_after_s=4.0)

    def worker(index: int) -> Scraper:
        pool = NodePool()
        for node_id, server in zip(ids, servers, strict=True):
            add(pool, node_id, server.url)
        scraper = Scraper(pool=pool, client=client, settings=settings, clock=clock)
        pool.telemetry = scraper
        scraper.share = LoadShare(table, worker=index, lock_file=tmp_path / "slots.lock")
        return scraper

    return ids, (worker(0), worker(1))


async def test_workers_share_one_scrape_of_each_node_and_take_over_a_silent_owner(
    pages: PageStarter,
    client: NodeClient,
    clock: ManualClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each worker scraping every node made each node render its page once per worker and
    interval: now the node's owner scrapes it for all and publishes the sample; the others read
    it, and scrape the node themselves only once the owner has published nothing for two
    intervals and a timeout (it died, or hangs), before the sample goes stale."""
    caplog.set_level(logging.INFO, logger="regional_agent.telemetry.scraper")
    clock.t = 100.0000006  # a published stamp is rounded to the µs: up, here
    servers = [await pages() for _ in range(4)]
    for i, server in enumerate(servers):
        server.page = vllm_page(running=i, waiting=2 * i, kv=0.1 * i)
    ids, (first, second) = _two_workers(servers, client, clock, tmp_path)
    assert first.share is not None and second.share is not None
    mine = [n for n in ids if first.share.owns(n)]
    theirs = [n for n in ids if second.share.owns(n)]
    assert sorted(mine + theirs) == ids and mine and theirs  # each node has one owner

    def hits() -> list[int]:
        return [server.hits for server in servers]

    await first.scrape_once()  # nothing published yet: it scrapes every node
    await second.scrape_once()  # its own nodes only: the first's samples are fresh
    assert hits() == [2 if n in theirs else 1 for n in ids]
    for node_id in mine:  # a start-up scrape of the second's that landed after the owner's
        published = first.share.latest(node_id)
        assert published is not None
        second.share.publish(node_id, clock.t, published[2])
    for _ in range(3):  # from then on, one scrape of each node a round
        clock.t += 1.0
        before = hits()
        await first.scrape_once()
        await second.scrape_once()
        assert [h - b for h, b in zip(hits(), before, strict=True)] == [1, 1, 1, 1]
    for i, node_id in enumerate(ids):
        for scraper in (first, second):
            telemetry = scraper.snapshot(node_id, now=clock.now())
            assert telemetry is not None
            assert (telemetry.running, telemetry.waiting) == (i, 2 * i)
            assert telemetry.block_size == 16
        owner, other = (first, second) if node_id in mine else (second, first)
        assert owner.describe(node_id)["scraped_by"] is None
        listed = other.describe(node_id)
        assert listed["scraped_by"] == ("w0" if owner is first else "w1")
        assert listed["num_gpu_blocks"] == 100 and listed["stale"] is False

    # the first worker stops (killed): the second takes its nodes over before they go stale
    silent_at = clock.now()
    while clock.now() - silent_at < 5.0:
        clock.t += 1.0
        before = hits()
        await second.scrape_once()
        took_over = clock.now() - silent_at > 2 * 1.0 + 1.0
        for node_id, was, now in zip(ids, before, hits(), strict=True):
            scraped = node_id in theirs or took_over
            assert now - was == (1 if scraped else 0), (node_id, clock.now() - silent_at)
            assert second.snapshot(node_id, now=clock.now()) is not None
    silent = [r.getMessage() for r in caplog.records if "owner silent" in r.getMessage()]
    assert sorted(m.split()[3] for m in silent) == [f"node={n}" for n in sorted(mine)]

    await first.scrape_once()  # the first is back (started again): the second lets go
    clock.t += 1.0
    before = hits()
    await second.scrape_once()
    assert [h - b for h, b in zip(hits(), before, strict=True)] == [
        0 if n in mine else 1 for n in ids
    ]
    assert sum("owner back" in r.getMessage() for r in caplog.records) == len(mine)
    # its own samples of the second's nodes (round 1) aged, but the published ones did not
    assert not any("telemetry stale" in r.getMessage() for r in caplog.records)


def test_a_published_sample_crosses_a_fork_and_one_read_while_written_is_skipped(
    tmp_path: Path,
) -> None:
    table = LoadTable(workers=2, slots=8)
    reader = LoadShare(table, worker=0, lock_file=tmp_path / "slots.lock")
    assert reader.latest("http://a:8000") is None
    values: list[float | None] = [3.0, None, 0.25, *[float(i) for i in range(9)]]
    in_child(  # the sibling publishes
        lambda: LoadShare(table, worker=1, lock_file=tmp_path / "slots.lock").publish(
            "http://a:8000", 12.5, values
        )
    )
    assert reader.latest("http://a:8000") == (12.5, 1, tuple(values))
    slot = reader.slot("http://a:8000")
    assert slot is not None
    # the owner's last sample is kept apart: only the owner's publishing moves it
    assert reader.owner_published("http://a:8000") == (12.5 if slot % 2 == 1 else None)
    at = table.samples_at + slot * SAMPLE_FIELDS
    table.cells[at] += 1  # odd: a writer is midway
    assert reader.latest("http://a:8000") is None
    with pytest.raises(ValueError, match="at most"):
        reader.publish("http://a:8000", 1.0, [0.0] * (SAMPLE_VALUES + 1))
    reader.publish("http://a:8000", 13.0, [1.0])  # a writer that died midway does not block
    assert reader.latest("http://a:8000") == (13.0, 0, (1.0, *[None] * (SAMPLE_VALUES - 1)))


async def test_a_node_that_fails_its_scrapes_is_left_to_its_owner(
    pages: PageStarter,
    client: NodeClient,
    clock: ManualClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An owner whose scrapes fail is alive: the others do not scrape the failing node too (N
    scrapes of a node in trouble) nor call its owner silent; the owner logs the node."""
    servers = [await pages() for _ in range(4)]
    for server in servers:
        server.status = 500
    ids, (first, second) = _two_workers(servers, client, clock, tmp_path)
    await first.scrape_once()  # every node: nothing tried yet
    await second.scrape_once()  # its own: the first's failures say it is alive
    for _ in range(6):
        clock.t += 1.0
        before = [server.hits for server in servers]
        await first.scrape_once()
        await second.scrape_once()
        assert [s.hits - b for s, b in zip(servers, before, strict=True)] == [1, 1, 1, 1]
    assert not any("owner silent" in r.getMessage() for r in caplog.records)
    for node_id in ids:
        assert first.snapshot(node_id, now=clock.t) is None
        assert second.snapshot(node_id, now=clock.t) is None
