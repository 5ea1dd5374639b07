"""``create_app(settings)``: one controller replica — election, the window loop, and its ports.

Every replica campaigns; the leader runs the window loop (``reconcile.windows``), fenced by its
leader key.  With ``probe.enabled`` every replica, leader or not, also probes the regions'
published endpoints (``probing``) and stores its rounds for the leader to tally.

Every replica serves two ports with one set of handlers (``api.routes``):

* ``server.port`` (this app): ``/health`` for supervisors and load balancers, and the admin
  API's reads (``GET /v1/regions``, ``/v1/events``, ... — the same routes, roles and shapes);
  a write here is answered 405 with a pointer to the admin port;
* ``api.port`` (``api.server.serving``, when set): the whole admin API, writes included, over
  TLS when ``api.tls`` is set.

``GET /metrics`` on ``server.port`` is the replica's metrics (``controlplane.observability``):
the port for supervisors and monitoring, with no token, like ``/health``; the admin port has
none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

import meridian_etcd as etcd
from controlplane.api import actions
from controlplane.api import server as admin
from controlplane.dns import steering
from controlplane.election import Election
from controlplane.observability import ControllerMetrics
from controlplane.probing import Prober
from controlplane.reconcile import windows
from controlplane.settings import ControllerSettings
from meridian_service.clock import Clock, WallClock

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class Controller:
    settings: ControllerSettings
    clock: Clock
    store: etcd.Store
    election: Election
    last_pass: windows.PassResult | None = None
    last_pass_s: float | None = None  # how long the last window pass took (monotonic seconds)
    window_etcd_ok: bool = True  # the leader's window loop: did its last pass reach etcd
    passes: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    dns: steering.DnsStats = field(default_factory=steering.DnsStats)  # across leaderships
    metrics: ControllerMetrics | None = None
    prober: Prober | None = None  # with probe.enabled: this replica's probes of the regions

    @property
    def etcd_ok(self) -> bool:
        """Whether etcd answers this replica, leader or not: its election's own calls (every
        replica claims or keeps its lease every TTL/3) and, while leading, the window loop."""
        leading = self.election.leading
        return self.election.etcd_ok is not False and (self.window_etcd_ok or not leading)

    async def lead(self, fence: etcd.Fence) -> None:
        """The leader's work: one reconcile pass per window until leadership ends.

        Fail static: while etcd is unreachable nothing is judged or written.  The first pass
        after it returns (and the first pass of a new leader) judges nothing either: it only
        brings admin states, backups and floors up to date, so agents get one window to
        republish before they can earn a strike for an outage that was not theirs.  DNS
        steering (``controlplane/dns``) runs beside the loop and is poked after every pass.
        """
        async with steering.steering(
            self.settings, store=self.store, fence=fence, clock=self.clock, stats=self.dns
        ) as dns:
            await self._windows(fence, dns)

    async def _windows(self, fence: etcd.Fence, dns: steering.Poke) -> None:
        window_s = self.settings.failover.window_s
        judge = False
        freshness = windows.Freshness()  # what this leadership has seen change
        metrics = self.metrics
        planned: float | None = None  # monotonic time this pass should have started
        while True:
            started = self.clock.now()
            began = time.monotonic()
            try:
                self.last_pass = await windows.reconcile_once(
                    store=self.store,
                    fence=fence,
                    settings=self.settings,
                    clock=self.clock,
                    judge=judge,
                    freshness=freshness,
                    on_commit=metrics.committed if metrics is not None else None,
                )
                self.passes += 1
                self.last_pass_s = time.monotonic() - began
                if metrics is not None:
                    metrics.window(
                        duration_s=self.last_pass_s,
                        lateness_s=0.0 if planned is None else began - planned,
                    )
                if not self.window_etcd_ok:
                    log.warning("etcd reachable again: a grace window, then judging resumes")
                self.window_etcd_ok = True
                judge = True
                dns.poke()
            except etcd.Unavailable as exc:
                if self.window_etcd_ok:
                    log.warning("etcd unavailable: changing nothing (fail static) error=%s", exc)
                self.window_etcd_ok = False
                judge = False
                planned = None  # the retry is no window: lateness counts from the next one
                await asyncio.sleep(min(1.0, window_s))
                continue
            except etcd.Fenced:
                log.warning("fenced off: another replica leads; stopping the window loop")
                return
            except etcd.Refused as exc:
                # etcd answers but will not take this pass (a request over its limits, a
                # permission): another replica would be refused the same, so this one keeps
                # leading, changes nothing and tries again next window (fail static)
                log.error("window pass refused by etcd, nothing changed: %s", exc)
                self.window_etcd_ok = False
                judge = False
                planned = None
                await asyncio.sleep(window_s)
                continue
            elapsed = self.clock.now() - started
            # the admin API's policies may change the window: the pass says when to look again
            next_s = self.last_pass.recheck_after_s if self.last_pass else window_s
            planned = began + max(0.0, next_s - elapsed)
            await asyncio.sleep(max(0.0, next_s - elapsed))


CONTROLLER = web.AppKey("controller", Controller)


def create_app(settings: ControllerSettings, *, clock: Clock | None = None) -> web.Application:
    clock = clock or WallClock()
    store = etcd.Store(settings.etcd.client_config())
    election = Election(
        store=store, identity=settings.election.id, ttl_s=settings.election.lease_ttl_s, clock=clock
    )
    controller = Controller(settings=settings, clock=clock, store=store, election=election)
    metrics = controller.metrics = ControllerMetrics(
        leading=lambda: election.leading,
        etcd_ok=lambda: controller.etcd_ok,
        etcd_failures=store.failures,
        elections=election.elections,
        dns=controller.dns,
        otel=settings.otel,
        instance=settings.election.id,
        regions=[r.id for r in settings.regions],
    )
    if settings.probe.enabled:
        controller.prober = Prober(settings, store=store, clock=clock, on_round=metrics.probed)
    api = admin.AdminApi(
        replica=controller,
        hooks=actions.Hooks(action=metrics.action, committed=metrics.committed),
    )
    app = web.Application(middlewares=[admin.problems], client_max_size=admin.MAX_BODY_BYTES)
    app[CONTROLLER] = controller
    app[admin.ADMIN_API] = api
    admin.add_routes(app, read_only=True)
    app.router.add_get("/metrics", _metrics)
    app.cleanup_ctx.append(_background)
    app.cleanup_ctx.append(admin.serving(api))
    return app


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[CONTROLLER].metrics
    assert metrics is not None  # create_app sets it
    return web.Response(
        body=metrics.render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def _background(app: web.Application) -> AsyncIterator[None]:
    controller = app[CONTROLLER]
    task = asyncio.create_task(
        controller.election.run(controller.lead), name="meridian-controller-election"
    )

    def done(t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("%s crashed", t.get_name(), exc_info=t.exception())

    task.add_done_callback(done)
    probes = None
    if controller.prober is not None:  # every replica probes, leader or not
        probes = asyncio.create_task(controller.prober.run(), name="meridian-controller-probes")
        probes.add_done_callback(done)
    yield
    if probes is not None:
        probes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probes
    await controller.election.resign()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await controller.store.close()
    if controller.metrics is not None:
        await asyncio.to_thread(controller.metrics.shutdown)  # an OTLP flush: off the loop
