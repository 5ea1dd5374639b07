"""Leader election on an etcd lease, with fenced writes.

Every replica campaigns: it grants a lease and tries to create the leader key under it (a
transaction that succeeds only if the key does not exist).  The replica whose key it is leads;
the others poll until the key disappears (its holder stopped keeping its lease alive).

The leader keeps its lease alive every ``ttl/3``.  If it cannot for longer than the TTL — etcd
unreachable, or the lease gone — it stops its leader work and campaigns again.  Its writes are
fenced: each carries the leader key's create revision and value as it was at election
(``store.Fence``), so if another replica has been elected in the meantime the write is refused
by etcd itself, even before the old leader notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from controlplane.errors import NotLeader, StoreUnavailable
from controlplane.store import Lease, Store
from controlplane.store.etcd import Fence
from meridian_service.clock import Clock
from meridian_wire import keys

log = logging.getLogger(__name__)

LeaderWork = Callable[[Fence], Coroutine[Any, Any, None]]


class Election:
    def __init__(self, *, store: Store, identity: str, ttl_s: int, clock: Clock) -> None:
        if ttl_s < 2:
            raise ValueError("election.lease_ttl_s must be at least 2 seconds")
        self._store = store
        self.identity = identity
        self._ttl_s = ttl_s
        self._clock = clock
        self.fence: Fence | None = None
        self.leader: str | None = None  # who leads, as last seen

    @property
    def leading(self) -> bool:
        return self.fence is not None

    async def run(self, work: LeaderWork) -> None:
        """Campaign forever; while leading, run ``work(fence)`` (cancelled on losing)."""
        while True:
            try:
                await self._campaign(work)
            except StoreUnavailable as exc:
                if self.leader is not None:
                    log.warning("election: etcd unavailable, campaigning again error=%s", exc)
                self.leader = None
                await asyncio.sleep(self._ttl_s / 3)
            except Exception:  # a bug must not end the campaign: this replica would never lead
                log.exception("election: campaign failed; campaigning again")
                self.leader = None
                await asyncio.sleep(self._ttl_s / 3)

    async def _campaign(self, work: LeaderWork) -> None:
        lease = await self._store.grant(self._ttl_s)
        try:
            holder = await self._store.claim(keys.LEADER, self.identity.encode(), lease)
        except NotLeader:
            return
        if holder.lease != lease.lease_id:
            if self.leader != holder.value.decode():
                self.leader = holder.value.decode()
                log.info("election: following leader=%s me=%s", self.leader, self.identity)
            with contextlib.suppress(StoreUnavailable):
                await self._store.revoke(lease)
            await asyncio.sleep(self._ttl_s / 3)
            return
        self.fence = Fence(
            key=keys.LEADER, value=holder.value, create_revision=holder.create_revision
        )
        self.leader = self.identity
        log.warning(
            "election: leading me=%s revision=%d ttl_s=%d",
            self.identity, holder.create_revision, self._ttl_s,
        )  # fmt: skip
        task = asyncio.create_task(work(self.fence), name="meridian-controller-leader")
        try:
            await self._hold(lease, task)
        finally:
            self.fence = None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            log.warning("election: stepped down me=%s", self.identity)

    async def _hold(self, lease: Lease, task: asyncio.Task[None]) -> None:
        """Keep the lease alive while the leader work runs; return when leadership is lost."""
        last_ok = self._clock.now()
        while not task.done():
            await asyncio.sleep(self._ttl_s / 3)
            try:
                ttl = await self._store.keep_alive(lease)
            except StoreUnavailable as exc:
                if self._clock.now() - last_ok >= self._ttl_s:
                    log.warning("election: lease not renewed for a whole TTL error=%s", exc)
                    return
                continue
            if ttl <= 0:
                log.warning("election: the lease expired")
                return
            last_ok = self._clock.now()
        if task.cancelled():  # not by us: something inside the work was cancelled
            log.error("leader work ended cancelled; campaigning again")
        elif task.exception() is not None:
            log.error("leader work crashed", exc_info=task.exception())

    async def resign(self) -> None:
        """Give up leadership at once (clean shutdown): delete the key if it is still ours."""
        fence = self.fence
        if fence is None:
            return
        with contextlib.suppress(StoreUnavailable, NotLeader):
            await self._store.commit({}, deletes=[keys.LEADER], fence=fence)
