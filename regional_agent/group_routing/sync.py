"""The group routing tables kept in sync with etcd: ``routing/<r>/groups/<kind>-<first>``
(docs/group-tables.md).

Two loops, started by the app beside the publisher's when ``routing.policy`` is ``groups``:

* :meth:`TableSync.watch_loop` reads every range of the region's tables, then follows the
  prefix with a watch; each batch of changes rebuilds the tables the agent routes by
  (``GroupTables``: the stored ranges painted over the assignment, own unpublished moves on
  top).  After a broken watch it reads everything again.  A value that does not parse, or a
  range that does not fit the agent's table, is logged with its key and ignored.
* :meth:`TableSync.flush_loop` publishes the agent's moves at most once per
  ``group_tables.debounce_s`` (``groups.Debouncer``): one transaction per kind, putting ranges
  under the agent's liveness lease (a dead agent's ranges expire with it, and their buckets
  read as the assignment again) and comparing the mod revision of every key it puts or deletes
  with the one the agent last saw (0: absent).  A failed compare means another replica changed
  the same stretch of buckets: the agent reads the table again, its moves are redone on the
  fresh table, and it retries.  Nothing is lost: a move stays pending until a transaction that
  carries it succeeds.

  The ranges an agent published live under its lease.  When the lease is lost and a new one
  granted, the flush loop reads the tables again and republishes, under the new lease and
  revision-guarded as usual, each of its ranges whose key is now absent (one another agent
  wrote since is left as it is: the newer write stands).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

import pydantic

import meridian_etcd as etcd
from meridian_service.clock import Clock
from meridian_wire import keys
from meridian_wire.models import GroupTable
from policies.group_routing import KINDS
from policies.groups import Kind, Range
from regional_agent.errors import TableConflicts
from regional_agent.group_routing.tables import GroupTables, Publish, Stored
from regional_agent.retry import Backoff

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5  # compare failures in a row before backing off


class TableSync:
    def __init__(
        self,
        *,
        store: etcd.Store,
        tables: GroupTables,
        region: str,
        agent_id: str,
        clock: Clock,
        wall: Callable[[], float],
        lease: Callable[[], etcd.Lease | None],
        backoff: Callable[[], Backoff],
        on_answer: Callable[[], None],
        on_failure: Callable[[etcd.EtcdError], None],
    ) -> None:
        self._store = store
        self.tables = tables
        self._region = region
        self._agent_id = agent_id
        self._clock = clock
        self._wall = wall
        self._lease = lease
        self._backoff = backoff
        self._on_answer = on_answer
        self._on_failure = on_failure
        self.writes = 0  # transactions committed
        self.keys_written = 0  # puts and deletes in them
        self.conflicts = 0  # transactions refused by a compare
        self.bad = 0  # values ignored
        self.republished = 0  # own ranges put back after a lost lease
        # the ranges this agent published, and the lease they live under (kind -> first -> ...)
        self._mine: dict[Kind, dict[int, tuple[Range, etcd.Lease, int]]] = {k: {} for k in KINDS}

    # -- reading -------------------------------------------------------------------------------

    async def watch_loop(self) -> None:
        prefix = keys.groups(self._region)
        backoff = self._backoff()
        while True:
            try:
                async with contextlib.aclosing(self._store.follow_prefix(prefix)) as changes:
                    async for item in changes:
                        self._on_answer()
                        backoff.reset()
                        if isinstance(item, etcd.Snapshot):
                            self.load(item)
                        else:
                            self._changed(item)
            except etcd.EtcdError as exc:
                self._on_failure(exc)
            await asyncio.sleep(backoff.next_s())

    async def read(self) -> None:
        """Read every range again (after a failed compare)."""
        self.load(await self._store.get_prefix(keys.groups(self._region)))

    def load(self, snapshot: etcd.Snapshot) -> None:
        stored: dict[Kind, dict[int, Stored]] = {k: {} for k in KINDS}
        unusable: dict[Kind, dict[int, int]] = {k: {} for k in KINDS}
        for kv in snapshot.entries:
            where = self._where(kv.key)
            if where is None:
                continue
            kind, first = where
            r = self._parse(kv, kind, first)
            if r is None:
                unusable[kind][first] = kv.mod_revision
            else:
                stored[kind][first] = Stored(range=r, mod_revision=kv.mod_revision)
        for kind in KINDS:
            self.tables.load(kind, stored[kind], unusable=unusable[kind])

    def _changed(self, kv: etcd.Entry | etcd.Deleted) -> None:
        where = self._where(kv.key)
        if where is None:
            return
        kind, first = where
        if isinstance(kv, etcd.Deleted):
            news = self.tables.changed(kind, first, None, kv.mod_revision)
        else:
            mine = self._mine[kind].get(first)
            if mine is not None and kv.mod_revision > mine[2]:
                del self._mine[kind][first]  # another agent wrote over it: no longer ours
            r = self._parse(kv, kind, first)
            news = self.tables.changed(kind, first, r, kv.mod_revision, unusable=r is None)
        if news:
            self.tables.rebuild(kind)

    def _where(self, key: str) -> tuple[Kind, int] | None:
        where = keys.parse_group_key(key)
        if where is None or where[0] != self._region:
            return None
        _, kind, first = where
        return ("session" if kind == "session" else "prefix"), first

    def _parse(self, kv: etcd.Entry, kind: Kind, first: int) -> Range | None:
        """The range ``kv`` holds, or ``None`` (logged) when it does not parse or fit."""
        region = self._region
        n_buckets = self.tables.settings.n_buckets
        try:
            value = GroupTable.model_validate(json.loads(kv.value))
        except (json.JSONDecodeError, UnicodeDecodeError, pydantic.ValidationError) as exc:
            self._ignore(kv, f"not a GroupTable: {_first_line(exc)}")
            return None
        problem = None
        if value.region != region or value.kind != kind or value.first != first:
            problem = (
                f"value names {value.region}/{value.kind}-{value.first}, the key "
                f"{region}/{kind}-{first}"
            )
        elif value.n_buckets != n_buckets:
            problem = f"a table of {value.n_buckets} buckets; this agent's has {n_buckets}"
        elif value.owner not in self.tables.weights:
            problem = f"group {value.owner!r} is not one of this agent's groups"
        if problem is not None:
            self._ignore(kv, problem)
            return None
        return Range(first=value.first, end=value.end, owner=value.owner)

    def _ignore(self, kv: etcd.Entry, problem: str) -> None:
        self.bad += 1
        log.warning(
            "group table entry ignored key=%s revision=%d problem=%s",
            kv.key,
            kv.mod_revision,
            problem,
        )

    # -- writing -------------------------------------------------------------------------------

    async def flush_loop(self) -> None:
        backoff = self._backoff()
        while True:
            lease = self._lease()
            if lease is not None and self._orphaned(lease):
                try:
                    await self.republish(lease)
                except etcd.EtcdError as exc:
                    self._on_failure(exc)
                    await asyncio.sleep(backoff.next_s())
                    continue
            due = self.tables.due_at()
            now = self._clock.now()
            if due is None or self._lease() is None:
                await asyncio.sleep(0.05)
                continue
            if due > now:
                await asyncio.sleep(min(due - now, 0.05))
                continue
            try:
                await self.flush(now=now)
            except etcd.EtcdError as exc:
                self._on_failure(exc)
                await asyncio.sleep(backoff.next_s())
                continue
            except TableConflicts as exc:
                log.warning("group tables region=%s: %s", self._region, exc.message)
                await asyncio.sleep(backoff.next_s())
                continue
            self._on_answer()
            backoff.reset()

    def _orphaned(self, lease: etcd.Lease) -> bool:
        return any(was != lease for mine in self._mine.values() for _, was, _ in mine.values())

    async def republish(self, lease: etcd.Lease) -> int:
        """Our ranges under an older lease went with it: read the tables again and restore, as
        pending moves, those whose key is now absent.  Returns how many."""
        await self.read()
        restored = 0
        for kind in KINDS:
            known = self.tables.known(kind)
            for first, (r, was, _) in list(self._mine[kind].items()):
                if was == lease:
                    continue
                del self._mine[kind][first]
                if first in known:
                    continue  # written since by another agent: theirs stands
                base = self.tables.base(kind)
                if base.reassign(r.first, r.end, r.owner) == base:
                    continue  # the assignment already: nothing to put back
                self.tables.restore(kind, r)
                restored += 1
        self.republished += restored
        if restored:
            log.info(
                "group table ranges republished region=%s count=%d lease=%x: they expired "
                "with the previous lease",
                self._region,
                restored,
                lease.id,
            )
        return restored

    async def flush(self, *, now: float) -> int:
        """Publish whatever is due for every kind; returns the transactions committed."""
        committed = 0
        for kind in KINDS:
            attempts = 0
            while (publish := self.tables.flush(kind, now=now)) is not None:
                lease = self._lease()
                if lease is None:
                    return committed
                revision = await self._commit(publish, lease)
                if revision is not None:
                    self.tables.published(publish, revision=revision)
                    committed += 1
                    break
                attempts += 1
                self.conflicts += 1
                log.info(
                    "group table compare failed region=%s kind=%s attempt=%d: another agent "
                    "changed these ranges; reading again and redoing %d move(s)",
                    self._region,
                    kind,
                    attempts,
                    publish.moves,
                )
                await self.read()
                if attempts >= MAX_ATTEMPTS:
                    raise TableConflicts(
                        f"group table {kind}: {attempts} compares failed in a row (other agents "
                        "keep changing these ranges); backing off"
                    )
        return committed

    async def _commit(self, publish: Publish, lease: etcd.Lease) -> int | None:
        at = round(self._wall(), 3)
        n_buckets = self.tables.settings.n_buckets
        puts = []
        for r in publish.diff.puts:
            value = GroupTable(
                region=self._region,
                kind=publish.kind,
                first=r.first,
                end=r.end,
                owner=r.owner,
                n_buckets=n_buckets,
                agent=self._agent_id,
                updated_at=at,
            )
            puts.append(
                (keys.group(self._region, publish.kind, r.first), value.model_dump_json().encode())
            )
        deletes = [keys.group(self._region, publish.kind, k) for k in publish.diff.deletes]
        expect = {
            keys.group(self._region, publish.kind, k): rev for k, rev in publish.expect.items()
        }
        revision = await self._store.commit(puts=puts, deletes=deletes, expect=expect, lease=lease)
        if revision is not None:
            mine = self._mine[publish.kind]
            for k in publish.diff.deletes:
                mine.pop(k, None)
            for r in publish.diff.puts:
                mine[r.first] = (r, lease, revision)
            self.writes += 1
            self.keys_written += len(puts) + len(deletes)
            log.debug(
                "group table published region=%s kind=%s puts=%d deletes=%d revision=%d",
                self._region,
                publish.kind,
                len(puts),
                len(deletes),
                revision,
            )
        return revision


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
