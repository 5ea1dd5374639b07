"""The region's node pool: each node's address, capacity, admin state and the agent's own
accounting of what it has in flight there.

Health and telemetry live with their owners (``health.HealthMonitor``,
``telemetry.Scraper``); :meth:`NodePool.views` joins all three into the frozen
``policies.model.NodeView`` snapshots that routing decides over.  The views are kept between
requests, not rebuilt for each: a node's view is rebuilt when the agent's accounting of it moves
(a dispatch, a first token, a completion: at once, or with sibling workers at the next read of
the views, with the nodes the siblings moved, :meth:`NodePool._moved_here`), every view when
:meth:`NodePool.notify` says something else changed (a scrape round, a health change, an admin
action, membership), and a view whose health or telemetry changes by itself with time (an
ejection that ends, a slow start that ramps, a sample that goes stale) when that time comes.
A view's ``telemetry.age_s`` is the sample's age when the view was built.  When fewer than
``panic_threshold`` of the active nodes are healthy, the pool is in panic
(``policies.health.panic``) and :meth:`NodePool.views` shows every active node as healthy;
:meth:`NodePool.observed` and :meth:`NodePool.serving` always tell the observed health.  Entering
and leaving panic is logged once each, as a WARNING.  Whoever changes something a
waiting request could be routed on calls :meth:`NodePool.notify`, which wakes the queue.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from policies import health as health_policy
from policies.model import (
    AdminState,
    Decision,
    Health,
    NodeId,
    NodeView,
    NodeViews,
    Telemetry,
    node_view,
)

log = logging.getLogger(__name__)


class TelemetrySource(Protocol):
    def snapshot(self, node_id: NodeId, *, now: float) -> Telemetry | None: ...

    def fresh_until(self, node_id: NodeId) -> float: ...


class SharedLoad(Protocol):
    """The other workers' counts (``regional_agent.workers.shared.LoadShare``): with
    ``workers.count`` above 1, a view's in-flight, token and prefill counts are every worker's."""

    def write(self, node_id: str, in_flight: int, tokens: int, prefill: int) -> None: ...

    def totals(self, node_id: str) -> tuple[int, int, int] | None: ...

    def reserve(
        self, node_id: str, slots: int, in_flight: int, tokens: int, prefill: int
    ) -> bool: ...

    def forget(self, node_id: str) -> None: ...

    def moved(self) -> set[str]: ...


class SilentOwners:
    """With several workers, each node has an owner among them that scrapes or probes it for
    all (``telemetry.scraper``, ``health.monitor``).  This tells a worker whether to do that
    work on a node itself, and logs as it starts and stops doing so for a silent owner, with
    ``logger``: ``<what> owner silent node=...: this worker <does> it until the owner publishes
    again``, then ``<what> owner back node=...: its owner <does> it again``."""

    def __init__(self, logger: logging.Logger, *, what: str, does: str) -> None:
        self._log = logger
        self._what = what
        self._does = does
        self._covering: set[NodeId] = set()  # nodes done here while their owner is silent

    def do_it_here(
        self,
        node_id: NodeId,
        *,
        owned: bool,
        owner_last_s: float | None,
        now: float,
        limit_s: float,
    ) -> bool:
        """Whether this worker does the work on ``node_id``: it owns the node
        (``owned``), or the owner has published nothing yet (``owner_last_s`` None: at the
        start), or nothing for more than ``limit_s`` (it died, or hangs)."""
        if owned or owner_last_s is None:
            return True
        silent_s = now - owner_last_s
        if silent_s <= limit_s:
            if node_id in self._covering:
                self._covering.discard(node_id)
                self._log.info(
                    "%s owner back node=%s: its owner %s it again", self._what, node_id, self._does
                )
            return False
        if node_id not in self._covering:
            self._covering.add(node_id)
            self._log.warning(
                "%s owner silent node=%s silent_s=%.1f: this worker %s it until the owner "
                "publishes again",
                self._what,
                node_id,
                silent_s,
                self._does,
            )
        return True

    def forget(self, node_id: NodeId) -> None:
        self._covering.discard(node_id)


class HealthSource(Protocol):
    def state(self, node_id: NodeId, *, now: float) -> Health: ...

    def slow_start(self, node_id: NodeId, *, now: float) -> float: ...

    def steady_until(self, node_id: NodeId, *, now: float) -> float: ...


@dataclass(slots=True, kw_only=True)
class Node:
    node_id: NodeId
    url: str
    weight: float = 1.0
    slots: int = 64
    group: str | None = None  # GPU group for the groups policy; None: the node is its own group
    source: str = "static"  # who added it: static, admin, autoscaler, dns:<name> (discovery)
    models: frozenset[str] = frozenset()
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # its /v1/models entries
    admin: AdminState = AdminState.ACTIVE
    drain_started_s: float | None = None
    in_flight: int = 0
    in_flight_tokens: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens of requests in flight without a first token
    requests_total: int = 0
    errors_total: int = 0
    # the last 20 decisions to send it a request: their reasons are written when read (admin)
    decisions: collections.deque[Decision] = field(
        default_factory=lambda: collections.deque(maxlen=20)
    )

    def endpoint(self, path: str) -> str:
        return f"{self.url}{path}"


class _Unknown:
    """Telemetry and health before their owners are wired: unknown and healthy."""

    def snapshot(self, node_id: NodeId, *, now: float) -> Telemetry | None:
        return None

    def state(self, node_id: NodeId, *, now: float) -> Health:
        return Health.HEALTHY

    def slow_start(self, node_id: NodeId, *, now: float) -> float:
        return 1.0

    def fresh_until(self, node_id: NodeId) -> float:
        return math.inf

    def steady_until(self, node_id: NodeId, *, now: float) -> float:
        return math.inf


class NodePool:
    def __init__(self, *, panic_threshold: float = 0.0) -> None:
        self._nodes: dict[NodeId, Node] = {}
        self.telemetry: TelemetrySource = _Unknown()
        self.health: HealthSource = _Unknown()
        self.panic_threshold = panic_threshold  # 0: never panic (health.panic_threshold)
        self._panic: health_policy.Panic | None = None  # the last verdict
        self._listeners: list[Callable[[], None]] = []
        # the views, kept between requests (module docstring): node -> (view, valid until)
        self._views: dict[NodeId, tuple[NodeView, float]] = {}
        self._views_until = -math.inf  # the earliest "valid until" of the cached views
        self._routing: NodeViews | None = None  # views() as last built, patched since
        self._positions: dict[NodeId, int] = {}  # node -> its place in _routing
        self._built: dict[NodeId, tuple[Health, AdminState]] = {}  # as _routing was built
        self._dirty: set[NodeId] = set()  # views to rebuild into _routing at the next read
        self._health_moved = True  # since the last panic verdict
        self.shared: SharedLoad | None = None  # with several workers: their summed counts
        self._siblings_unwoken = False  # moved counts read by a decision: the queue is owed a wake
        # with siblings: the nodes this worker's own counts moved since the views were last read
        self._counted: set[NodeId] = set()

    # -- membership ------------------------------------------------------------------------

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self._nodes.values()))

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(NodeId(node_id))

    def add(self, node: Node) -> None:
        self._nodes[node.node_id] = node
        self.notify()

    def remove(self, node_id: NodeId) -> Node | None:
        node = self._nodes.pop(node_id, None)
        if node is not None and self.shared is not None:
            self.shared.forget(node_id)
        self.notify()
        return node

    # -- state -----------------------------------------------------------------------------

    def models(self) -> frozenset[str]:
        out: set[str] = set()
        for node in self._nodes.values():
            out |= node.models
        return frozenset(out)

    def views(self, *, now: float) -> NodeViews:
        """What routing decides over: :meth:`observed`, or in panic every active node as
        healthy.  The pool's own list, kept and updated in place between calls: read it, never
        modify or keep it."""
        if self.shared is not None:
            self._read_siblings()
        routing = self._routing
        if routing is not None and now >= self._views_until:
            self._expire(now)  # views that changed with time: their nodes are dirty now
        if routing is not None:
            if self._dirty and not self._patch(routing, now=now):
                routing = None  # a node's routability moved: build them all
            if routing is not None:
                return routing
        observed = self.observed(now=now)
        if self._health_moved or self._panic is None:  # else the last verdict stands
            self._health_moved = False
            self._judge_panic(observed)
        assert self._panic is not None
        routing = self._routing = NodeViews(health_policy.routing_views(observed, self._panic))
        self._positions = {v.node_id: i for i, v in enumerate(routing)}
        self._built = {v.node_id: (v.health, v.admin) for v in observed}
        self._dirty.clear()
        return routing

    def observed(self, *, now: float) -> list[NodeView]:
        """Every node with its observed health (never adjusted for panic)."""
        if self._counted:
            self._redo_counted()
        views = self._views
        if len(views) == len(self._nodes) and now < self._views_until:
            return [views[node_id][0] for node_id in self._nodes]
        self._views_until = math.inf
        out = []
        for node in self._nodes.values():
            cached = views.get(node.node_id)
            if cached is None or now >= cached[1]:
                if cached is not None:
                    self._health_moved = True  # an ejection ended, a ramp moved, a sample aged
                    self._dirty.add(node.node_id)  # the routing views have it as it was
                cached = self._cache(node, now=now)
            else:
                self._views_until = min(self._views_until, cached[1])
            out.append(cached[0])
        return out

    def _cache(self, node: Node, *, now: float) -> tuple[NodeView, float]:
        """Build ``node``'s view and keep it until its health or telemetry would change by
        itself (an ejection ends, a slow start ramps, a sample goes stale)."""
        until = min(
            self.health.steady_until(node.node_id, now=now),
            self.telemetry.fresh_until(node.node_id),
        )
        cached = self._views[node.node_id] = (self.view(node, now=now), until)
        self._views_until = min(self._views_until, until)
        return cached

    def _changed(self, node_id: NodeId) -> None:
        """The agent's own accounting of ``node_id`` moved (a dispatch, a first token, a
        completion, a sibling's counts): its kept view is redone with the new counts now, in
        place in the routing views, so the next decision reads it as it is.  Its health and
        telemetry stand until the view's time comes or a notify (their changes notify)."""
        node = self._nodes.get(node_id)
        cached = self._views.get(node_id)
        if node is None or cached is None:
            self._dirty.add(node_id)
            return
        before = cached[0]
        view = self._view(node, before.health, before.slow_start, before.telemetry)
        self._views[node_id] = (view, cached[1])
        routing = self._routing
        position = self._positions.get(node_id)
        if (
            routing is None
            or position is None
            or self._panic is None
            or node_id in self._dirty
            or not self._place(routing, position, view)
        ):
            self._dirty.add(node_id)  # views() patches it, or builds them all

    def _expire(self, now: float) -> None:
        """The views whose time has come are rebuilt at the next read, like dirty ones."""
        self._views_until = math.inf
        for node_id, (_, until) in list(self._views.items()):
            if now >= until:
                del self._views[node_id]
                self._dirty.add(node_id)
            else:
                self._views_until = min(self._views_until, until)

    def _patch(self, routing: NodeViews, *, now: float) -> bool:
        """Rebuild the dirty nodes' views into ``routing`` in place; False (and nothing more
        patched) when one of them changed health or routability, which needs a full build."""
        assert self._panic is not None
        for node_id in list(self._dirty):
            node = self._nodes.get(node_id)
            position = self._positions.get(node_id)
            if node is None or position is None:
                return False
            if not self._place(routing, position, self._cache(node, now=now)[0]):
                self._health_moved = True
                return False
            self._dirty.discard(node_id)
        return True

    def _place(self, routing: NodeViews, position: int, view: NodeView) -> bool:
        """Put ``view`` at ``position`` in the routing views, as routing shows it (panic);
        False, and nothing put, when its health or admin state moved since they were built
        (then they must all be built again)."""
        assert self._panic is not None
        if (view.health, view.admin) != self._built.get(view.node_id):
            return False
        routing.replace(position, health_policy.routing_view(view, self._panic))
        return True

    def panic(self, *, now: float) -> health_policy.Panic:
        """Whether the pool is in panic now, with the counts and a reason."""
        return self._judge_panic(self.observed(now=now))

    def _judge_panic(self, observed: list[NodeView]) -> health_policy.Panic:
        decision = health_policy.panic(observed, threshold=self.panic_threshold)
        before = self._panic
        self._panic = decision
        if decision.active != (before is not None and before.active):
            if decision.active:
                log.warning('health panic entered reason="%s"', decision.reason)
            elif before is not None:
                log.warning('health panic left reason="%s"', decision.reason)
        return decision

    def serving(self, *, now: float) -> list[NodeView]:
        """Views of the nodes that count as the region's serving capacity: active (not
        draining) and healthy (not on probation, ejected or failing probes)."""
        return [
            v
            for v in self.observed(now=now)
            if v.admin is AdminState.ACTIVE and v.health is Health.HEALTHY
        ]

    def load(self, node: Node) -> tuple[int, int, int]:
        """``node``'s requests, tokens and uncached prefill in flight: every worker's with
        several (``shared``), else this agent's own counts."""
        if self.shared is not None:
            totals = self.shared.totals(node.node_id)
            if totals is not None:
                return totals
        return node.in_flight, node.in_flight_tokens, node.prefill_tokens

    def view(self, node: Node, *, now: float) -> NodeView:
        return self._view(
            node,
            self.health.state(node.node_id, now=now),
            self.health.slow_start(node.node_id, now=now),
            self.telemetry.snapshot(node.node_id, now=now),
        )

    def _view(
        self, node: Node, health: Health, slow_start: float, telemetry: Telemetry | None
    ) -> NodeView:
        """``node`` as routing sees it, with its counts now and the health and telemetry given."""
        in_flight, tokens, prefill = self.load(node)
        return node_view(
            node_id=node.node_id,
            models=node.models,
            admin=node.admin,
            health=health,
            weight=node.weight,
            in_flight=in_flight,
            in_flight_tokens=tokens,
            prefill_tokens=prefill,
            slots=node.slots,
            slow_start=slow_start,
            telemetry=telemetry,
        )

    # -- the agent's own accounting ----------------------------------------------------------

    def acquire(self, node_id: NodeId, *, tokens: int, prefill: int = 0) -> bool:
        """A request is sent to ``node_id``: ``tokens`` (prompt + max_tokens) in flight, of
        which ``prefill`` prompt tokens the node has to compute before its first token.  With
        several workers, False (nothing counted, the node's view redone at the next read) when
        a sibling took the node's last slot since this worker's view of it."""
        node = self._nodes[node_id]
        if self.shared is not None and not self.shared.reserve(
            node_id,
            node.slots,
            node.in_flight + 1,
            node.in_flight_tokens + tokens,
            node.prefill_tokens + prefill,
        ):
            self._counted.add(node_id)
            return False
        node.in_flight += 1
        node.in_flight_tokens += tokens
        node.prefill_tokens += prefill
        node.requests_total += 1
        self._moved_here(node_id)
        return True

    def first_token(self, node_id: NodeId, *, prefill: int) -> None:
        """The request's first token arrived: its ``prefill`` is done."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.prefill_tokens -= prefill
            if self.shared is not None:  # first: the view is redone from the shared totals
                self.shared.write(
                    node_id, node.in_flight, node.in_flight_tokens, node.prefill_tokens
                )
            self._moved_here(node_id)

    def release(self, node_id: NodeId, *, tokens: int, failed: bool, prefill: int = 0) -> None:
        """The request ended; ``prefill``: what is left of it (no first token was seen)."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.in_flight -= 1
            node.in_flight_tokens -= tokens
            node.prefill_tokens -= prefill
            if failed:
                node.errors_total += 1
            if self.shared is not None:  # first: the view is redone from the shared totals
                self.shared.write(
                    node_id, node.in_flight, node.in_flight_tokens, node.prefill_tokens
                )
            self._moved_here(node_id)
        self._wake()

    def _moved_here(self, node_id: NodeId) -> None:
        """This agent's own accounting of ``node_id`` moved.  Alone, its view is redone now
        (:meth:`_changed`), so that a decision finds the views ready.  With siblings, at the
        next read of the views, with the nodes the siblings moved (:meth:`_read_siblings`):
        a decision redoes those anyway (under load, most of the nodes this worker uses), and
        a node's view is then redone once however often its counts moved in between (a
        dispatch, a first token and a completion each moved it before)."""
        if self.shared is None:
            self._changed(node_id)
        else:
            self._counted.add(node_id)

    def siblings_moved(self) -> int:
        """Read what the other workers changed (``workers.share_interval_s``): their nodes'
        views are rebuilt at the next read and the queue is woken (a slot may be free).
        Returns how many of this pool's nodes moved."""
        if self.shared is None:
            return 0
        moved = self._read_siblings()
        if self._siblings_unwoken:
            self._siblings_unwoken = False
            self._wake()
        return moved

    def _read_siblings(self) -> int:
        """Every read of the views reads what the siblings changed since the last read: the
        moved nodes' views are redone, so a decision weighs their counts as they are, not as
        they were at the last ``workers.share_interval_s`` (stale counts made two workers move
        a prompt to the other node when one's count looked high, until every prompt sat on
        both: docs/benchmarks.md, "Workers").  The queue's wake is left to
        :meth:`siblings_moved`, as a decision must not route back into the queue.  Returns
        how many of this pool's nodes moved."""
        assert self.shared is not None
        moved = 0
        counted = self._counted
        for n in self.shared.moved():
            if n in self._nodes:
                counted.add(NodeId(n))
                moved += 1
        if counted:
            self._redo_counted()
        if moved:
            self._siblings_unwoken = True
        return moved

    def _redo_counted(self) -> None:
        """Redo the views of the nodes whose counts moved since the last read (:meth:`_moved_here`,
        :meth:`_read_siblings`), each once."""
        nodes = self._nodes
        for node_id in self._counted:
            if node_id in nodes:
                self._changed(node_id)
        self._counted.clear()

    # -- change notification -------------------------------------------------------------------

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def notify(self) -> None:
        """Something routing depends on changed (health, telemetry, admin state, membership):
        every view is rebuilt on the next read, and the queue is woken."""
        self._views.clear()
        self._routing = None
        self._dirty.clear()
        self._health_moved = True
        self._wake()

    def _wake(self) -> None:
        for listener in self._listeners:
            listener()


def capacity_by_model(views: Iterable[NodeView]) -> dict[str, float]:
    """Each model's capacity among ``views``: the weights of the nodes that serve it."""
    out: dict[str, float] = {}
    for view in views:
        for model in view.models:
            out[model] = out.get(model, 0.0) + view.weight
    return out
