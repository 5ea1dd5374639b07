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

With several workers (``share``, the workers' shared table), a node is scraped by one of them,
not by each: every scrape a worker makes is published, and a worker scrapes a node it does not
own only while the owner has neither published a sample nor failed a scrape for two intervals
and a timeout (it died, or hangs), so each node renders its page about once an interval
whatever the workers; a node that does not answer is the owner's to log.  A worker reads the
fresher of its own sample and the published one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from meridian_service.clock import Clock
from policies.model import NodeId, Telemetry
from regional_agent.errors import UpstreamError
from regional_agent.nodes import Node, NodePool, SilentOwners
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
        "values",
    )

    def __init__(self) -> None:
        self.sample: Scrape | None = None  # the last good one
        self.taken_s = 0.0  # clock time its response arrived
        self.values: tuple[float | None, ...] = ()  # it and its rates, as PUBLISHED lists them
        self.rates = _NO_RATES
        self.consecutive_failures = 0
        self.failures_total = 0
        self.scrapes_total = 0
        self.last_error: str | None = None
        self.last_error_s: float | None = None
        self.fresh: bool | None = None  # as last logged; None before the first verdict

    def is_fresh(self, *, now: float, stale_after_s: float) -> bool:
        return self.sample is not None and now - self.taken_s <= stale_after_s


class SharedSamples(Protocol):
    """The workers' published samples (``workers.shared.LoadShare``): numbers, None where
    not known; what they are is :data:`PUBLISHED`."""

    @property
    def worker(self) -> int: ...

    def owns(self, node_id: str) -> bool: ...

    def owner_published(self, node_id: str) -> float | None: ...

    def tried(self, node_id: str, at_s: float) -> None: ...

    def publish(self, node_id: str, taken_s: float, values: Sequence[float | None]) -> None: ...

    def latest(self, node_id: str) -> tuple[float, int, tuple[float | None, ...]] | None: ...


