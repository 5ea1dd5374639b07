"""The region's node pool: each node's address, capacity, admin state and the agent's own
accounting of what it has in flight there.

Health and telemetry live with their owners (``health.HealthMonitor``,
``telemetry.Scraper``); :meth:`NodePool.views` joins all three into the frozen
``policies.model.NodeView`` snapshots that routing decides over.  Whoever changes something a
waiting request could be routed on calls :meth:`NodePool.notify`, which wakes the queue.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from policies.model import AdminState, Health, NodeId, NodeView, Telemetry


class TelemetrySource(Protocol):
    def snapshot(self, node_id: NodeId, *, now: float) -> Telemetry | None: ...


class HealthSource(Protocol):
    def state(self, node_id: NodeId, *, now: float) -> Health: ...

    def slow_start(self, node_id: NodeId, *, now: float) -> float: ...


@dataclass(slots=True, kw_only=True)
class Node:
    node_id: NodeId
    url: str
    weight: float = 1.0
    slots: int = 64
    group: str | None = None  # GPU group for the groups policy; None: the node is its own group
    models: frozenset[str] = frozenset()
    admin: AdminState = AdminState.ACTIVE
    drain_started_s: float | None = None
    in_flight: int = 0
    in_flight_tokens: int = 0
    requests_total: int = 0
    errors_total: int = 0
    decisions: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))

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


class NodePool:
    def __init__(self) -> None:
        self._nodes: dict[NodeId, Node] = {}
        self.telemetry: TelemetrySource = _Unknown()
        self.health: HealthSource = _Unknown()
        self._listeners: list[Callable[[], None]] = []

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
        self.notify()
        return node

    # -- state -----------------------------------------------------------------------------

    def models(self) -> frozenset[str]:
        out: set[str] = set()
        for node in self._nodes.values():
            out |= node.models
        return frozenset(out)

    def views(self, *, now: float) -> list[NodeView]:
        return [self.view(node, now=now) for node in self._nodes.values()]

    def serving(self, *, now: float) -> list[NodeView]:
        """Views of the nodes that count as the region's serving capacity: active (not
        draining) and healthy (not on probation, ejected or failing probes)."""
        return [
            v
            for v in self.views(now=now)
            if v.admin is AdminState.ACTIVE and v.health is Health.HEALTHY
        ]

    def view(self, node: Node, *, now: float) -> NodeView:
        return NodeView(
            node_id=node.node_id,
            models=node.models,
            admin=node.admin,
            health=self.health.state(node.node_id, now=now),
            weight=node.weight,
            in_flight=node.in_flight,
            in_flight_tokens=node.in_flight_tokens,
            slots=node.slots,
            slow_start=self.health.slow_start(node.node_id, now=now),
            telemetry=self.telemetry.snapshot(node.node_id, now=now),
        )

    # -- the agent's own accounting ----------------------------------------------------------

    def acquire(self, node_id: NodeId, *, tokens: int) -> None:
        node = self._nodes[node_id]
        node.in_flight += 1
        node.in_flight_tokens += tokens
        node.requests_total += 1

    def release(self, node_id: NodeId, *, tokens: int, failed: bool) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.in_flight -= 1
            node.in_flight_tokens -= tokens
            if failed:
                node.errors_total += 1
        self.notify()

    # -- change notification -------------------------------------------------------------------

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def notify(self) -> None:
        for listener in self._listeners:
            listener()
