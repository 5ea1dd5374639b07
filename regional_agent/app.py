"""``create_app(settings)``: the agent's aiohttp application and its background tasks.

``create_app`` wires the components, each given only what it uses:

====================  ==========================================================================
``edge``              what the HTTP handlers share (``regional_agent.edge.Edge``, app key EDGE)
``publisher``         with region.id and region.etcd: liveness, status, desired state (with
                      spill.enabled also the controller's plan, for ``edge.spill``), and the
                      group tables' sync; app key PUBLISHER
``autoscaler``        unless autoscaler.actuator is "none"; app key AUTOSCALER
``discovery``         with [[discovery.dns]] names: nodes from DNS; app key DISCOVERY
``workers``           one of several workers (``worker`` given, ``workers.count`` above 1):
                      shared load, prefix relay, admin relay, merged metrics; app key WORKERS
====================  ==========================================================================

Background tasks (telemetry scrapes, health probes, model discovery, drain supervision; with a
keys file, its change check; with a region and etcd set, the publisher's liveness, status,
desired-state and replica loops; with an actuator set, the autoscaler; one DNS discovery loop
per name) start from
``cleanup_ctx`` through one guard that logs a crash, and stop with the app.

``reload_on_signal(app)`` is what SIGHUP does to a serving agent (``meridian-agent`` installs
it): the keys file is read again, and the TLS certificates too (``meridian_service.tls``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

import meridian_etcd as etcd
from meridian_service import tls
from meridian_service.clock import Clock, MonotonicClock
from policies import admission, routing
from policies.group_routing import GroupPolicy
from policies.groups import GroupId
from policies.kv_index import PreciseIndex
from policies.model import AdminState, NodeId
from regional_agent import admin, autoscaler, request_ids
from regional_agent.autoscaler import AUTOSCALER
from regional_agent.discovery import Discovery
from regional_agent.edge import EDGE, Edge
from regional_agent.errors import (
    AgentError,
    BodyTooLarge,
    InvalidKey,
    QueueFull,
    RateLimited,
    UpstreamError,
)
from regional_agent.group_routing import GroupTables
from regional_agent.health import HealthMonitor
from regional_agent.kv_events import Endpoints, KvEvents
from regional_agent.kv_events import subscriber as kv_events_subscriber
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.prompts import Prompts
from regional_agent.prompts import load as load_prompts
from regional_agent.proxy import endpoints, handlers
from regional_agent.proxy.endpoints import supported
from regional_agent.publisher import Publisher
from regional_agent.publisher.publisher import default_agent_id, worker_agent_id
from regional_agent.queue import Dispatcher
from regional_agent.retry import Backoff, supervise
from regional_agent.roster import Roster, make_node
from regional_agent.settings import GROUPS_POLICY, Settings
from regional_agent.spill import Spill
from regional_agent.telemetry import Scraper
from regional_agent.tenants import Tenants
from regional_agent.upstream import NodeClient
from regional_agent.workers.runtime import Worker, WorkerRuntime

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PUBLISHER = web.AppKey("publisher", Publisher)
DISCOVERY = web.AppKey("discovery", Discovery)
WORKERS = web.AppKey("workers", WorkerRuntime)
KV_EVENTS = web.AppKey("kv_events", KvEvents)
_RNG = web.AppKey("rng", random.Random)  # the background loops' backoff jitter


def create_app(
    settings: Settings,
    *,
    clock: Clock | None = None,
    seed: int | None = None,
    prompts: Prompts | None = None,
    worker: Worker | None = None,
) -> web.Application:
    """The agent's application.  ``prompts``: the tokenizers ``meridian-agent``'s start checks
    loaded; loaded here from ``settings.tokenizer`` when not given.  ``worker``: this process's
    place among several workers (``regional_agent.workers``)."""
    clock = clock or MonotonicClock()
    if prompts is None:
        prompts = load_prompts(settings.tokenizer)
    rng = random.Random(seed)
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
    group_tables: GroupTables | None = None
    group_policy: GroupPolicy | None = None
    policy: routing.Policy
    if settings.routing.policy == GROUPS_POLICY:
        group_tables = GroupTables(
            settings.group_tables,
            membership=lambda: {n.node_id: (GroupId(n.group or n.node_id), n.weight) for n in pool},
        )
        group_policy = GroupPolicy(
            group_tables,
            group_tables.config(
                block_tokens=settings.routing.prefix_block_tokens,
                probation_every=config.probation_every,
            ),
        )
        policy = group_policy
    else:
        policy = routing.create(settings.routing.policy, config)
    dispatcher = Dispatcher(pool=pool, policy=policy, settings=settings.queue, clock=clock, rng=rng)
    roster = Roster(
        pool=pool,
        client=client,
        scraper=scraper,
        health=monitor,
        dispatcher=dispatcher,
        default_slots=settings.queue.slots_per_node,
        models_timeout_s=settings.telemetry.scrape_timeout_s,
    )
    instance = _instance(settings, worker)  # its telemetry's, and its id in etcd
    instruments = Instruments(
        console_spans=settings.otel.console_spans,
        otel=settings.otel,
        instance=instance,
        queue_depths=lambda: {m: dispatcher.depth(m) for m in pool.models()},
        in_flight=lambda: {n.node_id: n.in_flight for n in pool},
        panic=lambda: pool.panic(now=clock.now()).active,
        nodes_by_source=lambda: collections.Counter(n.source for n in pool),
        region=settings.region.id,
        served_models=pool.models,
        node_states=lambda: {
            n.node_id: monitor.state(n.node_id, now=clock.now()).value for n in pool
        },
        ejections=monitor.ejections,
    )
    kv = _kv_events(settings, pool=pool, policy=policy, clock=clock)
    edge = Edge(
        settings=settings,
        clock=clock,
        pool=pool,
        roster=roster,
        client=client,
        dispatcher=dispatcher,
        scraper=scraper,
        health=monitor,
        instruments=instruments,
        budget=admission.RetryBudget(
            ratio=settings.retry.budget_ratio, min_per_s=settings.retry.budget_min_per_s
        ),
        routing_config=config,
        tenants=Tenants(settings.tenants, clock=clock),
        group_policy=group_policy,
        prompts=prompts,
        kv_events=kv,
        spill=Spill(settings=settings.spill, region=settings.region)
        if settings.spill.enabled
        else None,
    )
    runtime: WorkerRuntime | None = None
    if worker is not None and worker.count > 1:
        runtime = WorkerRuntime(
            worker,
            pool=pool,
            dispatcher=dispatcher,
            clock=clock,
            render_metrics=instruments.render,
            share_interval_s=settings.workers.share_interval_s,
            prefix_ttl_s=config.prefix_ttl_s,
        )
        instruments.watch_prefix_relay(runtime.relay.counts)
        scraper.share = runtime.share  # one worker scrapes each node for all of them
        monitor.share = runtime.share  # and probes it for all of them
    request_ids.install_log_ids()
    app = web.Application(
        middlewares=[request_ids.middleware, _errors],
        client_max_size=settings.server.max_body_bytes,
    )
    app[EDGE] = edge
    if runtime is not None:
        app[WORKERS] = runtime
        edge.sibling_secret = runtime.worker.secret
        # each worker takes its share of a tenant's limit; with etcd, its count of the
        # region's replicas (every worker of each) replaces this once read
        edge.tenants.set_replicas(runtime.worker.count, runtime.worker.index)
    scaler = autoscaler.create(
        settings.autoscaler,
        region=settings.region.id,
        pool=pool,
        roster=roster,
        clock=clock,
        drain_timeout_s=settings.health.drain_timeout_s,
        rng=random.Random(rng.random()),
        demand=dispatcher if runtime is None else runtime,  # with workers, all of theirs
    )
    if scaler is not None:
        app[AUTOSCALER] = scaler
    if settings.discovery.dns:
        app[DISCOVERY] = Discovery(
            settings.discovery.dns, pool=pool, roster=roster, instruments=instruments, clock=clock
        )
    if settings.region.publishing:
        app[PUBLISHER] = Publisher(
            store=etcd.Store(settings.region.etcd_client()),
            settings=settings.region,
            pool=pool,
            queue_depth=dispatcher.depth,
            instruments=instruments,
            clock=clock,
            rng=random.Random(rng.random()),
            on_floor=None if scaler is None else scaler.set_floor,
            tables=group_tables,
            on_replicas=edge.tenants.set_replicas,
            on_actor=None if scaler is None else scaler.set_acting,
            on_plan=None if edge.spill is None else edge.spill.update,
            agent_id=instance,
        )
        if scaler is not None:
            scaler.acting = False  # until this replica holds the region's autoscaler key
    elif scaler is not None and runtime is not None:  # no election: the first worker acts
        scaler.set_acting(runtime.worker.index == 0, None if runtime.worker.index == 0 else "w0")
    if kv is not None:
        app[KV_EVENTS] = kv
        instruments.watch_kv_events(
            kv.counts,
            event_kinds=kv_events_subscriber.EVENT_KINDS,
            nodes=lambda: {
                n: (kv.index.is_precise(n), kv.index.blocks(n)) for n in kv.subscriptions
            },
        )
    app[_RNG] = random.Random(rng.random())
    for proxied in endpoints.PROXIED:  # every inference endpoint of a vLLM node
        app.router.add_post(proxied.path, handlers.endpoint(proxied.path, proxied.kind))
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model:.+}", handlers.model)  # ids hold slashes: org/name
    app.router.add_get("/v1/responses/{response_id}", handlers.stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", handlers.stored_response)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    admin.add_routes(app, relayed=None if runtime is None else runtime.relayed)
    app.cleanup_ctx.append(_background)
    return app


def _instance(settings: Settings, worker: Worker | None) -> str:
    """This process's id: its telemetry's ``service.instance.id`` and its replica id in etcd.
    The agent's id, each worker's its own, ``<a>-w<i>`` (their cumulative counters must not
    meet in one series, nor their keys in etcd)."""
    agent_id = settings.region.agent_id or default_agent_id()
    if worker is None or worker.count == 1:
        return agent_id
    return worker_agent_id(agent_id, worker.index)


def _kv_events(
    settings: Settings, *, pool: NodePool, policy: routing.Policy, clock: Clock
) -> KvEvents | None:
    """The KV-event subscriptions and the precise index they feed, when any node publishes."""
    per_node = {
        NodeId(n.node_id): Endpoints(n.kv_events_endpoint, n.kv_events_replay_endpoint)
        for n in settings.nodes
        if n.kv_events_endpoint is not None
    }
    if settings.kv_events.endpoint is None and not per_node:
        return None
    index = PreciseIndex(
        capacity_blocks=settings.kv_events.capacity_blocks,
        block_size=settings.routing.prefix_block_tokens,
    )
    if not routing.attach_precise(policy, index):
        log.warning(
            "kv_events is configured but routing.policy %r keeps no prefix index: the events "
            "are followed and counted, and routing ignores them (use meridian or prefix_aware)",
            settings.routing.policy,
        )
    return KvEvents(settings.kv_events, pool=pool, index=index, clock=clock, per_node=per_node)


# -- probes of the agent itself ------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """The agent process is up (liveness)."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """The agent can serve: at least one routable node with a known model (readiness)."""
    edge = request.app[EDGE]
    views = edge.pool.views(now=edge.clock.now())
    routable = [v.node_id for v in views if v.routable and v.models]
    body = {"ready": bool(routable), "routable_nodes": len(routable), "nodes": len(views)}
    return web.json_response(body, status=200 if routable else 503)


async def metrics(request: web.Request) -> web.Response:
    runtime = request.app.get(WORKERS)
    if runtime is None:
        body = request.app[EDGE].instruments.render()
    else:
        body = await runtime.metrics(request)
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


# -- errors ----------------------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except (QueueFull, RateLimited, InvalidKey) as exc:  # counted, not logged: they come in floods
        return web.json_response(exc.body(), status=exc.http_status, headers=exc.headers())
    except AgentError as exc:
        if not isinstance(exc, UpstreamError):
            log.info(
                "request refused path=%s status=%d reason=%s",
                request.path,
                exc.http_status,
                exc.message,
            )
        return web.json_response(exc.body(), status=exc.http_status, headers=exc.headers())
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[EDGE].settings.server.max_body_bytes
        too_large = BodyTooLarge(
            f"the request body is larger than {limit} bytes (server.max_body_bytes); "
            "send a smaller request"
        )
        return web.json_response(too_large.body(), status=too_large.http_status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        other = AgentError(exc.reason)
        headers: dict[str, str] = {}
        if isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = sorted(exc.allowed_methods)
            headers["Allow"] = ", ".join(allowed)  # RFC 9110: a 405 must list what is allowed
            other = AgentError(
                f"{request.method} is not allowed on {request.path}; "
                f"use {' or '.join(allowed) or 'another path'}"
            )
        elif exc.status == 404:
            other = AgentError(f"no such path: {request.path}; the agent serves {supported()}")
        other.http_status = exc.status
        other.openai_type = "NotFoundError" if exc.status == 404 else "BadRequestError"
        return web.json_response(other.body(), status=exc.status, headers=headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error path=%s", request.path)
        err = AgentError("internal error in the agent; see its log")
        return web.json_response(err.body(), status=500)


# -- background work -------------------------------------------------------------------------------


async def _background(app: web.Application) -> AsyncIterator[None]:
    edge = app[EDGE]
    settings = edge.settings
    await edge.roster.refresh_models()
    _announce_tenants(edge)
    tasks = [
        _spawn("telemetry", edge.scraper.run()),
        _spawn("health", edge.health.run()),
        _spawn("models", edge.roster.models_loop(interval_s=settings.telemetry.models_refresh_s)),
        _spawn("drain", _drain_loop(edge)),
    ]
    kv = app.get(KV_EVENTS)
    if kv is not None:
        tasks.append(_spawn("kv-events", kv.run()))
    runtime = app.get(WORKERS)
    if runtime is not None:
        runtime.start()
        tasks.append(_spawn("workers-share", runtime.share_loop()))
        if runtime.worker.restarted:  # once it listens, which comes after this startup
            catch_up = runtime.catch_up(functools.partial(admin.catch_up, edge))
            tasks.append(_spawn("workers-catch-up", catch_up))
    publisher, scaler = app.get(PUBLISHER), app.get(AUTOSCALER)
    backoff_rng = app[_RNG]

    def supervised(name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        backoff = Backoff(base_s=1.0, max_s=30.0, rng=backoff_rng)
        tasks.append(_spawn(name, supervise(name, loop, backoff=backoff)))

    if not edge.tenants.open:
        supervised("keys-file", edge.tenants.watch_loop)
    if scaler is not None:
        supervised("autoscaler", scaler.run)
    discovery = app.get(DISCOVERY)
    if discovery is not None:
        for name in discovery.names:
            supervised(f"discovery-{name}", functools.partial(discovery.run, name))
    if publisher is not None:
        supervised("replicas", publisher.replicas_loop)
        supervised("alive", publisher.alive_loop)
        supervised("status", publisher.status_loop)
        supervised("desired", publisher.desired_loop)
        if publisher.on_actor is not None:
            supervised("autoscaler-actor", publisher.actor_loop)
        if publisher.on_plan is not None:
            supervised("plan", publisher.plan_loop)
        if publisher.tables is not None:
            supervised("tables-watch", publisher.tables.watch_loop)
            supervised("tables-flush", publisher.tables.flush_loop)
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
    if runtime is not None:
        runtime.close()
    await edge.client.close()
    edge.close()
    await asyncio.to_thread(edge.instruments.shutdown)  # an OTLP flush: off the event loop


def _announce_tenants(edge: Edge) -> None:
    tenants = edge.tenants
    if tenants.open:
        log.warning(
            "the data plane is open: no API keys (tenants.keys_file is unset), every client is "
            "served and its X-Priority and X-Tenant are trusted; run it so only on a trusted "
            "network, or set tenants.keys_file"
        )
        return
    count, keys = tenants.counts
    log.info(
        "API keys in force file=%s tenants=%d keys=%d (reloaded on change and on SIGHUP)",
        edge.settings.tenants.keys_file,
        count,
        keys,
    )


def reload_on_signal(app: web.Application) -> None:
    """SIGHUP: read the keys file again (a bad one keeps the keys in force) and the TLS
    certificates (``meridian_service.tls.reload_all``), each logging what it did."""
    edge = app[EDGE]
    log.info("SIGHUP: reloading API keys and TLS certificates")
    edge.tenants.reload(reason="SIGHUP")
    if tls.live():
        tls.reload_all()


def _spawn(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.create_task(coro, name=f"meridian-agent-{name}")

    def done(t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("background task crashed task=%s", name, exc_info=t.exception())

    task.add_done_callback(done)
    return task


async def _drain_loop(edge: Edge) -> None:
    """Draining nodes: report when empty; past the drain timeout, cut what is still running."""
    timeout_s = edge.settings.health.drain_timeout_s
    while True:
        await asyncio.sleep(0.1)
        now = edge.clock.now()
        for node in edge.pool:
            if node.admin is not AdminState.DRAINING or node.drain_started_s is None:
                continue
            if now - node.drain_started_s < timeout_s:
                continue
            for lease in edge.dispatcher.leases(node.node_id):
                if lease.cut_off():
                    log.warning("drain timeout: cutting request node=%s", node.node_id)
