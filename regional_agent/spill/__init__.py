"""Spill-over: which other regions this agent may forward a request to, from the controller's
plan (docs/agent.md "Spill-over").

The publisher follows ``controller/plan`` and hands each new plan to :meth:`Spill.update`; the
proxy asks :meth:`Spill.choose` for targets when a request would wait too long here (``queue``),
the queue is full (``full``), no node here serves its model (``model``) or none can take it
(``unavailable``), and tells :meth:`Spill.record` how each forward went.  The choice itself is
``policies.spill.rank``'s (residency, model, service, latency budget, expected wait).

A region that fails forwards is judged like a node: ``policies.health.NodeHealth``'s outlier
ejection, ``spill.eject_consecutive_errors`` failures in a row eject it for
``spill.eject_base_s`` (times the ejections not yet forgiven, at most ``spill.eject_max_s``),
then one trial request (probation) decides.  Until the first plan arrives there is nowhere to
spill to, and the agent serves as if spill-over were off.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meridian_wire.models import FleetPlan
from policies import health, spill
from policies.model import Health, NodeId
from regional_agent.errors import BadRequest
from regional_agent.settings import RegionSettings, SpillSettings

log = logging.getLogger(__name__)

HEADER = "X-Meridian-Spilled-From"  # on a forwarded request: the region it came from
RESIDENCY_HEADER = "X-Meridian-Residency"  # tags a request needs besides its region's
SPILLED_TO = "X-Meridian-Spilled-To"  # on the answer to the client: the region that served it
_TAG = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")


@dataclass(frozen=True, slots=True)
class _Known:
    """One region as the last plan described it (its age is worked out when asked)."""

    region: spill.Region
    updated_at: float


class Spill:
    def __init__(
        self,
        *,
        settings: SpillSettings,
        region: RegionSettings,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.home = region.id or ""
        self.residency = frozenset(region.residency)
        self._wall = wall
        self._known: dict[str, _Known] = {}
        self._measured: dict[str, float] = {}
        self._home_rate = 0.0  # this region's finished requests per second, as published
        self.plan_window = -1  # the window of the plan in force; -1: none yet
        self._config = health.HealthConfig(
            eject_consecutive_errors=settings.eject_consecutive_errors,
            eject_base_s=settings.eject_base_s,
            eject_max_s=settings.eject_max_s,
            max_ejected_fraction=1.0,  # a region is judged alone: every one may be ejected
        )
        self._health: dict[str, health.NodeHealth] = {}

    # -- the plan ----------------------------------------------------------------------------

    def update(self, plan: FleetPlan) -> None:
        """Take a new plan: every region's status, service, reachability and round trips."""
        in_service = {
            region for shares in plan.serving.values() for region, share in shares.items() if share
        }
        unreachable = set(plan.unreachable)
        known = {}
        for name, status in plan.last_status.items():
            region = spill.Region(
                name=name,
                residency=frozenset(status.residency),
                endpoints=tuple(status.endpoints),
                models=None if status.models is None else dict(status.models),
                in_service=name in in_service,
                reachable=name not in unreachable,
                admin=status.admin,
                nodes_healthy=status.nodes_healthy,
                queue_depth=status.load.queue_depth,
                requests_per_s=status.load.requests_per_s,
            )
            known[name] = _Known(region=region, updated_at=status.updated_at)
        self._known = known
        home = plan.last_status.get(self.home)
        self._home_rate = 0.0 if home is None else home.load.requests_per_s
        measured: dict[str, float] = {}
        for origin, row in plan.measured_latency_ms.items():  # either direction will do
            for target, ms in row.items():
                if origin == self.home:
                    measured[target] = ms
                elif target == self.home:
                    measured.setdefault(origin, ms)
        self._measured = measured
        if plan.window != self.plan_window:
            log.debug("spill-over plan window=%d regions=%d", plan.window, len(known))
        self.plan_window = plan.window

    def knows(self, region: str) -> bool:
        """Whether ``region`` is in the last plan (a label safe for a metric)."""
        return region in self._known

    def latency_ms(self) -> dict[str, float]:
        """Round trips from here: configured (``spill.latency_ms``) over measured."""
        return {**self._measured, **self.settings.latency_ms}

    # -- choosing ----------------------------------------------------------------------------

    def wants(self, depth: int) -> bool:
        """Whether a request that finds ``depth`` of its model waiting should look elsewhere."""
        return bool(self._known) and depth >= self.settings.queue_depth

    def home_wait_ms(self, depth: int) -> float:
        """The wait a request expects here behind ``depth`` others, by this region's rate."""
        if depth <= 0:
            return 0.0
        if self._home_rate <= 0:
            return depth * spill.UNKNOWN_WAIT_MS
        return 1000.0 * depth / self._home_rate

    def choose(
        self, model: str, *, tags: frozenset[str], home_wait_ms: float, now: float
    ) -> spill.Choice:
        """Targets for a request of ``model`` needing ``tags`` besides the region's, best
        first; ``now`` is the agent's monotonic clock (ejections run on it)."""
        wall = self._wall()
        regions = [
            dataclasses.replace(k.region, age_s=max(0.0, wall - k.updated_at))
            for k in self._known.values()
        ]
        ejected = frozenset(
            name for name, h in self._health.items() if h.state(now) is Health.EJECTED
        )
        return spill.rank(
            regions,
            home=self.home,
            model=model,
            needs=spill.needs(self.residency, tags),
            latency_ms=self.latency_ms(),
            budget_ms=self.settings.latency_budget_ms,
            max_age_s=self.settings.status_max_age_s,
            home_wait_ms=home_wait_ms,
            exclude=ejected,
        )

    def record(self, region: str, *, ok: bool, now: float) -> None:
        """One forward's outcome: a failure counts against the region like a node's."""
        tracked = self._health.get(region)
        if tracked is None:
            tracked = health.NodeHealth(NodeId(region), self._config, now=now)
            self._health[region] = tracked
        for change in tracked.on_result(ok, ttft_s=None, now=now):
            if change.changed:
                log.warning(
                    "spill-over region=%s state=%s reason=%s",
                    region,
                    change.after.value,
                    change.reason,
                )

    def states(self, now: float) -> Mapping[str, str]:
        """Each region forwarded to so far and its state (healthy, ejected, probation)."""
        return {name: h.state(now).value for name, h in sorted(self._health.items())}


def request_tags(header: str | None) -> frozenset[str]:
    """The residency tags ``X-Meridian-Residency`` asks for (comma-separated), or 400."""
    if header is None or not header.strip():
        return frozenset()
    tags = [t.strip() for t in header.split(",") if t.strip()]
    bad = [t for t in tags if not _TAG.match(t)]
    if bad:
        raise BadRequest(
            f"the {RESIDENCY_HEADER} header must list residency tags (1-32 lowercase letters, "
            f"digits and dashes, comma-separated), got {bad[0][:40]!r}"
        )
    return frozenset(tags)


__all__ = ["HEADER", "RESIDENCY_HEADER", "SPILLED_TO", "Spill", "request_tags"]
