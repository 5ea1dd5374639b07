"""The region's nodes: which exist and what each serves.

Nodes come from settings at start, from the admin API (``POST`` / ``DELETE /admin/nodes``),
from an autoscaler actuator and from DNS discovery (``regional_agent.discovery``), all through
:class:`Roster`: :meth:`Roster.add` puts a node in the pool and asks it which models it serves
(``/v1/models``); :meth:`Roster.remove` takes it out and makes telemetry, health and the routing
policy forget it (its in-flight requests finish).  Every node remembers its ``source``
(``static``, ``admin``, ``autoscaler``, ``dns:<name>``).  Every ``telemetry.models_refresh_s``
the roster asks every node again (:meth:`Roster.models_loop`).
"""

from __future__ import annotations

import asyncio
import logging

from policies.model import AdminState, NodeId
from regional_agent.errors import UpstreamError
from regional_agent.health import HealthMonitor
from regional_agent.nodes import Node, NodePool
from regional_agent.queue import Dispatcher
from regional_agent.settings import NodeSettings
from regional_agent.telemetry import Scraper
from regional_agent.upstream import NodeClient

log = logging.getLogger(__name__)


class Roster:
    def __init__(
        self,
        *,
        pool: NodePool,
        client: NodeClient,
        scraper: Scraper,
        health: HealthMonitor,
        dispatcher: Dispatcher,
        default_slots: int,
        models_timeout_s: float,
    ) -> None:
        self._pool = pool
        self._client = client
        self._scraper = scraper
        self._health = health
        self._dispatcher = dispatcher
        self._default_slots = default_slots
        self._models_timeout_s = models_timeout_s
        # admin state to give a node when it is added (a restarted worker learns of drains and
        # weights of discovered nodes before its own discovery finds them): id -> (drain, weight)
        self.held: dict[str, tuple[bool, float]] = {}

    def make(self, settings: NodeSettings, *, source: str = "static") -> Node:
        """The node ``settings`` describe, not yet in the pool."""
        return make_node(settings, default_slots=self._default_slots, source=source)

    async def add(self, node: Node, *, warm: bool | None = None) -> Node:
        """Put ``node`` in the pool (``ValueError`` if its id is taken) and learn its models.

        ``warm``: True, it takes full traffic at once; False, it ramps up over
        ``health.slow_start_s``; None, as the health monitor decides (warm only before its
        first probe round)."""
        if node.node_id in self._pool:
            raise ValueError(f"node {node.node_id} is already in the pool")
        held = self.held.pop(node.node_id, None)
        if held is not None:
            draining, node.weight = held
            if draining:
                node.admin = AdminState.DRAINING
                node.drain_started_s = 0.0  # drained since before this process: the timeout ran
        if warm is not None:
            self._health.meet(node.node_id, warm=warm)
        self._pool.add(node)
        await self.refresh_models([node])
        return node

    def remove(self, node_id: NodeId) -> Node | None:
        """Take the node out; telemetry, health and the policy forget it."""
        node = self._pool.remove(node_id)
        self._scraper.forget(node_id)
        self._health.forget(node_id)
        self._dispatcher.policy.forget_node(node_id)
        return node

    async def refresh_models(self, nodes: list[Node] | None = None) -> None:
        """Ask each node which models it serves (``/v1/models``)."""
        targets = list(self._pool) if nodes is None else nodes
        await asyncio.gather(*(self._models(n) for n in targets))

    async def models_loop(self, *, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh_models()

    async def _models(self, node: Node) -> None:
        try:
            data = await self._client.get_json(
                node.node_id, node.endpoint("/v1/models"), timeout_s=self._models_timeout_s
            )
        except UpstreamError as exc:
            log.debug("model discovery failed node=%s error=%s", node.node_id, exc.message)
            return
        cards = {
            m["id"]: m
            for m in (data.get("data") if isinstance(data, dict) else None) or []
            if isinstance(m, dict) and isinstance(m.get("id"), str)
        }
        node.cards = cards
        ids = frozenset(cards)
        if ids != node.models:
            log.info("node models node=%s models=%s", node.node_id, ",".join(sorted(ids)) or "-")
            node.models = ids
            self._pool.notify()


def make_node(settings: NodeSettings, *, default_slots: int, source: str = "static") -> Node:
    return Node(
        node_id=NodeId(settings.node_id),
        url=settings.url,
        weight=settings.weight,
        slots=settings.slots or default_slots,
        group=settings.group,
        source=source,
    )
