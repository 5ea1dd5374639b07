"""Leader election on an etcd lease, with fenced writes.

Every replica campaigns: it grants a lease and tries to create the leader key under it (a
transaction that succeeds only if the key does not exist).  The replica whose key it is leads;
the others poll until the key disappears (its holder stopped keeping its lease alive).

The leader keeps its lease alive every ``ttl/3``.  If it cannot for longer than the TTL — etcd
unreachable, or the lease gone — it stops its leader work and campaigns again.  A leader that
stepped down only because etcd did not answer keeps its lease and fence: etcd restores leases
with their full TTL when it comes back, so the leader key is still its own, and its first
campaign once etcd answers resumes leading on them (the same fence: nothing another replica
wrote can be overwritten) instead of waiting a whole TTL for its own key to expire.  Its writes are
fenced: each carries the leader key's create revision and value as it was at election
(``meridian_etcd.Fence``), so if another replica has been elected in the meantime the write is
refused by etcd itself, even before the old leader notices.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import meridian_etcd as etcd
from meridian_service.clock import Clock
from meridian_wire import keys

log = logging.getLogger(__name__)

LeaderWork = Callable[[etcd.Fence], Coroutine[Any, Any, None]]


class Election:
    def __init__(self, *, store: etcd.Store, identity: str, ttl_s: int, clock: Clock) -> None:
        if ttl_s < 2:
            raise ValueError("election.lease_ttl_s must be at least 2 seconds")
        self._store = store
        self.identity = identity
        self._ttl_s = ttl_s
        self._clock = clock
        self.fence: etcd.Fence | None = None
        self.leader: str | None = None  # who leads, as last seen
        self.etcd_ok: bool | None = None  # whether etcd answered the last call (None: not yet)
        self._kept: tuple[etcd.Lease, etcd.Fence] | None = None  # see _resume
        # times this replica began leading: "new" (won the key) or "resumed" (kept it through
        # an etcd outage); read by the replica's metrics
        self.elections: collections.Counter[str] = collections.Counter()

    @property
    def leading(self) -> bool:
        return self.fence is not None

    async def run(self, work: LeaderWork) -> None:
        """Campaign forever; while leading, run ``work(fence)`` (cancelled on losing)."""
        while True:
            try:
                await self._campaign(work)
            except etcd.EtcdError as exc:
                self._etcd_failed(exc)
                self.leader = None
                await asyncio.sleep(self._ttl_s / 3)
            except Exception:  # a bug must not end the campaign: this replica would never lead
                log.exception("election: campaign failed; campaigning again")
                self.leader = None
                await asyncio.sleep(self._ttl_s / 3)

    def _etcd_answered(self) -> None:
        if self.etcd_ok is False:
            log.warning("election: etcd reachable again etcd=%s", self._store.endpoint)
        self.etcd_ok = True

    def _etcd_failed(self, exc: etcd.EtcdError) -> None:
        """Logged once per outage, as a WARNING naming the endpoints (a wrong URL at start
        reads here)."""
        if exc.stale:
            return
        if self.etcd_ok is not False:
            log.warning(
                "election: etcd unreachable endpoints=%s error=%s: campaigning again every %g s",
                ",".join(self._store.endpoints),
                exc.message,
                self._ttl_s / 3,
            )
        self.etcd_ok = False

    async def _campaign(self, work: LeaderWork) -> None:
        resumed = await self._resume()
        if resumed is not None:
            lease, holder = resumed
        else:
            lease = await self._store.grant(ttl_s=self._ttl_s)
            claimed = await self._store.claim(keys.LEADER, self.identity.encode(), lease=lease)
            self._etcd_answered()
            if claimed is None:  # expired between the claim and the read: try again next round
                return
            holder = claimed
            if holder.lease != lease.id:
                if self.leader != holder.value.decode():
                    self.leader = holder.value.decode()
                    log.info("election: following leader=%s me=%s", self.leader, self.identity)
                with contextlib.suppress(etcd.EtcdError):
                    await self._store.revoke(lease)
                await asyncio.sleep(self._ttl_s / 3)
                return
        self.fence = etcd.Fence(
            key=keys.LEADER, value=holder.value, create_revision=holder.create_revision
        )
        self.leader = self.identity
        self.elections["resumed" if resumed else "new"] += 1
        log.info(
            "election: %s me=%s revision=%d ttl_s=%d",
            "leading again" if resumed else "leading", self.identity, holder.create_revision,
            self._ttl_s,
        )  # fmt: skip
        task = asyncio.create_task(work(self.fence), name="meridian-controller-leader")
        kept = False
        try:
            kept = await self._hold(lease, task)
        finally:
            self._kept = (lease, self.fence) if kept else None
            self.fence = None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            log.info("election: stepped down me=%s", self.identity)

    async def _resume(self) -> tuple[etcd.Lease, etcd.Entry] | None:
        """The lease and leader key this replica stepped down from while etcd did not answer,
        if both are still its own now that etcd answers; else ``None`` (and they are let go)."""
        if self._kept is None:
            return None
        lease, fence = self._kept
        try:
            await self._store.keep_alive(lease)
        except etcd.LeaseLost:
            self._kept = None  # it expired after all: campaign afresh
            return None
        holder = await self._store.get(keys.LEADER)
        self._etcd_answered()
        if (
            holder is None
            or holder.lease != lease.id
            or holder.create_revision != fence.create_revision
            or holder.value != fence.value
        ):
            self._kept = None
            with contextlib.suppress(etcd.EtcdError):
                await self._store.revoke(lease)
            return None
        self._kept = None
        return lease, holder

    async def _hold(self, lease: etcd.Lease, task: asyncio.Task[None]) -> bool:
        """Keep the lease alive while the leader work runs; return when leadership is lost:
        ``True`` when etcd stopped answering (the lease may still be ours), else ``False``."""
        last_ok = self._clock.now()
        while not task.done():
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self._store.keep_alive(lease)
            except etcd.LeaseLost:
                log.warning("election: the lease expired")
                return False
            except etcd.EtcdError as exc:
                self._etcd_failed(exc)
                if self._clock.now() - last_ok >= self._ttl_s:
                    log.warning(
                        "election: lease not renewed for a whole TTL error=%s: stepping down, "
                        "resuming on the same lease if it is still ours when etcd answers",
                        exc,
                    )
                    return True
                continue
            self._etcd_answered()
            last_ok = self._clock.now()
        if task.cancelled():  # not by us: something inside the work was cancelled
            log.error("leader work ended cancelled; campaigning again")
        elif task.exception() is not None:
            log.error("leader work crashed", exc_info=task.exception())
        return True  # the lease is still ours: the next campaign resumes on it

    async def resign(self) -> None:
        """Give up leadership at once (clean shutdown): delete the key if it is still ours."""
        fence = self.fence or (self._kept[1] if self._kept is not None else None)
        if fence is None:
            return
        with contextlib.suppress(etcd.EtcdError):
            await self._store.commit(deletes=[keys.LEADER], fence=fence)
