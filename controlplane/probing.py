"""Probing from outside: this replica's probes of every region's published endpoints.

Every controller replica, leader or not, runs one :class:`Prober` when ``probe.enabled``.  Each
``probe.interval_s`` it reads the regions' published endpoints (from the plan's
``last_status``, one key, so a follower reads what the leader judges), makes a cheap OpenAI call
to each (``GET <endpoint><probe.path>``, ``/v1/models`` by default: the agent answers it without
GPU work), and stores the round as a ``ProbeReport`` under ``controller/probes/<replica>``, under
a lease of its own: a replica that dies or stops probing stops voting.  The leader tallies the
replicas' rounds each window (``policies.probing``, ``reconcile.windows``).

An endpoint is reached when it answers 2xx, or 401/403 (it answered; the probe key was refused:
the round says so).  Anything else fails: no connection, no answer within ``probe.timeout_s``,
a 5xx (a load balancer with no backends answers 502/503), another status.  A bare ``host:port``
endpoint is probed over https.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time
from collections.abc import Callable, Mapping

import aiohttp

import meridian_etcd as etcd
from controlplane.errors import BadValue
from controlplane.reconcile import fleet
from controlplane.settings import ControllerSettings, ProbeSettings
from meridian_service.clock import Clock
from meridian_wire import keys
from meridian_wire.models import EndpointProbe, FleetPlan, ProbeReport

log = logging.getLogger(__name__)

USER_AGENT = "meridian-probe"
_MAX_BODY_BYTES = 1 << 16  # read (and drop) at most this much of an answer


def probe_url(endpoint: str, path: str) -> str:
    """``http://10.0.0.1:8080`` + ``/v1/models``; a bare ``host:port`` is probed over https."""
    base = endpoint.strip().rstrip("/")
    if "://" not in base:
        base = f"https://{base}"
    return base + path


async def probe(
    session: aiohttp.ClientSession,
    endpoint: str,
    *,
    settings: ProbeSettings,
    headers: Mapping[str, str],
    ssl_context: ssl.SSLContext | bool,
) -> EndpointProbe:
    """One probe of one endpoint; never raises."""
    began = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    status: int | None = None
    try:
        async with session.get(
            probe_url(endpoint, settings.path),
            headers=headers,
            timeout=timeout,
            ssl=ssl_context,
            allow_redirects=False,
        ) as resp:
            status = resp.status
            await resp.content.read(_MAX_BODY_BYTES)
    except TimeoutError:
        return EndpointProbe(
            endpoint=endpoint, ok=False, error=f"no answer within {settings.timeout_s:g} s"
        )
    except aiohttp.ClientConnectorError as exc:
        why = exc.os_error.strerror if exc.os_error is not None else None
        return EndpointProbe(endpoint=endpoint, ok=False, error=f"cannot connect: {why or exc}")
    except aiohttp.ClientError as exc:
        return EndpointProbe(endpoint=endpoint, ok=False, error=f"{type(exc).__name__}: {exc}")
    except ValueError as exc:  # a URL aiohttp cannot parse
        return EndpointProbe(endpoint=endpoint, ok=False, error=f"not a URL: {exc}")
    latency_ms = round((time.monotonic() - began) * 1000, 3)
    if 200 <= status < 300:
        return EndpointProbe(endpoint=endpoint, ok=True, status=status, latency_ms=latency_ms)
    if status in (401, 403):
        return EndpointProbe(
            endpoint=endpoint,
            ok=True,
            status=status,
            latency_ms=latency_ms,
            error=f"reached, but {status}: the probe key is refused (probe.api_key_file)",
        )
    return EndpointProbe(
        endpoint=endpoint,
        ok=False,
        status=status,
        latency_ms=latency_ms,
        error=f"answered {status}",
    )


def targets(plan: FleetPlan) -> dict[str, list[str]]:
    """Each region's published endpoints, as the leader last saw them."""
    return {
        region: list(status.endpoints)
        for region, status in sorted(plan.last_status.items())
        if status.endpoints
    }


