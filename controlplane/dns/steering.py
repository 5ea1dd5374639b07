"""The DNS reconcile loop: make every geography's view serve what the fleet plan says.

The leader runs it beside its window loop (``steering(...)`` in ``Controller.lead``) and pokes
it after every window.  One pass is level-based: read the fleet from etcd (the plan's
``serving`` shares, each region's judged state, backup and last endpoints), compute the
desired records (``policies.dns_plan``), read what each view serves, and send each view only
the difference (``rfc2136``) — nothing when nothing changed.  ``dns/applied`` in etcd
(``meridian_wire.models.DnsApplied``) records the generation applied, the records, and the last
error; it is written, fenced, only when one of them changes.

The loop never blocks the window loop.  When the server is down, refuses the key or etcd is
unreachable, the pass fails, the newest plan is kept, and the loop retries with exponential
backoff and jitter (``dns.retry_initial_s`` doubling up to ``dns.retry_max_s``), pokes or not;
the first pass that reaches the server again converges it — after a restart too, since every
pass compares against what the server actually serves.

The ``dry-run`` backend reads the server the same way but only logs the difference it would
send (once per distinct difference).

:class:`DnsStats` keeps what the replica's metrics show (the last pass that left every view as
planned, each view's desired and applied generation, failed passes by kind); the replica hands
the same one to every leadership's steering, so it outlives them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import meridian_etcd as etcd
from controlplane.dns.errors import DnsError, DnsFailed, DnsRefused, DnsUnavailable
from controlplane.dns.rfc2136 import Client, normalize
from controlplane.reconcile import fleet
from controlplane.settings import ControllerSettings
from meridian_service.clock import Clock
from meridian_wire import keys
from meridian_wire.models import DnsApplied, DnsRecord, DnsViewApplied
from policies import dns_plan

log = logging.getLogger(__name__)


def inputs(settings: ControllerSettings, view: fleet.FleetView) -> dns_plan.FleetDns:
    """The policy's view of the fleet: shares, states, endpoints and preference lists."""
    statuses = dict(view.plan.last_status)
    for region, record in view.regions.items():
        if record.status is not None:
            statuses[region] = record.status
    geo_of = {r: s.geo for r, s in statuses.items()}
    geo_of.update({r.id: r.geo for r in settings.regions})
    configured = {r.id: list(r.backups) for r in settings.regions}
    order = [r.id for r in settings.regions] + sorted(set(geo_of) - set(configured))
    states: dict[str, str] = {}
    backups: dict[str, list[str]] = {}
    for region in order:
        known = view.regions.get(region)
        health = known.health if known is not None else None
        if health is not None:
            states[region] = health.state
        first = [health.backup] if health is not None and health.backup else []
        backups[region] = first + configured.get(region, [])
    preferences: dict[str, list[str]] = {}
    for geo in sorted(set(geo_of.values())):
        members = [r for r in order if geo_of.get(r) == geo]
        ranked = list(members)
        for region in members:
            ranked += [b for b in backups.get(region, []) if b not in ranked]
        preferences[geo] = ranked
    return dns_plan.FleetDns(
        serving={g: dict(s) for g, s in view.plan.serving.items()},
        states=states,
        endpoints={r: list(s.endpoints) for r, s in statuses.items()},
        preferences=preferences,
    )


def views_of(settings: ControllerSettings) -> list[dns_plan.ViewSpec]:
    dns = settings.dns
    return [dns_plan.ViewSpec(view=v.name, zone=dns.zone_of(v.name), geo=v.geo) for v in dns.views]


@dataclass(slots=True, kw_only=True)
class DnsStats:
    """What steering did, for the replica's metrics (``controlplane.observability``)."""

    applied_at: float | None = None  # wall time of the last pass that left every view as planned
    desired: dict[str, int] = field(default_factory=dict)  # view -> generation planned
    applied: dict[str, int] = field(default_factory=dict)  # view -> generation it serves
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # failed passes

    def failed(self, exc: BaseException) -> None:
        """A failed pass, by kind: ``unavailable`` (no answer), ``refused`` (REFUSED, NOTAUTH,
        TSIG), ``failed`` (SERVFAIL, a malformed answer), ``etcd`` (unreachable), ``error``."""
        kinds: tuple[tuple[type[BaseException], str], ...] = (
            (DnsUnavailable, "unavailable"),
            (DnsRefused, "refused"),
            (DnsFailed, "failed"),
            (etcd.Unavailable, "etcd"),
        )
        self.errors[next((k for t, k in kinds if isinstance(exc, t)), "error")] += 1


