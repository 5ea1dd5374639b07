"""Scrapes every node's ``/metrics`` on a fixed cadence and keeps the latest sample per node.

Each tick starts a scrape of every node in the pool that has none in flight, waits for them
(at most one interval), records what came back, then calls :meth:`NodePool.notify` so waiting
requests are re-routed on the new numbers.  A node that hangs until ``scrape_timeout_s`` is
therefore skipped by the ticks in between instead of holding up the others: their samples stay
fresh.

A sample is stamped with the clock time its response arrived.  Rates come from two consecutive
good samples of the same node (the prefix-cache hit rate is Δhits / Δqueries, both counted in
tokens); a counter that went down means the node restarted, and that interval has no rate.
Older than ``stale_after_s``, a sample is unknown (``snapshot`` answers ``None``), never idle:
a node that stops answering is not a node with an empty queue.

A failed scrape (unreachable, an error status, a page that is not vLLM's) is counted and its
error kept for the admin listing; it never stops the loop.  State changes are logged: a node's
telemetry going stale or unavailable, and coming back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from dataclasses import dataclass

from meridian_service.clock import Clock
from policies.model import NodeId, Telemetry
from regional_agent.errors import UpstreamError
from regional_agent.nodes import Node, NodePool
from regional_agent.settings import TelemetrySettings
from regional_agent.telemetry.parse import Scrape, TelemetryError, parse
from regional_agent.upstream.client import NodeClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Rates:
    """What two consecutive samples of one node say about the interval between them."""

    interval_s: float
    prefix_hit_rate: float | None  # None: no prefix queries in the interval, or a reset
    preemptions_per_s: float | None
    ttft_mean_s: float | None  # mean time to first token of requests that got one


_NO_RATES = _Rates(interval_s=0.0, prefix_hit_rate=None, preemptions_per_s=None, ttft_mean_s=None)


class _NodeState:
    __slots__ = (
        "consecutive_failures",
        "failures_total",
        "fresh",
        "last_error",
        "last_error_s",
        "rates",
        "sample",
        "scrapes_total",
        "taken_s",
    )

    def __init__(self) -> None:
        self.sample: Scrape | None = None  # the last good one
        self.taken_s = 0.0  # clock time its response arrived
        self.rates = _NO_RATES
        self.consecutive_failures = 0
        self.failures_total = 0
        self.scrapes_total = 0
        self.last_error: str | None = None
        self.last_error_s: float | None = None
        self.fresh: bool | None = None  # as last logged; None before the first verdict

    def is_fresh(self, *, now: float, stale_after_s: float) -> bool:
        return self.sample is not None and now - self.taken_s <= stale_after_s


class Scraper:
    """The pool's telemetry source: ``pool.telemetry = scraper``; run ``scraper.run()``."""

    def __init__(
        self, *, pool: NodePool, client: NodeClient, settings: TelemetrySettings, clock: Clock
    ) -> None:
        self._pool = pool
        self._client = client
        self._settings = settings
        self._clock = clock
        self._states: dict[NodeId, _NodeState] = {}
        self._in_flight: dict[NodeId, asyncio.Task[None]] = {}
        self._bug: BaseException | None = None  # raised by a scrape other than a node's fault

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Scrape every ``scrape_interval_s`` until cancelled."""
        loop = asyncio.get_running_loop()
        interval_s = self._settings.scrape_interval_s
        try:
            while True:
                tick_end = loop.time() + interval_s
                started = self._start_scrapes()
                if started:
                    await asyncio.wait(started, timeout=interval_s)
                self._end_round()
                await asyncio.sleep(max(0.0, tick_end - loop.time()))
        finally:
            await self._cancel_in_flight()

    async def scrape_once(self) -> None:
        """One round: scrape every node (waiting for all of them), record, notify."""
        self._start_scrapes()
        try:
            if self._in_flight:
                await asyncio.wait(list(self._in_flight.values()))
        except asyncio.CancelledError:
            await self._cancel_in_flight()
            raise
        self._end_round()

    async def _cancel_in_flight(self) -> None:
        tasks = list(self._in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start_scrapes(self) -> list[asyncio.Task[None]]:
        started = []
        for node in self._pool:
            if node.node_id in self._in_flight:
                continue  # still waiting on a slow node: leave it be
            state = self._states.setdefault(node.node_id, _NodeState())
            task = asyncio.create_task(
                self._scrape(node, state), name=f"telemetry-scrape-{node.node_id}"
            )
            self._in_flight[node.node_id] = task
            task.add_done_callback(functools.partial(self._done, node.node_id))
            started.append(task)
        return started

    def _done(self, node_id: NodeId, task: asyncio.Task[None]) -> None:
        if self._in_flight.get(node_id) is task:
            del self._in_flight[node_id]
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._bug = exc  # not a node's fault (those are recorded): a bug, let it out

    async def _scrape(self, node: Node, state: _NodeState) -> None:
        state.scrapes_total += 1
        try:
            text = await self._client.get_text(
                node.node_id, node.endpoint("/metrics"), timeout_s=self._settings.scrape_timeout_s
            )
            sample = parse(text)
        except (UpstreamError, TelemetryError) as exc:
            state.consecutive_failures += 1
            state.failures_total += 1
            state.last_error = str(exc)
            state.last_error_s = self._clock.now()
            return
        now = self._clock.now()
        if state.sample is not None:
            state.rates = _rates(state.sample, sample, interval_s=now - state.taken_s)
        state.sample, state.taken_s = sample, now
        state.consecutive_failures = 0

    def _end_round(self) -> None:
        if self._bug is not None:
            raise self._bug
        for node_id in [n for n in self._states if n not in self._pool]:
            self.forget(node_id)
        now = self._clock.now()
        for node_id, state in self._states.items():
            self._log_change(node_id, state, now=now)
        self._pool.notify()

    def _log_change(self, node_id: NodeId, state: _NodeState, *, now: float) -> None:
        fresh = state.is_fresh(now=now, stale_after_s=self._settings.stale_after_s)
        if fresh == state.fresh or (state.sample is None and state.failures_total == 0):
            return
        before, state.fresh = state.fresh, fresh
        if fresh:
            level = logging.DEBUG if before is None else logging.INFO
            log.log(level, "telemetry fresh node=%s", node_id)
        elif state.sample is None:
            log.warning(
                "telemetry unavailable node=%s failures=%d error=%s",
                node_id,
                state.consecutive_failures,
                state.last_error,
            )
        else:
            log.warning(
                "telemetry stale node=%s age_s=%.2f failures=%d error=%s",
                node_id,
                now - state.taken_s,
                state.consecutive_failures,
                state.last_error,
            )

    # -- what others read ------------------------------------------------------------------------

    def snapshot(self, node_id: NodeId, *, now: float) -> Telemetry | None:
        """The node's latest telemetry, or ``None`` when never scraped or stale."""
        state = self._states.get(node_id)
        if state is None or state.sample is None:
            return None
        if not state.is_fresh(now=now, stale_after_s=self._settings.stale_after_s):
            return None
        sample = state.sample
        return Telemetry(
            age_s=max(0.0, now - state.taken_s),
            running=round(sample.running),
            waiting=round(sample.waiting),
            kv_util=min(1.0, max(0.0, sample.kv_util)),
            prefix_hit_rate=state.rates.prefix_hit_rate,
            block_size=sample.block_size,
        )

    def fresh_until(self, node_id: NodeId) -> float:
        """Until when :meth:`snapshot` keeps its sample (then it goes stale), barring a new
        scrape; forever for a node never scraped (a scrape round notifies the pool)."""
        state = self._states.get(node_id)
        if state is None or state.sample is None:
            return math.inf
        return state.taken_s + self._settings.stale_after_s

    def describe(self, node_id: NodeId, *, now: float | None = None) -> dict[str, object]:
        """The node's telemetry for the admin listing, JSON-ready."""
        now = self._clock.now() if now is None else now
        state = self._states.get(node_id) or _NodeState()
        sample, rates = state.sample, state.rates
        return {
            "stale": not state.is_fresh(now=now, stale_after_s=self._settings.stale_after_s),
            "age_s": None if sample is None else round(now - state.taken_s, 3),
            "scrapes_total": state.scrapes_total,
            "failures_total": state.failures_total,
            "consecutive_failures": state.consecutive_failures,
            "last_error": state.last_error,
            "last_error_age_s": (
                None if state.last_error_s is None else round(now - state.last_error_s, 3)
            ),
            "running": None if sample is None else sample.running,
            "waiting": None if sample is None else sample.waiting,
            "kv_util": None if sample is None else sample.kv_util,
            "prefix_hit_rate": rates.prefix_hit_rate,
            "preemptions_per_s": rates.preemptions_per_s,
            "ttft_mean_s": rates.ttft_mean_s,
            "rate_interval_s": rates.interval_s or None,
            "prefix_queries_total": None if sample is None else sample.prefix_queries,
            "prefix_hits_total": None if sample is None else sample.prefix_hits,
            "preemptions_total": None if sample is None else sample.preemptions,
            "block_size": None if sample is None else sample.block_size,
            "num_gpu_blocks": None if sample is None else sample.num_gpu_blocks,
        }

    def forget(self, node_id: NodeId) -> None:
        """Drop a node's samples and cancel its scrape in flight (it left the pool)."""
        self._states.pop(node_id, None)
        task = self._in_flight.pop(node_id, None)
        if task is not None:
            task.cancel()


def _rates(before: Scrape, after: Scrape, *, interval_s: float) -> _Rates:
    def delta(a: float | None, b: float | None) -> float | None:
        """``b - a`` of a counter; ``None`` when absent or reset (the node restarted)."""
        return None if a is None or b is None or b < a else b - a

    queries = delta(before.prefix_queries, after.prefix_queries)
    hits = delta(before.prefix_hits, after.prefix_hits)
    preemptions = delta(before.preemptions, after.preemptions)
    ttft_s = delta(before.ttft_sum_s, after.ttft_sum_s)
    ttft_n = delta(before.ttft_count, after.ttft_count)
    return _Rates(
        interval_s=interval_s,
        prefix_hit_rate=(min(1.0, hits / queries) if queries and hits is not None else None),
        preemptions_per_s=(
            preemptions / interval_s if preemptions is not None and interval_s > 0 else None
        ),
        ttft_mean_s=ttft_s / ttft_n if ttft_n and ttft_s is not None else None,
    )
