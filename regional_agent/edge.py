"""What the agent's HTTP edge (the OpenAI proxy and the admin endpoints) works with, under one
typed app key.

The edge is the only part of the agent that holds every component: it is where requests come
in.  The background parts get only what they use (``app.py`` wires them): the publisher the
pool, the queue depth, the instruments and a floor callback; the autoscaler the pool, the
roster and a clock; nothing below the edge imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from meridian_service.clock import Clock
from policies import admission, routing
from policies.group_routing import GroupPolicy
from regional_agent.health import HealthMonitor
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.queue import Dispatcher
from regional_agent.roster import Roster
from regional_agent.settings import Settings
from regional_agent.telemetry import Scraper
from regional_agent.upstream import NodeClient


@dataclass(slots=True, kw_only=True)
class Edge:
    settings: Settings
    clock: Clock
    pool: NodePool
    roster: Roster
    client: NodeClient
    dispatcher: Dispatcher
    scraper: Scraper
    health: HealthMonitor
    instruments: Instruments
    budget: admission.RetryBudget
    routing_config: routing.RoutingConfig
    group_policy: GroupPolicy | None = None  # with group tables (routing.policy = "groups")

    def policy_names(self) -> tuple[str, ...]:
        """The routing policies the admin API may switch to: every one of ``policies.routing``,
        and ``groups`` when the agent keeps group tables."""
        extra = () if self.group_policy is None else (self.group_policy.name,)
        return (*routing.NAMES, *extra)

    def make_policy(self, name: str) -> routing.Policy:
        """A policy to switch to; ``groups`` is the one policy that keeps its tables."""
        if self.group_policy is not None and name == self.group_policy.name:
            return self.group_policy
        return routing.create(name, self.routing_config)


EDGE = web.AppKey("edge", Edge)
