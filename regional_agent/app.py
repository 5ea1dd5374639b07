"""``create_app(settings)``: the agent's aiohttp application and its background tasks.

Background tasks (telemetry scrapes, health probes, model discovery, drain supervision; with a
region and etcd set, the publisher's liveness, status and desired-state loops; with an
actuator set, the autoscaler) start from ``cleanup_ctx`` through one guard that logs a crash,
and stop with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from meridian_service.clock import Clock, MonotonicClock
from policies import admission, routing
from policies.groups import GroupId
from policies.model import AdminState
from regional_agent import admin, autoscaler
from regional_agent.app_state import AGENT, Agent
from regional_agent.discovery import make_node, refresh_models
from regional_agent.errors import AgentError, BodyTooLarge, QueueFull, UpstreamError
from regional_agent.health import HealthMonitor
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.proxy import handlers
from regional_agent.publisher import Publisher, Store
from regional_agent.queue import Dispatcher
from regional_agent.retry import Backoff, supervise
from regional_agent.settings import GROUPS_POLICY, Settings
from regional_agent.tables import GroupPolicy, GroupTables
from regional_agent.telemetry import Scraper
from regional_agent.upstream import NodeClient

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    settings: Settings, *, clock: Clock | None = None, seed: int | None = None
) -> web.Application:
    clock = clock or MonotonicClock()
    pool = NodePool(panic_threshold=settings.health.panic_threshold)
    for node_settings in settings.nodes:
        pool.add(make_node(node_settings, default_slots=settings.queue.slots_per_node))
    client = NodeClient(
        connect_timeout_s=settings.upstream.connect_timeout_s,
        first_byte_timeout_s=settings.upstream.first_byte_timeout_s,
        read_timeout_s=settings.upstream.read_timeout_s,
    )
    scraper = Scraper(pool=pool, client=client, settings=settings.telemetry, clock=clock)
    monitor = HealthMonitor(pool=pool, client=client, settings=settings.health, clock=clock)
    pool.telemetry = scraper
    pool.health = monitor
    config = settings.routing.config()
    rng = random.Random(seed)
    group_tables: GroupTables | None = None
    policy: routing.Policy
    if settings.routing.policy == GROUPS_POLICY:
        group_tables = GroupTables(
            settings.group_tables,
            membership=lambda: {n.node_id: (GroupId(n.group or n.node_id), n.weight) for n in pool},
        )
        policy = GroupPolicy(group_tables, block_tokens=settings.routing.prefix_block_tokens)
    else:
        policy = routing.create(settings.routing.policy, config)
    dispatcher = Dispatcher(
        pool=pool,
        policy=policy,
        settings=settings.queue,
        clock=clock,
        rng=rng,
    )

    def depths() -> dict[str, int]:
        return {m: dispatcher.depth(m) for m in pool.models()}

    def in_flight() -> dict[str, int]:
        return {n.node_id: n.in_flight for n in pool}

    agent = Agent(
        settings=settings,
        clock=clock,
        rng=rng,
        pool=pool,
        client=client,
        dispatcher=dispatcher,
        scraper=scraper,
        health=monitor,
        instruments=Instruments(
            console_spans=settings.otel.console_spans,
            queue_depths=depths,
            in_flight=in_flight,
            panic=lambda: pool.panic(now=clock.now()).active,
        ),
        budget=admission.RetryBudget(
            ratio=settings.retry.budget_ratio, min_per_s=settings.retry.budget_min_per_s
        ),
        routing_config=config,
    )
    agent.autoscaler = autoscaler.create(
        agent, settings.autoscaler, region=settings.region.id, rng=random.Random(rng.random())
    )
    if settings.region.publishing:
        agent.publisher = Publisher(
            agent=agent,
            store=Store(endpoints=settings.region.etcd, timeout_s=settings.region.etcd_timeout_s),
            settings=settings.region,
            rng=random.Random(rng.random()),
            tables=group_tables,
        )
    app = web.Application(middlewares=[_errors], client_max_size=settings.server.max_body_bytes)
    app[AGENT] = agent
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    admin.add_routes(app)
    app.cleanup_ctx.append(_background)
    return app


# -- probes of the agent itself ------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """The agent process is up (liveness)."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """The agent can serve: at least one routable node with a known model (readiness)."""
    agent = request.app[AGENT]
    views = agent.pool.views(now=agent.clock.now())
    routable = [v.node_id for v in views if v.routable and v.models]
    body = {"ready": bool(routable), "routable_nodes": len(routable), "nodes": len(views)}
    return web.json_response(body, status=200 if routable else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[AGENT].instruments.render()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


# -- errors ----------------------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except QueueFull as exc:
        return web.json_response(
            exc.body(), status=exc.http_status, headers={"Retry-After": str(exc.retry_after_s)}
        )
    except AgentError as exc:
        if not isinstance(exc, UpstreamError):
            log.info(
                "request refused path=%s status=%d reason=%s",
                request.path,
                exc.http_status,
                exc.message,
            )
        return web.json_response(exc.body(), status=exc.http_status)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[AGENT].settings.server.max_body_bytes
        too_large = BodyTooLarge(
            f"the request body is larger than {limit} bytes (server.max_body_bytes); "
            "send a smaller request"
        )
        return web.json_response(too_large.body(), status=too_large.http_status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        other = AgentError(exc.reason)
        other.http_status = exc.status
        other.openai_type = "NotFoundError" if exc.status == 404 else "BadRequestError"
        return web.json_response(other.body(), status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error path=%s", request.path)
        err = AgentError("internal error in the agent; see its log")
        return web.json_response(err.body(), status=500)


# -- background work -------------------------------------------------------------------------------


async def _background(app: web.Application) -> AsyncIterator[None]:
    agent = app[AGENT]
    await refresh_models(agent)
    tasks = [
        _spawn("telemetry", agent.scraper.run()),
        _spawn("health", agent.health.run()),
        _spawn("models", _models_loop(agent)),
        _spawn("drain", _drain_loop(agent)),
    ]
    publisher, scaler = agent.publisher, agent.autoscaler
    if scaler is not None:
        tasks.append(_spawn("autoscaler", _supervised(agent, "autoscaler", scaler.run)))
    if publisher is not None:
        tasks += [
            _spawn("alive", _supervised(agent, "alive", publisher.alive_loop)),
            _spawn("status", _supervised(agent, "status", publisher.status_loop)),
            _spawn("desired", _supervised(agent, "desired", publisher.desired_loop)),
        ]
        if publisher.tables is not None:
            tasks += [
                _spawn(
                    "tables-watch", _supervised(agent, "tables-watch", publisher.tables.watch_loop)
                ),
                _spawn(
                    "tables-flush", _supervised(agent, "tables-flush", publisher.tables.flush_loop)
                ),
            ]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if publisher is not None:
        await publisher.close()
    if scaler is not None:
        await scaler.close()
    await agent.client.close()
    agent.instruments.shutdown()


def _spawn(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.create_task(coro, name=f"meridian-agent-{name}")

    def done(t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("background task crashed task=%s", name, exc_info=t.exception())

    task.add_done_callback(done)
    return task


def _supervised(
    agent: Agent, name: str, loop: Callable[[], Coroutine[Any, Any, None]]
) -> Coroutine[Any, Any, None]:
    return supervise(name, loop, backoff=Backoff(base_s=1.0, max_s=30.0, rng=agent.rng))


async def _models_loop(agent: Agent) -> None:
    while True:
        await asyncio.sleep(agent.settings.telemetry.models_refresh_s)
        await refresh_models(agent)


async def _drain_loop(agent: Agent) -> None:
    """Draining nodes: report when empty; past the drain timeout, cut what is still running."""
    timeout_s = agent.settings.health.drain_timeout_s
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(0.1)
        now = agent.clock.now()
        for node in agent.pool:
            if node.admin is not AdminState.DRAINING or node.drain_started_s is None:
                continue
            if now - node.drain_started_s < timeout_s:
                continue
            for lease in agent.dispatcher.leases(node.node_id):
                if lease.timeout is not None and lease.timeout.when() is None:
                    log.warning("drain timeout: cutting request node=%s", node.node_id)
                    lease.timeout.reschedule(loop.time())
