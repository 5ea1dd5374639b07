"""What the agent's handlers share, under one typed app key."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from meridian_service.clock import Clock
from policies import admission, routing
from regional_agent.health import HealthMonitor
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.queue import Dispatcher
from regional_agent.settings import Settings
from regional_agent.telemetry import Scraper
from regional_agent.upstream import NodeClient

if TYPE_CHECKING:  # both need the Agent: imported for types only
    from regional_agent.autoscaler import Autoscaler
    from regional_agent.publisher import Publisher


@dataclass(slots=True, kw_only=True)
class Agent:
    settings: Settings
    clock: Clock
    rng: random.Random
    pool: NodePool
    client: NodeClient
    dispatcher: Dispatcher
    scraper: Scraper
    health: HealthMonitor
    instruments: Instruments
    budget: admission.RetryBudget
    routing_config: routing.RoutingConfig
    publisher: Publisher | None = None  # set when region.id and region.etcd are
    autoscaler: Autoscaler | None = None  # set unless autoscaler.actuator is "none"


AGENT = web.AppKey("agent", Agent)
