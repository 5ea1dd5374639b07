"""What the agent's HTTP edge (the OpenAI proxy and the admin endpoints) works with, under one
typed app key.

The edge is the only part of the agent that holds every component: it is where requests come
in.  The background parts get only what they use (``app.py`` wires them): the publisher the
pool, the queue depth, the instruments and a floor callback; the autoscaler the pool, the
roster and a clock; nothing below the edge imports this module.

The edge also owns the parse threads (``parse.threads``), on which the proxy parses request
bodies of at least ``parse.offload_min_bytes`` (:meth:`Edge.offload`).  They start with the
first such body; idle, they wait on a queue and end with the process (or when the edge is
collected), so an agent that never sees a large body has none.

Starting them also lowers the interpreter's GIL switch interval to 0.2 ms (from CPython's
5 ms; never raises it): the stand-in tokeniser is pure Python and holds the GIL (a model's
tokenizer, ``regional_agent.prompts``, releases it while it encodes; the block hashing around it
does not), and while it runs the event loop waits up to one interval to get the GIL back after
each of its syscalls.  Measured (docs/agent.md, "Parsing off the loop"): three 3.8 MB prompts
parsed at once, ``GET /health`` worst 26-82 ms at 5 ms, 21-38 ms at 1 ms (13-19 ms at both 1
and 0.2 ms on a later host: the 4 MiB JSON decode, C that holds the GIL, is the worst);
a new 2,000-word prompt's longest stall of a loop on its own core, over a short prompt's,
+0.91 ms at 1 ms and +0.47 ms at 0.2 ms; a thread making syscalls against a busy tokeniser
thread gets 2.8 times the turns at 0.2 ms, for 4 % fewer tokenisations and 5 % more CPU.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from meridian_service.clock import Clock
from policies import admission, routing
from policies.group_routing import GroupPolicy
from regional_agent.health import HealthMonitor
from regional_agent.kv_events import KvEvents
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.prompts import Prompts
from regional_agent.queue import Dispatcher
from regional_agent.request_ids import ResponseHomes
from regional_agent.roster import Roster
from regional_agent.settings import Settings
from regional_agent.spill import Spill
from regional_agent.telemetry import Scraper
from regional_agent.tenants import Tenants
from regional_agent.upstream import NodeClient

T = TypeVar("T")
_SWITCH_INTERVAL_S = 0.0002  # the GIL switch interval while parse threads exist (docstring)


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
    tenants: Tenants  # API keys, tenants and their rate limits (open mode: no keys)
    group_policy: GroupPolicy | None = None  # with group tables (routing.policy = "groups")
    prompts: Prompts = field(default_factory=Prompts)  # the models' tokenizers ([tokenizer])
    kv_events: KvEvents | None = None  # the nodes' KV-event subscriptions ([kv_events])
    spill: Spill | None = None  # other regions to forward to (spill.enabled)
    # which node made each Responses-API response relayed, for GET /v1/responses/{id}
    response_homes: ResponseHomes = field(default_factory=ResponseHomes)
    # with several workers: what a sibling sends (workers.runtime.SIBLING_SECRET) in place of
    # the admin token
    sibling_secret: str | None = None
    _parse_threads: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    async def offload(self, work: Callable[[], T]) -> T:
        """``work()`` on a parse thread: CPU-bound work that must not stall the event loop.

        Cancelling the caller cancels ``work`` if it has not started; once started it runs to
        the end (it is bounded: ``routing.prefix_max_tokens``)."""
        if self._parse_threads is None:
            sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
            self._parse_threads = ThreadPoolExecutor(
                max_workers=self.settings.parse.threads, thread_name_prefix="meridian-parse"
            )
        return await asyncio.wrap_future(self._parse_threads.submit(work))

    def close(self) -> None:
        """Stop the parse threads (the app's cleanup); work already queued finishes first."""
        if self._parse_threads is not None:
            self._parse_threads.shutdown(wait=False, cancel_futures=True)
            self._parse_threads = None

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
