"""The publisher: this agent replica's liveness and status in etcd, the controller's wishes for
the region, and (with ``routing.policy = "groups"``) the region's shared group routing tables.

Each replica of a region publishes under its own id ``<a>`` (``region.agent_id``, default
hostname-pid) and its own lease, so replicas never overwrite each other; the controller combines
them.  Loops, started from the app's ``cleanup_ctx`` (``regional_agent.app``):

* :meth:`Publisher.alive_loop` — ``regions/<r>/agents/<a>/alive``: an empty value under a lease
  of ``lease_ttl_s``, refreshed every TTL/3.  A lease etcd no longer knows (it expired during a
  partition, or etcd lost its data) is granted again and the key put again.  About once a
  window the key itself is read back, and put again if it is missing or under another lease.
* :meth:`Publisher.status_loop` — ``regions/<r>/agents/<a>/status``, under the same lease (a
  dead replica's status goes with it): a ``RegionStatus`` built once a ``min_interval_s`` tick,
  written only when :func:`status.decide` says so (a change the controller decides on, a large
  move of load, or the ``window_s`` heartbeat).
* :meth:`Publisher.desired_loop` — ``regions/<r>/desired``: follows the controller's
  ``RegionDesired``; the capacity floor goes to the autoscaler, the admin state is
  acknowledged in the status.  A value that does not parse is logged with its key and ignored;
  the last good one stays in force.
* :meth:`Publisher.replicas_loop` — ``regions/<r>/agents/``: follows which replicas of the
  region are alive (their ``alive`` keys, this one always counted) and hands the count and
  this replica's rank in it to ``on_replicas`` on every change (the tenants' rate-limit
  shares).  When etcd is unreachable the last count stays in force (fail static).
* :meth:`Publisher.actor_loop` — ``regions/<r>/agents/_autoscaler``: with an autoscaler, the
  replica that acts for the region claims this key under its lease (create-if-absent), and
  ``on_actor`` tells its autoscaler whether it holds it; the others stand by and take over once
  the holder's lease is gone.  Unconfirmed for a whole lease TTL (etcd unreachable), it stops
  acting: two replicas never act at once, by the lease's own guarantee.
* :meth:`Publisher.plan_loop` — ``controller/plan``: with spill-over on (``on_plan``), the
  controller's plan, which says which regions serve what, where and how loaded.
* ``TableSync.watch_loop`` and ``TableSync.flush_loop`` (``group_routing/sync.py``) — the group
  tables ``routing/<r>/groups/<kind>-<first>``, when the agent routes by them, under this
  publisher's lease.

With ``--workers N`` every worker publishes as a replica of its own, ``<a>-w<i>``: the
controller combines them as it combines replicas (queue depth, in flight and requests/s
summed, nodes and capacity the largest), and each takes its share of a tenant's rate limit.

The publisher is given what it reads, not the agent: the node pool (for the serving nodes),
the queue depth, the instruments (request totals for the load window, etcd state and write
counters), the callback that hands the desired capacity floor to the autoscaler (none
without one: the floor it reports is then 0), and the one that hands the live replica count
on (``on_replicas(replicas, rank)``; none: the replicas loop is not run).

Fail static: when etcd does not answer, the agent serves on what it knows.  Each loop retries
with backoff and jitter; the change of state (etcd lost, etcd back) is logged once, not every
retry; when etcd answers again, the lease and the status are put back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable

import pydantic

import meridian_etcd as etcd
from meridian_service.clock import Clock
from meridian_wire import keys
from meridian_wire.models import FleetPlan, RegionDesired, RegionStatus
from regional_agent.group_routing import GroupTables, TableSync
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.publisher import status
from regional_agent.publisher.load import LoadWindow
from regional_agent.retry import Backoff
from regional_agent.settings import RegionSettings

log = logging.getLogger(__name__)


class Link:
    """Whether etcd answers, as the loops find it; each change is logged once."""

    def __init__(
        self,
        *,
        instruments: Instruments,
        region: str,
        diagnose: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        self._instruments = instruments
        self._region = region
        self._diagnose = diagnose
        self._diagnosis: asyncio.Task[None] | None = None
        self.up: bool | None = None  # None: not tried yet
        self.changes = 0  # how many times it went down or came back
        self.refused: str | None = None  # why etcd refuses this agent's TLS, when it does

    def ok(self, endpoint: str) -> bool:
        """etcd answered; returns whether it had been down (it came back)."""
        came_back = self.up is False
        if self.up is not True:
            if came_back:
                self.changes += 1
                log.warning("etcd reachable again region=%s etcd=%s", self._region, endpoint)
            else:
                log.info("etcd reachable region=%s etcd=%s", self._region, endpoint)
        self.up = True
        self.refused = None
        self._instruments.etcd_connected = True
        return came_back

    def failed(self, exc: etcd.EtcdError) -> None:
        if exc.stale:
            return  # another call succeeded after this one failed: etcd answers
        if self.up is not False:
            self.changes += 1
            log.warning(
                "etcd unreachable region=%s error=%s: serving on what the agent knows, "
                "retrying with backoff",
                self._region,
                exc.message,
            )
            if self._diagnose is not None and self._diagnosis is None:
                self._diagnosis = asyncio.get_running_loop().create_task(self._why())
        self.up = False
        self._instruments.etcd_connected = False

    async def _why(self) -> None:
        """Once per loss of etcd: is it this agent's certificate (expired, revoked)?  gRPC
        words that the same as a member that is down; only a TLS probe tells them apart."""
        assert self._diagnose is not None
        try:
            reason = await self._diagnose()
        except Exception as exc:  # a diagnosis must never take a loop down
            log.debug("etcd TLS diagnosis failed: %s", exc)
            reason = None
        finally:
            self._diagnosis = None
        self.refused = reason
        if reason is not None:
            log.error(
                "etcd refuses this agent region=%s: %s; renew region.etcd_cert_file and "
                "region.etcd_key_file (or region.etcd_ca_file if the members' CA changed). "
                "Serving on what the agent knows; the controller will see the region's "
                "liveness lapse",
                self._region,
                reason,
            )


class Publisher:
    def __init__(
        self,
        *,
        store: etcd.Store,
        settings: RegionSettings,
        pool: NodePool,
        queue_depth: Callable[[], int],
        instruments: Instruments,
        clock: Clock,
        rng: random.Random,
        on_floor: Callable[[float, dict[str, float]], None] | None = None,
        wall: Callable[[], float] = time.time,
        tables: GroupTables | None = None,
        on_replicas: Callable[[int, int], None] | None = None,
        on_actor: Callable[[bool, str | None], None] | None = None,
        on_plan: Callable[[FleetPlan], None] | None = None,
        agent_id: str | None = None,
    ) -> None:
        self._store = store
        self._settings = settings
        self._pool = pool
        self._queue_depth = queue_depth
        self._instruments = instruments
        self._clock = clock
        self._on_floor = on_floor
        self.on_replicas = on_replicas
        self.on_actor = on_actor
        self.on_plan = on_plan
        self.replicas: tuple[str, ...] = ()  # live replicas of the region, this one included
        self._wall = wall
        self._rng = rng
        self.identity = status.Identity.of(settings, agent_id=default_agent_id())
        if agent_id is not None:  # a worker's, ``<a>-w<i>``: a replica of its own (above)
            self.identity = dataclasses.replace(self.identity, agent_id=agent_id)
        self.region = self.identity.region
        self.agent_id = self.identity.agent_id
        self._timing = status.Timing.of(settings)
        self.link = Link(instruments=instruments, region=self.region, diagnose=store.diagnose)
        self.window = LoadWindow(window_s=settings.window_s)
        self.desired = RegionDesired()  # the last good value; defaults until one is read
        self.desired_revision = 0
        self.written: RegionStatus | None = None  # the last status written
        self._written_at: float | None = None
        self._force: str | None = None  # write the status at the next tick, for this reason
        self._lease: etcd.Lease | None = None
        self._grants = 0
        self.writes: dict[str, int] = {"alive": 0, "status": 0}
        self.tables: TableSync | None = None
        if tables is not None:
            self.tables = TableSync(
                store=store,
                tables=tables,
                region=self.region,
                agent_id=self.agent_id,
                clock=clock,
                wall=wall,
                lease=lambda: self._lease,
                backoff=self._backoff,
                on_answer=self._answered,
                on_failure=self.link.failed,
            )

    # -- what others read --------------------------------------------------------------------

    @property
    def lease(self) -> etcd.Lease | None:
        return self._lease

    def floor(self) -> float:
        """The capacity floor the agent honours: the desired one when an autoscaler acts on
        it, else none."""
        return self.desired.capacity_floor if self._on_floor is not None else 0.0

    def observe(self) -> RegionStatus:
        pool = self._pool
        return status.observe(
            serving=pool.serving(now=self._clock.now()),
            nodes_total=len(pool),
            in_flight=sum(max(0, n.in_flight) for n in pool),
            queue_depth=self._queue_depth(),
            identity=self.identity,
            window=self.window.load(),
            desired=self.desired,
            floor=self.floor(),
            wall_now=self._wall(),
            layout=None if self.tables is None else self.tables.tables.layout(),
            offered=pool.models(),
        )

    # -- liveness ----------------------------------------------------------------------------

    async def alive_loop(self) -> None:
        key = keys.agent_alive(self.region, self.agent_id)
        ttl_s = self._settings.lease_ttl_s
        refresh_s = ttl_s / 3
        backoff = self._backoff()
        checked_at = float("-inf")
        while True:
            try:
                if self._lease is None:
                    lease = await self._store.grant(ttl_s=ttl_s)
                    await self._store.put(key, b"", lease=lease)
                    self._wrote("alive")
                    self._lease = lease
                    checked_at = self._clock.now()
                    log.info(
                        "liveness lease granted region=%s key=%s lease=%x ttl_s=%d",
                        self.region,
                        key,
                        lease.id,
                        ttl_s,
                    )
                    if self._grants:  # granted again: etcd may have lost the status too
                        self._force = self._force or "lease granted again"
                    self._grants += 1
                else:
                    await self._store.keep_alive(self._lease)
                    now = self._clock.now()
                    if now - checked_at >= self._settings.window_s:
                        await self._check_alive(key, self._lease)
                        checked_at = now
                self._answered()
                backoff.reset()
                delay_s = refresh_s
            except etcd.LeaseLost as exc:
                self._answered()
                log.warning(
                    "liveness lease lost region=%s lease=%x error=%s: granting a new one",
                    self.region,
                    0 if self._lease is None else self._lease.id,
                    exc.message,
                )
                self._lease = None
                delay_s = 0.0
            except etcd.EtcdError as exc:
                self.link.failed(exc)
                delay_s = min(backoff.next_s(), refresh_s)
            await asyncio.sleep(delay_s)

    async def actor_loop(self) -> None:
        """Claim the region's autoscaler key while this replica lives; tell ``on_actor``."""
        on_actor = self.on_actor
        if on_actor is None:
            return
        key = keys.autoscaler_actor(self.region)
        ttl_s = self._settings.lease_ttl_s
        confirmed_at = float("-inf")
        claimed: int | None = None  # the lease the last confirmed claim was under
        margin_s = ttl_s / 3  # the lease may run out a little before its holder notices
        acting: bool | None = None
        holder_id: str | None = None
        told: str | None = None  # the holder on_actor was last told of
        backoff = self._backoff()
        while True:
            now = self._clock.now()
            lease = self._lease
            # still ours only while the lease it was claimed under is the one held, and no
            # longer than that lease surely lives since the claim was sent
            mine = (
                acting is True
                and lease is not None
                and lease.id == claimed
                and now - confirmed_at < ttl_s - margin_s
            )
            delay_s = ttl_s / 3 if lease is not None else 0.1  # no lease yet: soon again
            if lease is not None:
                sent = self._clock.now()
                try:
                    got = await self._store.claim(key, self.agent_id.encode(), lease=lease)
                    self._answered()
                    backoff.reset()
                    mine = got is not None and got.lease == lease.id
                    holder_id = None if got is None else got.value.decode(errors="replace")
                    if mine:
                        confirmed_at, claimed = sent, lease.id
                    elif got is None:
                        delay_s = 0.0  # it expired between the two calls: claim again now
                except etcd.EtcdError as exc:
                    self.link.failed(exc)
                    delay_s = min(backoff.next_s(), ttl_s / 3)
            if mine != acting or (not mine and holder_id != told):
                acting, told = mine, holder_id
                if mine:
                    log.info("autoscaler actor: this replica acts region=%s", self.region)
                else:
                    log.info("autoscaler standing by region=%s actor=%s", self.region, holder_id)
                on_actor(mine, holder_id)
            await asyncio.sleep(delay_s)

    async def _check_alive(self, key: str, lease: etcd.Lease) -> None:
        got = await self._store.get(key)
        if got is None or got.lease != lease.id:
            await self._store.put(key, b"", lease=lease)
            self._wrote("alive")
            log.warning(
                "liveness key restored region=%s key=%s (it was %s)",
                self.region,
                key,
                "missing" if got is None else f"under lease {got.lease:x}",
            )

    # -- status ------------------------------------------------------------------------------

    async def status_loop(self) -> None:
        key = keys.agent_status(self.region, self.agent_id)
        tick_s = self._settings.min_interval_s
        backoff = self._backoff()
        retry_at = float("-inf")
        while True:
            now = self._clock.now()
            self.window.sample(self._instruments.totals, now=now)
            lease = self._lease  # the status lives under the liveness lease: none yet, wait
            if now >= retry_at and lease is not None:
                current = self.observe()
                since_s = float("inf") if self._written_at is None else now - self._written_at
                reason = status.decide(
                    written=self.written,
                    current=current,
                    since_write_s=since_s,
                    force=self._force,
                    timing=self._timing,
                )
                if reason is not None:
                    try:
                        await self._store.put(key, current.model_dump_json().encode(), lease=lease)
                    except etcd.LeaseLost:
                        self._answered()
                        self._force = self._force or "lease granted again"
                    except etcd.EtcdError as exc:
                        self.link.failed(exc)
                        retry_at = now + backoff.next_s()
                        self._force = self._force or "etcd back"
                    else:
                        self._answered()
                        backoff.reset()
                        self._status_written(current, reason=reason, now=now)
            await asyncio.sleep(tick_s)

    def _status_written(self, current: RegionStatus, *, reason: str, now: float) -> None:
        first = self.written is None
        self.written = current
        self._written_at = now
        self._force = None
        self._wrote("status")
        level = logging.INFO if first or reason.startswith("changed") else logging.DEBUG
        log.log(
            level,
            'region status written region=%s nodes=%d/%d capacity=%g floor=%g reason="%s"',
            self.region,
            current.nodes_healthy,
            current.nodes_total,
            current.capacity,
            current.capacity_floor,
            reason,
        )

    # -- the controller's plan (spill-over) --------------------------------------------------

    async def plan_loop(self) -> None:
        """Follow ``controller/plan`` and hand each plan that parses to ``on_plan``; one that
        does not is logged and the last good one stays in force (fail static, like etcd's
        silence).  Agents read the plan only with spill-over on: ``regional_agent.spill``."""
        on_plan = self.on_plan
        if on_plan is None:
            return
        backoff = self._backoff()
        while True:
            try:
                async with contextlib.aclosing(self._store.follow(keys.PLAN)) as changes:
                    async for change in changes:
                        self._answered()
                        backoff.reset()
                        if change.value is None:
                            continue  # no controller has planned yet
                        try:
                            plan = FleetPlan.model_validate_json(change.value)
                        except pydantic.ValidationError as exc:
                            log.warning(
                                "malformed plan ignored key=%s revision=%d error=%s: spill-over "
                                "keeps the last good one",
                                keys.PLAN,
                                change.revision,
                                _problems(exc),
                            )
                            continue
                        on_plan(plan)
            except etcd.EtcdError as exc:
                self.link.failed(exc)
            await asyncio.sleep(backoff.next_s())

    # -- desired -----------------------------------------------------------------------------

    async def desired_loop(self) -> None:
        key = keys.desired(self.region)
        backoff = self._backoff()
        while True:
            try:
                async with contextlib.aclosing(self._store.follow(key)) as changes:
                    async for change in changes:
                        self._answered()
                        backoff.reset()
                        self.apply_desired(key, change)
            except etcd.EtcdError as exc:
                self.link.failed(exc)
            await asyncio.sleep(backoff.next_s())

    def apply_desired(self, key: str, change: etcd.Change) -> None:
        """Take a new desired value; a malformed one is logged and ignored."""
        if change.value is None:
            desired = RegionDesired()
            if self.desired_revision != 0 or change.revision != 0:
                log.info(
                    "desired value absent key=%s: defaults apply (active, no capacity floor)", key
                )
        else:
            try:
                desired = RegionDesired.model_validate_json(change.value)
            except pydantic.ValidationError as exc:
                log.warning(
                    "malformed desired value ignored key=%s revision=%d error=%s: keeping "
                    "admin=%s capacity_floor=%g generation=%d",
                    key,
                    change.revision,
                    _problems(exc),
                    self.desired.admin,
                    self.desired.capacity_floor,
                    self.desired.generation,
                )
                return
        self.desired_revision = change.revision
        if desired == self.desired:
            return
        before, self.desired = self.desired, desired
        log.info(
            "desired state region=%s admin=%s weight=%g capacity_floor=%g generation=%d "
            'reason="%s"',
            self.region,
            desired.admin,
            desired.weight,
            desired.capacity_floor,
            desired.generation,
            desired.reason,
        )
        if desired.admin != before.admin and desired.admin != "active":
            log.info(
                "region %s is %s: DNS steers clients away; the agent keeps serving what reaches it",
                self.region,
                desired.admin,
            )
        if self._on_floor is not None:
            self._on_floor(desired.capacity_floor, dict(desired.model_floors))

    # -- replicas ----------------------------------------------------------------------------

    async def replicas_loop(self) -> None:
        """Follow ``regions/<r>/agents/``: which replicas have an ``alive`` key."""
        prefix = keys.agents(self.region)
        backoff = self._backoff()
        while True:
            alive: set[str] = set()
            try:
                async with contextlib.aclosing(self._store.follow_prefix(prefix)) as changes:
                    async for change in changes:
                        self._answered()
                        backoff.reset()
                        if isinstance(change, etcd.Snapshot):
                            alive = {a for e in change.entries if (a := _alive_agent(e.key))}
                        elif isinstance(change, etcd.Entry):
                            if agent := _alive_agent(change.key):
                                alive.add(agent)
                        elif agent := _alive_agent(change.key):
                            alive.discard(agent)
                        self._replicas_seen(alive)
            except etcd.EtcdError as exc:
                self.link.failed(exc)  # the last count stays in force
            await asyncio.sleep(backoff.next_s())

    def _replicas_seen(self, alive: set[str]) -> None:
        replicas = tuple(sorted(alive | {self.agent_id}))
        if replicas == self.replicas:
            return
        self.replicas = replicas
        log.info(
            "agent replicas alive region=%s replicas=%d agents=%s",
            self.region,
            len(replicas),
            ",".join(replicas),
        )
        if self.on_replicas is not None:
            self.on_replicas(len(replicas), replicas.index(self.agent_id))

    # -- stop --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Revoke the lease (the alive key goes at once: a clean stop is not a failure to wait
        out) and close the store.  Best effort: etcd may be down."""
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await self._store.revoke(lease)
                log.info("liveness lease revoked region=%s lease=%x", self.region, lease.id)
            except etcd.EtcdError as exc:
                log.info("liveness lease not revoked (it expires) error=%s", exc.message)
        await self._store.close()

    # -- internals ---------------------------------------------------------------------------

    def _backoff(self) -> Backoff:
        return Backoff(
            base_s=self._settings.retry_base_s, max_s=self._settings.retry_max_s, rng=self._rng
        )

    def _answered(self) -> None:
        if self.link.ok(self._store.endpoint) and self._force is None:
            self._force = "etcd back"

    def _wrote(self, kind: str) -> None:
        self.writes[kind] += 1
        self._instruments.count_store_write(kind=kind)


def default_agent_id() -> str:
    """``hostname-pid``, lowercased, with what a key may not hold replaced by dashes."""
    raw = f"{socket.gethostname()}-{os.getpid()}".lower()
    return re.sub(r"[^a-z0-9._-]", "-", raw).lstrip("._-")[-63:] or f"agent-{os.getpid()}"


def worker_agent_id(agent_id: str, worker: int) -> str:
    """Worker ``worker``'s id among several: ``agent_id`` with ``-w<worker>``, its head cut where
    it must fit the 63 characters a key's id may have (the tail tells agents apart, as in
    :func:`default_agent_id`: the host's end and the pid)."""
    return f"{agent_id}-w{worker}"[-63:].lstrip("._-")


def _alive_agent(key: str) -> str | None:
    """The agent id of a ``regions/<r>/agents/<a>/alive`` key, else None."""
    parsed = keys.parse_agent_key(key)
    return parsed[1] if parsed is not None and parsed[2] == "alive" else None


def _problems(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
    )
