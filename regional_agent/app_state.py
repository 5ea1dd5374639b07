"""What the agent's handlers share, under one typed app key."""

from __future__ import annotations

import random
from dataclasses import dataclass

from aiohttp import web

from policies import admission, routing
from regional_agent.clock import Clock
from regional_agent.health import HealthMonitor
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.queue import Dispatcher
from regional_agent.settings import Settings
from regional_agent.telemetry import Scraper
from regional_agent.upstream import NodeClient


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


AGENT = web.AppKey("agent", Agent)