def _reraise_cancel() -> None:
    """A pass that failed while its task was being cancelled ends the task.  Python 3.11's
    ``asyncio.wait_for`` (dnspython's timeouts) can turn a cancel that lands as a query times
    out into ``TimeoutError``; steering then saw a DNS failure, retried, and never ended (a CI
    run hung a controller's shutdown with the DNS server killed)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass(slots=True, kw_only=True)
class Steering:
    settings: ControllerSettings
    store: etcd.Store
    fence: etcd.Fence | None
    clock: Clock
    client: Client
    rng: random.Random = field(default_factory=random.Random)
    desired: dns_plan.DnsPlan | None = None
    applied: DnsApplied | None = None  # as last written to etcd (or read at start)
    updates: int = 0  # update messages sent
    passes: int = 0  # successful passes
    failures: int = 0  # consecutive failed passes
    window: int = 0
    stats: DnsStats = field(default_factory=DnsStats)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _dry_run_seen: dict[str, tuple[dns_plan.Change, ...]] = field(default_factory=dict)
    _held: dict[str, str] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return self.settings.dns.backend

    def poke(self) -> None:
        """A window passed: look again (at once, unless backing off after a failure)."""
        self._wake.set()

    async def run(self) -> None:
        """Passes until cancelled or fenced off; never raises a DNS or etcd error."""
        await self._load_applied()
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.reconcile_once()
            except etcd.Fenced:
                log.warning("dns: fenced off, another replica leads; stopping DNS steering")
                return
            except (DnsError, etcd.Unavailable) as exc:
                _reraise_cancel()
                refused = isinstance(exc, DnsRefused)
                await self._failed(exc)
            except Exception as exc:  # the runner: a bug must not end steering silently
                _reraise_cancel()
                log.exception("dns: pass crashed")
                refused = False
                await self._failed(exc)
            else:
                self.failures = 0
                continue
            delay = min(
                self.settings.dns.retry_max_s,
                self.settings.dns.retry_initial_s * 2 ** (self.failures - 1),
            )
            if refused:  # a configuration problem: retry at the slowest pace
                delay = self.settings.dns.retry_max_s
            await asyncio.sleep(delay * self.rng.uniform(0.8, 1.2))
            self._wake.set()  # retry, with the newest plan

    async def _load_applied(self) -> None:
        with contextlib.suppress(etcd.Unavailable, ValueError):
            entry = await self.store.get(keys.DNS_APPLIED)
            if entry is not None:
                self.applied = DnsApplied.model_validate_json(entry.value)

    async def reconcile_once(self) -> int:
        """One pass; returns the number of update messages sent (or, dry-run, that would be)."""
        view = await fleet.read(self.store)
        self.window = view.plan.window
        previous = None
        if self.desired is not None:
            previous = dns_plan.Generation(
                number=self.desired.generation, fingerprint=self.desired.fingerprint
            )
        elif self.applied is not None and self.applied.fingerprint:
            previous = dns_plan.Generation(
                number=self.applied.generation, fingerprint=self.applied.fingerprint
            )
        dns = self.settings.dns
        plan = dns_plan.plan(
            views_of(self.settings),
            fleet=inputs(self.settings, view),
            names=self.client.names,
            ttl_s=dns.ttl_s,
            window=view.plan.window,
            previous=previous,
        )
        if self.desired is None or plan.generation != self.desired.generation:
            log.info(
                "dns: plan generation=%d reason=%s %s",
                plan.generation, plan.reason,
                " ".join(f"{v.view}=[{v.reason}]" for v in plan.views.values()),
            )  # fmt: skip
        self.desired = plan
        self.stats.desired = dict.fromkeys(plan.views, plan.generation)
        sent = 0
        counts: dict[str, int] = {}
        for name, wanted in plan.views.items():
            if wanted.hold:
                if self._held.get(name) != wanted.reason:
                    log.warning("dns: view=%s held: %s", name, wanted.reason)
                self._held[name] = wanted.reason
                counts[name] = 0
                continue
            records = [normalize(r) for r in wanted.records]
            current = await self.client.read(name, targets=wanted.targets)
            changes = dns_plan.diff(
                records, current, names=self.client.names, zone=wanted.zone,
                targets=wanted.targets,
            )  # fmt: skip
            counts[name] = len(changes)
            self._held.pop(name, None)
            if not changes:
                if self.backend != "dry-run":
                    self.stats.applied[name] = plan.generation
                continue
            if self.backend == "dry-run":
                if self._dry_run_seen.get(name) != changes:
                    self._dry_run_seen[name] = changes
                    for change in changes:
                        log.info("dns dry-run: view=%s would %s", name, change.describe())
                sent += 1
                continue
            await self.client.update(name, changes)
            self.stats.applied[name] = plan.generation
            self.updates += 1
            sent += 1
            log.info(
                "dns: updated view=%s zone=%s generation=%d changes=%s",
                name, wanted.zone, plan.generation,
                "; ".join(c.describe() for c in changes),
            )  # fmt: skip
        self.passes += 1
        if self.backend != "dry-run":
            self.stats.applied_at = self.clock.now()
        await self._record(plan, counts=counts, error=None)
        return sent

    async def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self.stats.failed(exc)
        text = str(exc) or type(exc).__name__
        level = logging.ERROR if isinstance(exc, DnsRefused) else logging.WARNING
        first = self.applied is None or self.applied.error != text
        if first or self.failures == 1:
            what = "refused by the DNS server" if isinstance(exc, DnsRefused) else "apply failed"
            log.log(
                level,
                "dns: %s: %s; keeping the desired state (generation %s), retrying with backoff",
                what, text, self.desired.generation if self.desired is not None else "-",
            )  # fmt: skip
        if isinstance(exc, etcd.Unavailable):
            return
        behind = self.applied is None or (
            self.desired is not None and self.applied.desired_generation != self.desired.generation
        )
        if self.desired is not None and (first or behind):
            with contextlib.suppress(etcd.Unavailable):
                await self._record(self.desired, counts=None, error=text)

    async def _record(
        self, plan: dns_plan.DnsPlan, *, counts: dict[str, int] | None, error: str | None
    ) -> None:
        """Write ``dns/applied`` (fenced) when what it says changed."""
        old = self.applied
        now = self.clock.now()
        if error is not None and old is not None:
            value = old.model_copy(
                update={
                    "desired_generation": plan.generation,
                    "error": error,
                    "error_at": now,
                    "updates": self.updates,
                }
            )
        elif error is not None:
            value = DnsApplied(
                backend=self.backend,
                server=self.settings.dns.address,
                desired_generation=plan.generation,
                error=error,
                error_at=now,
                controller=self._controller(),
            )
        else:
            views = {
                name: DnsViewApplied(
                    view=name,
                    zone=v.zone,
                    geo=v.geo,
                    records=[
                        DnsRecord(name=r.name, type=r.rdtype, ttl_s=r.ttl_s, values=list(r.values))
                        for r in v.records
                    ],
                    hold=v.hold,
                    reason=v.reason,
                    changes=(counts or {}).get(name, 0),
                )
                for name, v in plan.views.items()
            }
            # a dry run sends nothing: the same difference every pass is not news to record
            sent = self.backend != "dry-run" and any((counts or {}).values())
            changed = old is None or old.fingerprint != plan.fingerprint or old.error is not None
            value = DnsApplied(
                backend=self.backend,
                server=self.settings.dns.address,
                generation=plan.generation,
                desired_generation=plan.generation,
                fingerprint=plan.fingerprint,
                window=self.window,
                applied_at=now if old is None or changed or sent else old.applied_at,
                views=views,
                updates=self.updates,
                error=None,
                error_at=None,
                controller=self._controller(),
            )
            if old is not None and not changed and not sent:
                value = value.model_copy(update={"window": old.window, "views": old.views})
        if old is not None and value == old:
            return
        put = {keys.DNS_APPLIED: value.model_dump_json().encode()}
        await self.store.commit(puts=put, fence=self.fence)
        self.applied = value

    def _controller(self) -> str:
        return self.fence.value.decode() if self.fence is not None else ""


class _Off:
    def poke(self) -> None:
        return None


Poke = Steering | _Off


@contextlib.asynccontextmanager
async def steering(
    settings: ControllerSettings,
    *,
    store: etcd.Store,
    fence: etcd.Fence | None,
    clock: Clock,
    stats: DnsStats | None = None,
) -> AsyncIterator[Poke]:
    """DNS steering for the length of a leadership: ``poke()`` it after every window.  With
    ``dns.backend = "off"`` it does nothing.  ``stats``: where it keeps what it did (the
    replica's, across leaderships)."""
    if settings.dns.backend == "off":
        yield _Off()
        return
    for view in settings.dns.views:
        if settings.dns.key(view.name) is None:
            log.warning(
                "dns: view %s has no TSIG key: its updates are unsigned and a server with an "
                "update-policy refuses them",
                view.name,
            )
    steer = Steering(
        settings=settings,
        store=store,
        fence=fence,
        clock=clock,
        client=Client(settings.dns),
        stats=stats or DnsStats(),
    )
    task = asyncio.create_task(steer.run(), name="meridian-controller-dns")

    def done(t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("dns steering task crashed", exc_info=t.exception())

    task.add_done_callback(done)
    try:
        yield steer
    finally:
        task.cancel()
        while not task.done():  # a cancel swallowed in flight (see _reraise_cancel): again
            finished, _ = await asyncio.wait({task}, timeout=1.0)
            if not finished:
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
