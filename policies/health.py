"""Node health: probe hysteresis, outlier ejection with probation, gray-failure detection and
slow start.  Pure: every call takes ``now`` (monotonic seconds); nothing here reads a clock.

One :class:`NodeHealth` per node combines two kinds of evidence:

* **Active probes** (``GET /health``): ``unhealthy_after`` consecutive failures make the node
  UNHEALTHY; ``healthy_after`` consecutive good probes bring it back (HAProxy's 3 down / 2 up,
  with our defaults 3 / 2).  A probe failure in between resets the run.
* **Passive outlier detection** (every upstream attempt the proxy makes): after
  ``eject_consecutive_errors`` consecutive failed requests (connect error, 5xx, timeout,
  garbage) the node is EJECTED for ``min(eject_base_s * n, eject_max_s)``, where ``n`` counts
  this ejection and the earlier ones not yet forgiven (Envoy: 5 consecutive 5xx, 30 s times the
  number of ejections).  One ejection is forgiven for every ``eject_max_s`` the node then stays
  HEALTHY.  When the time is up the node is on PROBATION (half-open: routing gives it one slot);
  the first success there makes it HEALTHY again, a failure ejects it again with ``n + 1``.

The states combine with this precedence::

    UNHEALTHY   probes fail; results are ignored meanwhile (the node gets no traffic anyway)
    EJECTED     an ejection's time is running
    PROBATION   the ejection's time is up and no request has succeeded since
    HEALTHY     otherwise

So a node that fails its probes while ejected comes back, once the probes pass, to whatever the
ejection cycle says (EJECTED while the time runs, else PROBATION): a good ``/health`` does not
prove that requests succeed, which is exactly what gray failures look like.

**Gray failure**: :func:`detect_latency_outliers` compares each node's median time to first
token over its last ``latency_window`` successes (once it has ``latency_min_samples`` of them)
with the median of its peers' medians; a node above ``latency_outlier_factor`` times that and
above ``latency_outlier_min_s`` is ejected as a "latency outlier".  It needs at least
``latency_min_peers`` peers with enough samples: with a single peer one cannot tell a slow node
from a different GPU type.  A node's samples are dropped when it leaves HEALTHY, so a node back
from an ejection is judged on fresh evidence only.

**The cap** (:func:`may_eject`): at most ``max(1, floor(max_ejected_fraction * pool size))``
nodes are EJECTED at once; at least one always may be (Envoy's behaviour).  A node that would be
ejected over the cap stays where it is (HEALTHY, or PROBATION with its single slot) and the
reason says so; it is ejected at its next failure once a place is free.  UNHEALTHY nodes do not
count against the cap: a failing ``/health`` is not an outlier verdict.

**Panic** (:func:`panic`, Envoy's panic threshold): when fewer than ``panic_threshold`` (default
0.5; 0 turns it off) of the active (not draining) nodes are HEALTHY — a node on PROBATION has one
slot and a trial request now and then, no capacity to count on —
health verdicts are more likely wrong than the fleet: slow probes on a loaded host, or one bad
signal shared by every node.  Then :func:`routing_views` routes over every active node as if it
were HEALTHY (full share, no probation limit) rather than squeezing all traffic onto the few left
or refusing it.  Draining nodes are never routed to, panic or not.  A node that is really dead
fails its requests, which the proxy retries on another node.

**Slow start** (:meth:`NodeHealth.slow_start`): after a node (re)becomes HEALTHY — from
UNHEALTHY or from PROBATION — its share of traffic ramps linearly from 0.1 to 1.0 over
``slow_start_s``.  A node that the agent meets healthy at start-up (``warm=True``) gets no ramp:
a restarted agent, or one of several agent replicas, must not throttle a fleet that has been
serving all along.  A node first met later (added to a running agent, ``warm=False``) ramps up
from the moment it is first tracked.  Nodes that are not HEALTHY report the floor, 0.1.

:class:`Tracker` holds every node of a pool and enforces the cap; the agent's
``health.HealthMonitor`` is a thin I/O shell around it.  Every change comes back as a
:class:`Change` with a short ``reason`` for the shell to log.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from policies.model import AdminState, Health, NodeId, NodeView

SLOW_START_FLOOR: Final = 0.1
_EPSILON: Final = 1e-9  # so that 0.29 of 100 nodes is 29, not 28.999999999999996 -> 28


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthConfig:
    """The policy's knobs.  The agent's ``HealthSettings`` carries the same names and defaults,
    except ``latency_window`` and ``latency_min_peers`` (policy defaults) and the shell-only
    probe cadence and drain timeout."""

    unhealthy_after: int = 3  # consecutive failed probes before UNHEALTHY
    healthy_after: int = 2  # consecutive good probes before HEALTHY again
    eject_consecutive_errors: int = 5  # consecutive failed requests that eject a node
    eject_base_s: float = 30.0  # the first ejection lasts this long; the n-th n times as long
    eject_max_s: float = 300.0  # longest ejection; also the time that forgives one ejection
    max_ejected_fraction: float = 0.5  # most of the pool EJECTED at once (at least one node)
    latency_outlier_factor: float = 3.0  # TTFT this many times the peers' median is an outlier
    latency_outlier_min_s: float = 0.5  # never an outlier at or below this TTFT (seconds)
    latency_min_samples: int = 20  # successes with a TTFT before a node is judged
    slow_start_s: float = 30.0  # ramp from 0.1 to 1.0 over this long; 0 turns slow start off
    latency_window: int = 64  # last successes kept per node (at least latency_min_samples)
    latency_min_peers: int = 2  # peers with enough samples needed to call a node slow
    panic_threshold: float = 0.5  # below this fraction routable: route to all (0 turns it off)

    def __post_init__(self) -> None:
        positive_ints = {
            "unhealthy_after": self.unhealthy_after,
            "healthy_after": self.healthy_after,
            "eject_consecutive_errors": self.eject_consecutive_errors,
            "latency_min_samples": self.latency_min_samples,
            "latency_window": self.latency_window,
            "latency_min_peers": self.latency_min_peers,
        }
        for name, value in positive_ints.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not (self.eject_base_s > 0 and self.eject_max_s > 0):
            raise ValueError("eject_base_s and eject_max_s must be > 0")
        if not 0 <= self.max_ejected_fraction <= 1:
            raise ValueError(
                f"max_ejected_fraction must be within 0..1, got {self.max_ejected_fraction}"
            )
        if not 0 <= self.panic_threshold <= 1:
            raise ValueError(f"panic_threshold must be within 0..1, got {self.panic_threshold}")
        if not self.latency_outlier_factor > 1:
            raise ValueError(
                f"latency_outlier_factor must be > 1, got {self.latency_outlier_factor}"
            )
        if self.latency_outlier_min_s < 0 or self.slow_start_s < 0:
            raise ValueError("latency_outlier_min_s and slow_start_s must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """What happened to a node and why.  ``before == after`` when an ejection was refused by
    the cap: nothing moved, but the shell should say so once.  ``cause`` of a node taken out of
    rotation: ``errors`` (consecutive failed requests), ``probation`` (a request failed on
    probation), ``latency`` (a latency outlier), ``probes`` (failed active probes); else ``""``."""

    node_id: NodeId
    before: Health
    after: Health
    reason: str
    at: float
    cause: str = ""

    @property
    def changed(self) -> bool:
        return self.before is not self.after


@dataclass(frozen=True, slots=True, kw_only=True)
class Outlier:
    """A node whose time to first token stands out from its peers'."""

    node_id: NodeId
    ttft_s: float
    peers_ttft_s: float
    reason: str


