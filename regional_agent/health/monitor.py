"""The agent's health shell: probes every node's ``/health``, takes every upstream attempt's
outcome from the proxy, and answers ``NodePool``'s health questions from the pure state machine
in ``policies.health``.

* :meth:`HealthMonitor.run` probes all nodes concurrently every ``probe_interval_s``
  (:meth:`~HealthMonitor.probe_once` is one round); a probe is good when ``/health`` answers
  2xx within ``probe_timeout_s`` and, with ``probe_generate``, a one-token completion of the
  node's first model finishes within ``probe_generate_timeout_s`` too: an engine that stopped
  stepping still answers ``/health`` (vLLM's is its API server's), so only a generation
  proves it works.  After the probes, each round applies the changes time alone
  makes (an ejection's time is up: PROBATION) and the pool's latency-outlier comparison.
* :meth:`HealthMonitor.record` is called by the proxy for every attempt: ok with its time to
  first token (``None`` when not streamed), or failed (connect error, 5xx, timeout, garbage).
* Every change of state is logged once with its reason (``node=... state=ejected reason=...``)
  and wakes waiting requests through :meth:`NodePool.notify`.  An ejection that the pool's cap
  refuses is logged once as well.  :attr:`HealthMonitor.ejections` counts the nodes taken out
  of rotation (healthy or on probation to ejected or unhealthy) by cause, for ``/metrics``.

With several workers (``share``, the workers' shared table), a node is probed by one of them,
not by each: the worker that owns it (as for its scrapes, ``telemetry.scraper``) probes it and
publishes the outcome, and every other worker applies, at each of its own rounds, the newest
published probe it has not applied yet, as if it had sent it (its detail names the worker that
did), and between its rounds every :data:`SIBLING_PROBES_S`. A worker probes a node it does not
own only while the owner has published no probe of it for two intervals and a probe's time limit
(it died, or hangs), and logs when it starts (``health owner silent``) and stops (``health owner
back``). So each node answers about one probe an interval whatever the workers (with
``probe_generate``, one generation, not N), and a worker that does not own a node learns a
probe's outcome at most ``SIBLING_PROBES_S`` after the owner. A worker's own requests' outcomes
(:meth:`HealthMonitor.record`) stay its own.

Nodes met before the first probe round has finished are taken as warm (no slow start: a fresh
agent must not throttle a fleet that has been serving); nodes added later ramp up, unless whoever
adds one says otherwise (:meth:`HealthMonitor.meet`: DNS discovery's first answer is the fleet
as it was serving).  A node the monitor has not met yet is HEALTHY until probed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
from typing import Protocol

from meridian_service.clock import Clock
from policies import health
from policies.model import Health, NodeId
from regional_agent.errors import UpstreamError
from regional_agent.nodes import Node, NodePool, SilentOwners
from regional_agent.settings import HealthSettings
from regional_agent.upstream import NodeClient, Timeouts

log = logging.getLogger(__name__)

_BAD_NEWS = (Health.UNHEALTHY, Health.EJECTED)
SIBLING_PROBES_S = 0.1  # with workers: how often a worker applies its siblings' probes


class SharedProbes(Protocol):
    """The workers' published probes (``workers.shared.LoadShare``)."""

    @property
    def worker(self) -> int: ...

    def owns(self, node_id: str) -> bool: ...

    def owner_probed(self, node_id: str) -> float | None: ...

    def publish_probe(self, node_id: str, at_s: float, ok: bool, detail: str) -> None: ...

    def probe(self, node_id: str) -> tuple[float, int, bool, str] | None: ...


def config_from(settings: HealthSettings) -> health.HealthConfig:
    """The policy's view of the agent's health settings."""
    return health.HealthConfig(
        unhealthy_after=settings.unhealthy_after,
        healthy_after=settings.healthy_after,
        eject_consecutive_errors=settings.eject_consecutive_errors,
        eject_base_s=settings.eject_base_s,
        eject_max_s=settings.eject_max_s,
        max_ejected_fraction=settings.max_ejected_fraction,
        latency_outlier_factor=settings.latency_outlier_factor,
        latency_outlier_min_s=settings.latency_outlier_min_s,
        latency_min_samples=settings.latency_min_samples,
        slow_start_s=settings.slow_start_s,
        panic_threshold=settings.panic_threshold,
    )