PUBLISHED = (
    "running",
    "waiting",
    "kv_util",
    "prefix_hit_rate",
    "preemptions_per_s",
    "ttft_mean_s",
    "rate_interval_s",
    "prefix_queries_total",
    "prefix_hits_total",
    "preemptions_total",
    "block_size",
    "num_gpu_blocks",
)
"""What a published sample carries: the admin listing's numbers of one scrape, in this order."""
_BLOCK_SIZE = PUBLISHED.index("block_size")
# (when the sample was taken, the worker that took it (None: this one), its PUBLISHED values)
_Latest = tuple[float, int | None, tuple[float | None, ...]]


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
        self.share: SharedSamples | None = None  # with several workers (module docstring)
        self._silent = SilentOwners(log, what="telemetry", does="scrapes")

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
            if self.share is not None and self._sibling_scrapes(node.node_id):
                continue
            state = self._states.setdefault(node.node_id, _NodeState())
            task = asyncio.create_task(
                self._scrape(node, state), name=f"telemetry-scrape-{node.node_id}"
            )
            self._in_flight[node.node_id] = task
            task.add_done_callback(functools.partial(self._done, node.node_id))
            started.append(task)
        return started

    def _sibling_scrapes(self, node_id: NodeId) -> bool:
        """Another worker owns ``node_id`` and published a sample of it lately (at the start,
        before the owner's first, each worker scrapes it).  This worker logs when it starts to
        scrape a node for a silent owner, and when the owner is back."""
        assert self.share is not None
        settings = self._settings
        return not self._silent.do_it_here(
            node_id,
            owned=self.share.owns(node_id),
            owner_last_s=self.share.owner_published(node_id),
            now=self._clock.now(),
            limit_s=2 * settings.scrape_interval_s + settings.scrape_timeout_s,
        )

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
            if self.share is not None:  # the owner is alive, the node is not answering
                self.share.tried(node.node_id, state.last_error_s)
            return
        now = self._clock.now()
        if state.sample is not None:
            state.rates = _rates(state.sample, sample, interval_s=now - state.taken_s)
        state.sample, state.taken_s = sample, now
        state.values = _values(state)
        state.consecutive_failures = 0
        if self.share is not None:
            self.share.publish(node.node_id, now, state.values)

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
        latest = self._latest(node_id)  # with workers, a sibling's sample counts too
        taken_s = None if latest is None else latest[0]
        fresh = taken_s is not None and now - taken_s <= self._settings.stale_after_s
        if fresh == state.fresh or (taken_s is None and state.failures_total == 0):
            return
        before, state.fresh = state.fresh, fresh
        if fresh:
            level = logging.DEBUG if before is None else logging.INFO
            log.log(level, "telemetry fresh node=%s", node_id)
        elif taken_s is None:
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
                now - taken_s,
                state.consecutive_failures,
                state.last_error,
            )

    # -- what others read ------------------------------------------------------------------------

    def snapshot(self, node_id: NodeId, *, now: float) -> Telemetry | None:
        """The node's latest telemetry, or ``None`` when never scraped or stale."""
        latest = self._latest(node_id)
        if latest is None or now - latest[0] > self._settings.stale_after_s:
            return None
        taken_s, _, values = latest
        running, waiting, kv_util, hit_rate = values[:4]
        block_size = values[_BLOCK_SIZE]
        return Telemetry(
            age_s=max(0.0, now - taken_s),
            running=round(running or 0.0),
            waiting=round(waiting or 0.0),
            kv_util=min(1.0, max(0.0, kv_util or 0.0)),
            prefix_hit_rate=hit_rate,
            block_size=None if block_size is None else round(block_size),
        )

    def fresh_until(self, node_id: NodeId) -> float:
        """Until when :meth:`snapshot` keeps its sample (then it goes stale), barring a new
        scrape; forever for a node never scraped (a scrape round notifies the pool)."""
        latest = self._latest(node_id)
        if latest is None:
            return math.inf
        return latest[0] + self._settings.stale_after_s

    def _latest(self, node_id: NodeId) -> _Latest | None:
        """The fresher of this worker's own sample and the one the workers published."""
        state = self._states.get(node_id)
        own: _Latest | None = None
        if state is not None and state.sample is not None:
            own = (state.taken_s, None, state.values)
        if self.share is None:
            return own
        published = self.share.latest(node_id)
        if published is None:
            return own
        if own is None:
            return published  # a sibling's, or this worker's before it was started again
        # this worker's own sample, published (its stamp rounded to the µs), is not a sibling's
        if published[1] == self.share.worker or own[0] >= published[0]:
            return own
        return published

    def describe(self, node_id: NodeId, *, now: float | None = None) -> dict[str, object]:
        """The node's telemetry for the admin listing, JSON-ready: its latest sample, this
        worker's own or (``scraped_by``) a sibling's, and this worker's own scrapes."""
        now = self._clock.now() if now is None else now
        state = self._states.get(node_id) or _NodeState()
        latest = self._latest(node_id)
        taken_s, worker, values = latest if latest is not None else (None, None, None)
        return {
            "stale": taken_s is None or now - taken_s > self._settings.stale_after_s,
            "age_s": None if taken_s is None else round(now - taken_s, 3),
            "scraped_by": None if worker is None else f"w{worker}",
            "scrapes_total": state.scrapes_total,
            "failures_total": state.failures_total,
            "consecutive_failures": state.consecutive_failures,
            "last_error": state.last_error,
            "last_error_age_s": (
                None if state.last_error_s is None else round(now - state.last_error_s, 3)
            ),
            **{
                name: (None if values is None else _as_listed(name, values[i]))
                for i, name in enumerate(PUBLISHED)
            },
        }

    def forget(self, node_id: NodeId) -> None:
        """Drop a node's samples and cancel its scrape in flight (it left the pool)."""
        self._states.pop(node_id, None)
        self._silent.forget(node_id)
        task = self._in_flight.pop(node_id, None)
        if task is not None:
            task.cancel()


def _values(state: _NodeState) -> tuple[float | None, ...]:
    """``state``'s sample (it has one) and rates as :data:`PUBLISHED` lists them."""
    sample, rates = state.sample, state.rates
    assert sample is not None
    return (
        sample.running,
        sample.waiting,
        sample.kv_util,
        rates.prefix_hit_rate,
        rates.preemptions_per_s,
        rates.ttft_mean_s,
        rates.interval_s or None,
        sample.prefix_queries,
        sample.prefix_hits,
        sample.preemptions,
        sample.block_size,
        sample.num_gpu_blocks,
    )


def _as_listed(name: str, value: float | None) -> float | int | None:
    """A published value as the admin listing shows it: the block counts as integers."""
    if value is not None and name in ("block_size", "num_gpu_blocks"):
        return round(value)
    return value


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
