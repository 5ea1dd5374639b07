"""Which nodes exist and what they serve: node records from settings, models from ``/v1/models``."""

from __future__ import annotations

import asyncio
import logging

from policies.model import NodeId
from regional_agent.app_state import Agent
from regional_agent.errors import UpstreamError
from regional_agent.nodes import Node
from regional_agent.settings import NodeSettings

log = logging.getLogger(__name__)


def make_node(settings: NodeSettings, *, default_slots: int) -> Node:
    return Node(
        node_id=NodeId(settings.node_id),
        url=settings.url,
        weight=settings.weight,
        slots=settings.slots or default_slots,
        group=settings.group,
    )


async def refresh_models(agent: Agent, nodes: list[Node] | None = None) -> None:
    """Ask each node which models it serves (``/v1/models``)."""

    async def one(node: Node) -> None:
        try:
            data = await agent.client.get_json(
                node.node_id,
                node.endpoint("/v1/models"),
                timeout_s=agent.settings.telemetry.scrape_timeout_s,
            )
        except UpstreamError as exc:
            log.debug("model discovery failed node=%s error=%s", node.node_id, exc.message)
            return
        ids = frozenset(
            m["id"]
            for m in (data.get("data") if isinstance(data, dict) else None) or []
            if isinstance(m, dict) and isinstance(m.get("id"), str)
        )
        if ids != node.models:
            log.info("node models node=%s models=%s", node.node_id, ",".join(sorted(ids)) or "-")
            node.models = ids
            agent.pool.notify()

    await asyncio.gather(*(one(n) for n in (nodes if nodes is not None else list(agent.pool))))