# -- pool-level functions ----------------------------------------------------------------------


def ejection_limit(pool_size: int, *, max_fraction: float) -> int:
    """Most nodes of a pool of ``pool_size`` that may be EJECTED at once: ``floor(fraction *
    size)``, but at least one (Envoy's rule), and none of an empty pool."""
    if pool_size <= 0:
        return 0
    return max(1, math.floor(max_fraction * pool_size + _EPSILON))


def may_eject(states: Collection[Health], *, max_fraction: float) -> bool:
    """Whether one more node of a pool whose nodes are in ``states`` may be EJECTED now."""
    ejected = sum(1 for s in states if s is Health.EJECTED)
    return ejected < ejection_limit(len(states), max_fraction=max_fraction)


@dataclass(frozen=True, slots=True, kw_only=True)
class Panic:
    """Whether the pool is in panic: ``routable`` of its ``eligible`` (active, not draining)
    nodes are HEALTHY, against ``threshold`` of them (PROBATION does not count: one slot)."""

    active: bool
    routable: int
    eligible: int
    threshold: float
    reason: str


def panic(nodes: Sequence[NodeView], *, threshold: float) -> Panic:
    """Panic when fewer than ``threshold`` of the active nodes are routable (see the module
    docstring); never with ``threshold`` 0 or without active nodes."""
    eligible = [n for n in nodes if n.admin is AdminState.ACTIVE]
    routable = sum(1 for n in eligible if n.health is Health.HEALTHY)
    share = routable / len(eligible) if eligible else 1.0
    active = bool(eligible) and threshold > 0 and share + _EPSILON < threshold
    verdict = "panic: routing to every active node as if healthy" if active else "no panic"
    reason = (
        f"{verdict} ({routable} of {len(eligible)} active nodes healthy, "
        f"{share:.0%} against a threshold of {threshold:.0%})"
    )
    return Panic(
        active=active,
        routable=routable,
        eligible=len(eligible),
        threshold=threshold,
        reason=reason,
    )