class HealthMonitor:
    """The pool's health source: ``pool.health = monitor``; run ``monitor.run()``."""

    def __init__(
        self, *, pool: NodePool, client: NodeClient, settings: HealthSettings, clock: Clock
    ) -> None:
        self._pool = pool
        self._client = client
        self._settings = settings
        self._clock = clock
        self._tracker = health.Tracker(config_from(settings))
        self._started = False  # True once the first probe round is done
        # nodes taken out of rotation, by cause (errors, probation, latency, probes)
        self.ejections: collections.Counter[str] = collections.Counter()
        self.share: SharedProbes | None = None  # with several workers (module docstring)
        self._applied: dict[NodeId, float] = {}  # node -> the sibling's probe applied last
        self._silent = SilentOwners(log, what="health", does="probes")
        self.probes_sent: collections.Counter[NodeId] = collections.Counter()  # this worker's
        self._sync(now=clock.now())

    # -- loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        interval_s = self._settings.probe_interval_s
        while True:
            began = self._clock.now()
            await self.probe_once()
            # until the next round, the siblings' probes as they come (module docstring)
            while (left_s := interval_s - (self._clock.now() - began)) > 0:
                await asyncio.sleep(min(left_s, SIBLING_PROBES_S) if self.share else left_s)
                if self.share is not None:
                    self.apply_sibling_probes()

    def apply_sibling_probes(self) -> None:
        """Apply the siblings' newest probes of the nodes this worker does not probe itself,
        those it has not applied yet (with workers; between rounds, every
        :data:`SIBLING_PROBES_S`)."""
        share = self.share
        if share is None:
            return
        now = self._clock.now()
        changes: list[health.Change] = []
        for node in self._pool:
            node_id = node.node_id
            if node_id in self._tracker and not share.owns(node_id):
                changes += self._apply_sibling_probe(share, node_id, now=now)
        self._apply(changes)

    async def probe_once(self) -> None:
        """One round: probe every node concurrently (with workers, those this one probes for
        all), apply the siblings' probes of the others, then timed and pool-wide verdicts."""
        nodes = list(self._pool)
        share = self.share
        mine = [n for n in nodes if share is None or self._probes_itself(share, n.node_id)]
        outcomes = await asyncio.gather(*(self._probe(node) for node in mine))
        now = self._clock.now()
        self._sync(now=now)
        changes: list[health.Change] = []
        for node, (ok, detail) in zip(mine, outcomes, strict=True):
            if node.node_id not in self._tracker:
                continue  # removed while its probe was in flight
            self.probes_sent[node.node_id] += 1
            if share is not None:
                share.publish_probe(node.node_id, now, ok, detail)
            changes += self._tracker.on_probe(node.node_id, ok, now=now, detail=detail)
        if share is not None:
            probed = {n.node_id for n in mine}
            for node in nodes:
                if node.node_id not in probed and node.node_id in self._tracker:
                    changes += self._apply_sibling_probe(share, node.node_id, now=now)
        changes += self._tracker.evaluate(now=now)
        self._started = True
        self._apply(changes)

    def _probes_itself(self, share: SharedProbes, node_id: NodeId) -> bool:
        """This worker owns ``node_id``, or its owner has published no probe of it lately (at
        the start too, before the owner's first); logs when that starts and stops."""
        settings = self._settings
        limit_s = settings.probe_timeout_s  # a probe's time limit
        if settings.probe_generate:
            limit_s += settings.probe_generate_timeout_s + 1.0
        return self._silent.do_it_here(
            node_id,
            owned=share.owns(node_id),
            owner_last_s=share.owner_probed(node_id),
            now=self._clock.now(),
            limit_s=2 * settings.probe_interval_s + limit_s,
        )

    def _apply_sibling_probe(
        self, share: SharedProbes, node_id: NodeId, *, now: float
    ) -> list[health.Change]:
        """The newest probe of ``node_id`` a sibling published and this worker has not
        applied yet, applied as if this worker had sent it."""
        published = share.probe(node_id)
        if published is None:
            return []
        at_s, worker, ok, detail = published
        if worker == share.worker or at_s <= self._applied.get(node_id, -math.inf):
            return []  # its own (sent while it covered), or applied already
        self._applied[node_id] = at_s
        return self._tracker.on_probe(node_id, ok, now=now, detail=f"{detail}, probed by w{worker}")

    async def _probe(self, node: Node) -> tuple[bool, str]:
        try:
            status = await self._client.probe(
                node.node_id, node.endpoint("/health"), timeout_s=self._settings.probe_timeout_s
            )
        except UpstreamError as exc:
            return False, f"unreachable: {exc.message}"
        if not 200 <= status < 300:
            return False, f"HTTP {status}"
        if self._settings.probe_generate and node.models:
            return await self._generate(node)
        return True, f"HTTP {status}"

    async def _generate(self, node: Node) -> tuple[bool, str]:
        """A one-token completion of the node's first model, within its own time limit."""
        limit_s = self._settings.probe_generate_timeout_s
        body = {"model": min(node.models), "prompt": "ping", "max_tokens": 1, "stream": False}
        timeouts = Timeouts(
            first_byte_s=limit_s, gap_s=limit_s,
            first_byte_name="health.probe_generate_timeout_s",
            gap_name="health.probe_generate_timeout_s",
        )  # fmt: skip
        try:
            async with asyncio.timeout(limit_s + 1.0):
                async with self._client.post(
                    node.node_id,
                    node.endpoint("/v1/completions"),
                    body=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", "X-Request-ID": "health-probe"},
                    timeouts=timeouts,
                ) as response:
                    await response.read()
        except UpstreamError as exc:
            return False, f"generation probe failed: {exc.message}"
        except TimeoutError:
            return False, f"generation probe: no answer within {limit_s:g} s"
        return True, "generation probe ok"

    # -- what the proxy reports ----------------------------------------------------------------

    def record(self, node_id: NodeId, *, ok: bool, ttft_s: float | None, now: float) -> None:
        """One upstream attempt on ``node_id``: ok (with its time to first token when streamed)
        or failed (connect error, 5xx, timeout, garbage)."""
        if node_id not in self._pool:
            return  # removed while the request was in flight
        if ok:
            self._track(node_id, now=now)
        else:
            self._sync(now=now)  # the ejection cap counts the whole pool
        self._apply(self._tracker.on_result(node_id, ok, ttft_s=ttft_s, now=now))

    # -- NodePool's questions ------------------------------------------------------------------

    def state(self, node_id: NodeId, *, now: float) -> Health:
        node = self._known(node_id, now=now)
        return Health.HEALTHY if node is None else node.state(now)

    def slow_start(self, node_id: NodeId, *, now: float) -> float:
        node = self._known(node_id, now=now)
        return 1.0 if node is None else node.slow_start(now)

    def steady_until(self, node_id: NodeId, *, now: float) -> float:
        """Until when :meth:`state` and :meth:`slow_start` stay as they are now, barring news
        (``policies.health.NodeHealth.steady_until``)."""
        node = self._known(node_id, now=now)
        return math.inf if node is None else node.steady_until(now)

    def describe(self, node_id: NodeId, *, now: float) -> dict[str, object]:
        """State, reason, since, ejections, ejected_until, consecutive failures, TTFT stats, and
        the probes this worker sent the node (with workers, its owner sends them for all)."""
        node = self._known(node_id, now=now)
        sent = self.probes_sent.get(node_id, 0)
        if node is None:
            return {
                "state": Health.HEALTHY.value,
                "reason": "not tracked: healthy until probed",
                "since": None,
                "ejections": 0,
                "ejected_until": None,
                "consecutive_failures": 0,
                "consecutive_probe_failures": 0,
                "consecutive_probe_successes": 0,
                "slow_start": 1.0,
                "ttft_samples": 0,
                "ttft_median_s": None,
                "probes_sent": sent,
            }
        return {**node.describe(now), "probes_sent": sent}

    def forget(self, node_id: NodeId) -> None:
        self._tracker.forget(node_id)
        self._applied.pop(node_id, None)
        self.probes_sent.pop(node_id, None)
        self._silent.forget(node_id)

    def meet(self, node_id: NodeId, *, warm: bool) -> None:
        """Track a node about to join the pool as warm (full traffic at once) or not (slow
        start), whatever the first probe round has done; call it just before ``pool.add``.  A
        node already tracked keeps its state."""
        self._tracker.track(node_id, now=self._clock.now(), warm=warm)

    # -- internals -----------------------------------------------------------------------------

    def _track(self, node_id: NodeId, *, now: float) -> health.NodeHealth:
        return self._tracker.track(node_id, now=now, warm=not self._started)

    def _sync(self, *, now: float) -> None:
        """Track exactly the pool's nodes (a node removed without ``forget`` is dropped)."""
        for tracked in self._tracker:
            if tracked.node_id not in self._pool:
                self.forget(tracked.node_id)
        for node in self._pool:
            self._track(node.node_id, now=now)

    def _known(self, node_id: NodeId, *, now: float) -> health.NodeHealth | None:
        node = self._tracker.get(node_id)
        if node is None and node_id in self._pool:
            node = self._track(node_id, now=now)
        return node

    def _apply(self, changes: list[health.Change]) -> None:
        moved = False
        for change in changes:
            if change.changed:
                moved = True
                if change.after in _BAD_NEWS and change.before not in _BAD_NEWS:
                    self.ejections[change.cause or "other"] += 1
                level = logging.WARNING if change.after in _BAD_NEWS else logging.INFO
                log.log(
                    level,
                    'node health changed node=%s state=%s previous=%s reason="%s"',
                    change.node_id,
                    change.after.value,
                    change.before.value,
                    change.reason,
                )
            else:
                log.warning(
                    'node ejection refused node=%s state=%s reason="%s"',
                    change.node_id,
                    change.after.value,
                    change.reason,
                )
        if moved:
            self._pool.notify()