class Prober:
    """This replica's probe loop (``run``) and its last round (``last``)."""

    def __init__(
        self,
        settings: ControllerSettings,
        *,
        store: etcd.Store,
        clock: Clock,
        on_round: Callable[[ProbeReport], None] | None = None,
    ) -> None:
        self.settings = settings.probe
        self.replica = settings.election.id
        self._key = keys.probes(self.replica)
        self._store = store
        self._clock = clock
        self._on_round = on_round
        self._lease: etcd.Lease | None = None
        self.last: ProbeReport | None = None
        self.rounds = 0

    def session(self) -> aiohttp.ClientSession:
        """The replica's probe client: a fresh connection per probe (a pooled connection would
        prove nothing of the next one), no proxies from the environment."""
        connector = aiohttp.TCPConnector(limit=self.settings.concurrency, force_close=True)
        return aiohttp.ClientSession(connector=connector, trust_env=False)

    def ssl_context(self) -> ssl.SSLContext | bool:
        if self.settings.ca_file is None:
            return True  # the system's CAs
        return ssl.create_default_context(cafile=str(self.settings.ca_file))

    async def run(self) -> None:
        """Probe every ``interval_s`` until cancelled; then revoke the lease (the report goes)."""
        ssl_context = self.ssl_context()
        try:
            async with self.session() as session:
                while True:
                    began = time.monotonic()
                    try:
                        await self.once(session, ssl_context=ssl_context)
                    except Exception:  # a bug must not end this replica's probing for good
                        log.exception("probe round failed; the next one runs as planned")
                    elapsed = time.monotonic() - began
                    await asyncio.sleep(max(0.0, self.settings.interval_s - elapsed))
        finally:
            await self._revoke()

    async def once(
        self, session: aiohttp.ClientSession, *, ssl_context: ssl.SSLContext | bool
    ) -> ProbeReport | None:
        """One round: read the endpoints, probe them all, store the report.  ``None`` when
        etcd did not answer (nothing is probed without knowing what to probe)."""
        try:
            view_plan = await self._plan()
        except etcd.EtcdError as exc:
            log.warning("probe round skipped: etcd did not answer error=%s", exc)
            return None
        wanted = targets(view_plan)
        headers = {"User-Agent": f"{USER_AGENT}/{self.replica}"}
        key = self.settings.api_key()
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        gate = asyncio.Semaphore(self.settings.concurrency)

        async def one(endpoint: str) -> EndpointProbe:
            async with gate:
                return await probe(
                    session, endpoint, settings=self.settings, headers=headers,
                    ssl_context=ssl_context,
                )  # fmt: skip

        flat = [(r, e) for r, endpoints in wanted.items() for e in endpoints]
        results = await asyncio.gather(*(one(e) for _, e in flat))
        regions: dict[str, list[EndpointProbe]] = {}
        for (region, _), result in zip(flat, results, strict=True):
            regions.setdefault(region, []).append(result)
        report = ProbeReport(
            replica=self.replica,
            region=self.settings.region,
            at=self._clock.now(),
            interval_s=self.settings.interval_s,
            regions=regions,
        )
        self.last = report
        self.rounds += 1
        for region, probes in regions.items():
            if not any(p.ok for p in probes):
                log.warning(
                    "probe: region unreachable from this replica region=%s errors=%s",
                    region, "; ".join(f"{p.endpoint} {p.error}" for p in probes),
                )  # fmt: skip
        if self._on_round is not None:
            self._on_round(report)
        try:
            await self._publish(report)
        except etcd.EtcdError as exc:
            log.warning("probe round not stored: etcd did not answer error=%s", exc)
        return report

    async def _plan(self) -> FleetPlan:
        entry = await self._store.get(keys.PLAN)
        if entry is None:
            return FleetPlan()
        bad: list[BadValue] = []
        return fleet.parse(entry, FleetPlan, bad) or FleetPlan()

    async def _publish(self, report: ProbeReport) -> None:
        if self._lease is not None:
            try:
                await self._store.keep_alive(self._lease)
            except etcd.LeaseLost:
                self._lease = None
        if self._lease is None:
            ttl = max(2, math.ceil(self.settings.vote_age_s))
            self._lease = await self._store.grant(ttl_s=ttl)
        await self._store.put(self._key, report.model_dump_json().encode(), lease=self._lease)

    async def _revoke(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(etcd.EtcdError):
                await self._store.revoke(lease)