def routing_views(nodes: Sequence[NodeView], decision: Panic) -> list[NodeView]:
    """``nodes`` as routing should see them: unchanged without panic; in panic every active
    node that is not HEALTHY is shown HEALTHY with a full share (draining nodes unchanged)."""
    if not decision.active:
        return list(nodes)
    return [routing_view(n, decision) for n in nodes]


def routing_view(node: NodeView, decision: Panic) -> NodeView:
    """One node as :func:`routing_views` shows it."""
    if decision.active and node.admin is AdminState.ACTIVE and node.health is not Health.HEALTHY:
        return replace(node, health=Health.HEALTHY, slow_start=1.0)
    return node


def detect_latency_outliers(
    ttft_s: Mapping[NodeId, float], *, config: HealthConfig
) -> list[Outlier]:
    """Nodes whose typical time to first token is an outlier among their peers, worst first.

    ``ttft_s`` holds one typical TTFT per node (``NodeHealth.ttft_s()``), only for nodes with
    enough samples.  Each node is compared with the median of the *other* nodes' values, so a
    slow node does not raise its own bar.
    """
    found: list[tuple[float, Outlier]] = []
    for node_id, value in ttft_s.items():
        peers = [v for n, v in ttft_s.items() if n != node_id]
        if len(peers) < config.latency_min_peers:
            continue
        peer_median = statistics.median(peers)
        if value <= config.latency_outlier_min_s:
            continue
        if value <= config.latency_outlier_factor * peer_median:
            continue
        ratio = value / peer_median if peer_median > 0 else math.inf
        reason = (
            f"latency outlier: ttft {value:.3g} s is {ratio:.3g}x the peers' median "
            f"{peer_median:.3g} s (limit {config.latency_outlier_factor:g}x)"
        )
        found.append(
            (ratio, Outlier(node_id=node_id, ttft_s=value, peers_ttft_s=peer_median, reason=reason))
        )
    found.sort(key=lambda item: (-item[0], item[1].node_id))
    return [outlier for _, outlier in found]


# -- one node ----------------------------------------------------------------------------------

_SpareKind = Literal["errors", "latency"]


