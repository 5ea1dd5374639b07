"""``create_app(settings)``: one controller replica — election, the window loop, a read API.

Every replica campaigns; the leader runs the window loop (``reconcile.windows``), fenced by its
leader key.  Every replica answers reads: ``/health``, ``/v1/leader``, ``/v1/regions``,
``/v1/plan`` and ``/v1/events`` come straight from etcd.  (The operators' admin API with writes,
roles and audit is ``controlplane/api``, served on its own port: ``api.port``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from controlplane.api import server as admin
from controlplane.dns import steering
from controlplane.election import Election
from controlplane.errors import NotLeader, StoreUnavailable
from controlplane.reconcile import fleet, windows
from controlplane.settings import ControllerSettings
from controlplane.store import Store
from controlplane.store.etcd import Fence
from meridian_service.clock import Clock, WallClock
from meridian_wire import keys
from meridian_wire.models import Event

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class Controller:
    settings: ControllerSettings
    clock: Clock
    store: Store
    election: Election
    last_pass: windows.PassResult | None = None
    etcd_ok: bool = True
    passes: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def lead(self, fence: Fence) -> None:
        """The leader's work: one reconcile pass per window until leadership ends.

        Fail static: while etcd is unreachable nothing is judged or written.  The first pass
        after it returns (and the first pass of a new leader) judges nothing either: it only
        brings admin states, backups and floors up to date, so agents get one window to
        republish before they can earn a strike for an outage that was not theirs.  DNS
        steering (``controlplane/dns``) runs beside the loop and is poked after every pass.
        """
        async with steering.steering(
            self.settings, store=self.store, fence=fence, clock=self.clock
        ) as dns:
            await self._windows(fence, dns)

    async def _windows(self, fence: Fence, dns: steering.Poke) -> None:
        window_s = self.settings.failover.window_s
        judge = False
        while True:
            started = self.clock.now()
            try:
                self.last_pass = await windows.reconcile_once(
                    store=self.store,
                    fence=fence,
                    settings=self.settings,
                    clock=self.clock,
                    judge=judge,
                )
                self.passes += 1
                if not self.etcd_ok:
                    log.warning("etcd reachable again: a grace window, then judging resumes")
                self.etcd_ok = True
                judge = True
                dns.poke()
            except StoreUnavailable as exc:
                if self.etcd_ok:
                    log.warning("etcd unavailable: changing nothing (fail static) error=%s", exc)
                self.etcd_ok = False
                judge = False
                await asyncio.sleep(min(1.0, window_s))
                continue
            except NotLeader:
                log.warning("fenced off: another replica leads; stopping the window loop")
                return
            elapsed = self.clock.now() - started
            # the admin API's policies may change the window: the pass says when to look again
            next_s = self.last_pass.recheck_after_s if self.last_pass else window_s
            await asyncio.sleep(max(0.0, next_s - elapsed))


CONTROLLER = web.AppKey("controller", Controller)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(settings: ControllerSettings, *, clock: Clock | None = None) -> web.Application:
    clock = clock or WallClock()
    store = Store(settings.etcd.endpoints, timeout_s=settings.etcd.timeout_s)
    election = Election(
        store=store, identity=settings.election.id, ttl_s=settings.election.lease_ttl_s, clock=clock
    )
    controller = Controller(settings=settings, clock=clock, store=store, election=election)
    app = web.Application(middlewares=[_problems])
    app[CONTROLLER] = controller
    app.router.add_get("/health", health)
    app.router.add_get("/v1/leader", leader)
    app.router.add_get("/v1/regions", regions)
    app.router.add_get("/v1/plan", plan)
    app.router.add_get("/v1/events", events)
    app.cleanup_ctx.append(_background)
    api = admin.AdminApi(replica=controller)
    app[admin.ADMIN_API] = api
    app.cleanup_ctx.append(admin.serving(api))
    return app


async def _background(app: web.Application) -> AsyncIterator[None]:
    controller = app[CONTROLLER]
    task = asyncio.create_task(
        controller.election.run(controller.lead), name="meridian-controller-election"
    )

    def done(t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("election task crashed", exc_info=t.exception())

    task.add_done_callback(done)
    yield
    await controller.election.resign()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await controller.store.close()


def _problem(status: int, title: str, detail: str) -> web.Response:
    return web.json_response(
        {"type": "about:blank", "title": title, "status": status, "detail": detail},
        status=status,
        content_type="application/problem+json",
    )


@web.middleware
async def _problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except StoreUnavailable as exc:
        return _problem(503, "etcd unavailable", f"{exc}; the fleet is left as it was")
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _problem(exc.status, exc.reason, exc.text or exc.reason)
        raise


async def health(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER]
    last = c.last_pass
    return web.json_response(
        {
            "status": "ok",
            "id": c.election.identity,
            "leading": c.election.leading,
            "leader": c.election.leader,
            "etcd": "ok" if c.etcd_ok else "unavailable",
            "window": last.window if last else None,
            "alert": last.alert if last else None,
        }
    )


async def leader(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER]
    entry = await c.store.get(keys.LEADER)
    return web.json_response(
        {
            "leader": entry.value.decode() if entry else None,
            "revision": entry.create_revision if entry else None,
            "me": c.election.identity,
        }
    )


async def regions(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER]
    view = await fleet.read(c.store, tables=True)
    now = c.clock.now()
    out = {}
    for region, record in sorted(view.regions.items()):
        out[region] = {
            "alive": record.alive,
            "health": record.health.model_dump() if record.health else None,
            "desired": record.desired.model_dump() if record.desired else None,
            "status": record.status.model_dump() if record.status else None,
            "override": record.override.model_dump() if record.override else None,
            "agents": fleet.describe_agents(record),
            "tables": fleet.describe_tables(record, now=now),
        }
    return web.json_response({"regions": out, "bad_values": [str(b) for b in view.bad]})


async def plan(request: web.Request) -> web.Response:
    view = await fleet.read(request.app[CONTROLLER].store)
    body = view.plan.model_dump(exclude={"state", "last_status"})
    return web.json_response(body)


async def events(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER]
    entries = await c.store.get_prefix(keys.EVENTS)
    entries.sort(key=lambda e: e.key)
    out = []
    for entry in entries[-500:]:
        with contextlib.suppress(ValueError):
            out.append(Event.model_validate(json.loads(entry.value)).model_dump())
    return web.json_response({"events": out})