class NodeHealth:
    """One node's health state machine (see the module docstring for the rules)."""

    def __init__(
        self, node_id: NodeId, config: HealthConfig, *, now: float, warm: bool = True
    ) -> None:
        self.node_id = node_id
        self.config = config
        # active probes
        self._down = False
        self._probe_failures = 0
        self._probe_successes = 0
        # passive outlier detection
        self._failures = 0  # consecutive failed requests
        self._in_cycle = False  # EJECTED or PROBATION
        self._ejected_at: float | None = None
        self._ejected_until: float | None = None
        self._ejections = 0  # not yet forgiven
        self._forgive_from = now  # when the node last became HEALTHY
        self._spared: _SpareKind | None = None  # an ejection the cap refused, reported once
        window = max(config.latency_window, config.latency_min_samples)
        self._ttft: collections.deque[float] = collections.deque(maxlen=window)
        # what the shell has been told
        self._state = Health.HEALTHY
        self._since = now
        self._reason = "new node, healthy until probed" if warm else "new node, slow start"
        self._healthy_since: float | None = None if warm else now  # None: no slow start

    # -- queries -------------------------------------------------------------------------------

    def state(self, now: float) -> Health:
        if self._down:
            return Health.UNHEALTHY
        if self._in_cycle:
            if self._ejected_until is not None and now < self._ejected_until:
                return Health.EJECTED
            return Health.PROBATION
        return Health.HEALTHY

    def slow_start(self, now: float) -> float:
        """Share of full traffic, in (0, 1]: a linear ramp from 0.1 after (re)admission."""
        if self.state(now) is not Health.HEALTHY:
            return SLOW_START_FLOOR
        if self._healthy_since is None or self.config.slow_start_s <= 0:
            return 1.0
        progress = (now - self._healthy_since) / self.config.slow_start_s
        progress = min(1.0, max(0.0, progress))
        return SLOW_START_FLOOR + (1.0 - SLOW_START_FLOOR) * progress

    def steady_until(self, now: float) -> float:
        """Until when :meth:`state` and :meth:`slow_start` keep the values they have at ``now``
        if no result or probe comes in: the end of an ejection, ``now`` itself while a slow
        start ramps (it changes continuously), else forever.  What the pool caches a node's view
        by."""
        state = self.state(now)
        if state is Health.EJECTED and self._ejected_until is not None:
            return self._ejected_until
        if (
            state is Health.HEALTHY
            and self._healthy_since is not None
            and self.config.slow_start_s > 0
            and now < self._healthy_since + self.config.slow_start_s
        ):
            return now
        return math.inf

    def ttft_s(self) -> float | None:
        """Median time to first token over the window, or ``None`` with too few samples."""
        if len(self._ttft) < self.config.latency_min_samples:
            return None
        return statistics.median(self._ttft)

    def ejections(self, now: float) -> int:
        """Ejections not yet forgiven (one per ``eject_max_s`` spent HEALTHY)."""
        if self.state(now) is not Health.HEALTHY:
            return self._ejections
        forgiven = int(max(0.0, now - self._forgive_from) // self.config.eject_max_s)
        return max(0, self._ejections - forgiven)

    def describe(self, now: float) -> dict[str, object]:
        """For the admin listing: JSON-ready values only."""
        state = self.state(now)
        reason, since = self._reason, self._since
        if state is not self._state:  # a timed change the shell has not ticked yet
            reason, since = self._timed_reason(), self._ejected_until or now
        return {
            "state": state.value,
            "reason": reason,
            "since": since,
            "ejections": self.ejections(now),
            "ejected_until": self._ejected_until if self._in_cycle else None,
            "consecutive_failures": self._failures,
            "consecutive_probe_failures": self._probe_failures,
            "consecutive_probe_successes": self._probe_successes,
            "slow_start": self.slow_start(now),
            "ttft_samples": len(self._ttft),
            "ttft_median_s": statistics.median(self._ttft) if self._ttft else None,
        }

    # -- events --------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Change]:
        """Report the change time alone makes (an ejection's time is up: PROBATION)."""
        if self.state(now) is self._state:
            return []
        at = self._ejected_until if self._ejected_until is not None else now
        change = self._commit(now, self._timed_reason(), at=min(at, now))
        return [change] if change is not None else []

    def on_probe(self, ok: bool, *, now: float, detail: str = "") -> list[Change]:
        """An active probe's outcome; ``detail`` (e.g. "HTTP 503") goes into the reason."""
        changes = self.tick(now)
        if ok:
            self._probe_failures = 0
            self._probe_successes += 1
            if self._down and self._probe_successes >= self.config.healthy_after:
                self._down = False
                self._failures = 0
                self._add(changes, now, f"{self._probe_successes} consecutive good probes")
        else:
            self._probe_successes = 0
            self._probe_failures += 1
            if not self._down and self._probe_failures >= self.config.unhealthy_after:
                self._down = True
                self._failures = 0
                suffix = f" ({detail})" if detail else ""
                reason = f"{self._probe_failures} consecutive failed probes{suffix}"
                self._add(changes, now, reason, cause="probes")
        return changes

    def on_result(
        self, ok: bool, *, ttft_s: float | None, now: float, may_eject: bool = True
    ) -> list[Change]:
        """One upstream attempt's outcome.  ``may_eject``: whether the pool's cap has room
        (:func:`may_eject`); the :class:`Tracker` works it out."""
        changes = self.tick(now)
        state = self.state(now)
        if state in (Health.UNHEALTHY, Health.EJECTED):
            return changes  # a straggler sent before the node left; proves nothing now
        if ok:
            self._failures = 0
            if self._spared == "errors":
                self._spared = None
            if ttft_s is not None and ttft_s >= 0:
                self._ttft.append(ttft_s)
            if state is Health.PROBATION:
                self._in_cycle = False
                self._add(changes, now, "a request succeeded in probation")
            return changes
        self._failures += 1
        if state is Health.PROBATION:
            why = "a request failed in probation"
            self._eject(changes, now, why, "errors", may_eject, cause="probation")
        elif self._failures >= self.config.eject_consecutive_errors:
            reason = f"{self._failures} consecutive failed requests"
            self._eject(changes, now, reason, "errors", may_eject)
        return changes

    def on_latency(
        self, outlier: Outlier | None, *, now: float, may_eject: bool = True
    ) -> list[Change]:
        """The pool's latency verdict on this node: ``None`` when it is not an outlier."""
        changes = self.tick(now)
        if outlier is None:
            if self._spared == "latency":
                self._spared = None
            return changes
        if self.state(now) is Health.HEALTHY:
            self._eject(changes, now, outlier.reason, "latency", may_eject)
        return changes

    # -- internals -----------------------------------------------------------------------------

    def _eject(
        self,
        changes: list[Change],
        now: float,
        why: str,
        kind: _SpareKind,
        allowed: bool,
        *,
        cause: str | None = None,
    ) -> None:
        if not allowed:
            if self._spared is None:
                self._spared = kind
                self._reason = f"{why}; kept in: the ejection cap is reached"
                state = self.state(now)
                changes.append(
                    Change(
                        node_id=self.node_id,
                        before=state,
                        after=state,
                        reason=self._reason,
                        at=now,
                    )
                )
            return
        n = self.ejections(now) + 1
        duration_s = min(self.config.eject_base_s * n, self.config.eject_max_s)
        self._ejections = n
        self._in_cycle = True
        self._ejected_at = now
        self._ejected_until = now + duration_s
        self._failures = 0
        self._add(changes, now, f"{why}; ejection #{n} for {duration_s:g} s", cause=cause or kind)

    def _timed_reason(self) -> str:
        ejected_s = (self._ejected_until or 0.0) - (self._ejected_at or 0.0)
        return f"ejection over after {ejected_s:g} s: half-open, one request at a time"

    def _add(self, changes: list[Change], now: float, reason: str, *, cause: str = "") -> None:
        change = self._commit(now, reason, at=now, cause=cause)
        if change is not None:
            changes.append(change)
        else:
            self._reason = reason  # e.g. probes back while still ejected: keep the story current

    def _commit(self, now: float, reason: str, *, at: float, cause: str = "") -> Change | None:
        before, after = self._state, self.state(now)
        if after is before:
            return None
        self._state, self._since, self._reason = after, at, reason
        self._spared = None
        if after is not Health.HEALTHY:
            self._ttft.clear()  # judged again on fresh evidence only
        elif before is not Health.HEALTHY:
            self._healthy_since = at
            self._forgive_from = at
        return Change(
            node_id=self.node_id, before=before, after=after, reason=reason, at=at, cause=cause
        )


# -- a pool of nodes ---------------------------------------------------------------------------


class Tracker:
    """Every node of one pool: routes events to each node's :class:`NodeHealth` and enforces
    the pool-level ejection cap and the latency-outlier comparison."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._nodes: dict[NodeId, NodeHealth] = {}

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __iter__(self) -> Iterator[NodeHealth]:
        return iter(list(self._nodes.values()))

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, node_id: NodeId) -> NodeHealth | None:
        return self._nodes.get(node_id)

    def track(self, node_id: NodeId, *, now: float, warm: bool) -> NodeHealth:
        """The node's health, created on first sight (see the module docstring for ``warm``)."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = NodeHealth(node_id, self.config, now=now, warm=warm)
        return node

    def forget(self, node_id: NodeId) -> None:
        self._nodes.pop(node_id, None)

    def may_eject(self, *, now: float) -> bool:
        return may_eject(
            [n.state(now) for n in self._nodes.values()],
            max_fraction=self.config.max_ejected_fraction,
        )

    def ejected(self, *, now: float) -> int:
        return sum(1 for n in self._nodes.values() if n.state(now) is Health.EJECTED)

    def on_probe(self, node_id: NodeId, ok: bool, *, now: float, detail: str = "") -> list[Change]:
        node = self._nodes.get(node_id)
        return [] if node is None else node.on_probe(ok, now=now, detail=detail)

    def on_result(
        self, node_id: NodeId, ok: bool, *, ttft_s: float | None, now: float
    ) -> list[Change]:
        node = self._nodes.get(node_id)
        if node is None:
            return []
        allowed = ok or self.may_eject(now=now)  # the cap only matters for failures
        return node.on_result(ok, ttft_s=ttft_s, now=now, may_eject=allowed)

    def evaluate(self, *, now: float) -> list[Change]:
        """Timed changes of every node, then the latency-outlier comparison, worst first."""
        changes: list[Change] = []
        for node in self._nodes.values():
            changes += node.tick(now)
        typical = {
            node.node_id: value
            for node in self._nodes.values()
            if node.state(now) is Health.HEALTHY and (value := node.ttft_s()) is not None
        }
        outliers = {o.node_id: o for o in detect_latency_outliers(typical, config=self.config)}
        for outlier in outliers.values():  # worst first: the cap keeps the milder ones in
            node = self._nodes[outlier.node_id]
            changes += node.on_latency(outlier, now=now, may_eject=self.may_eject(now=now))
        for node in self._nodes.values():
            if node.node_id not in outliers:
                changes += node.on_latency(None, now=now)
        return changes
