"""The agent's only door to etcd: a few key-value and lease calls over aetcd, with aetcd's and
grpc's exceptions translated into the agent's own (``regional_agent.errors``)::

    StoreUnavailable   connection refused, timeout, stream broken: retry later
    LeaseLost          etcd no longer knows the lease: grant a new one
    StoreError         anything else etcd refused

One client (one gRPC channel) serves every caller.  When a call finds the endpoint unavailable,
the client is dropped and the next call connects afresh to the next URL in ``endpoints``, so an
agent given every member of an etcd cluster follows the members that answer; a fresh channel
also skips gRPC's reconnect backoff, which grows to two minutes during a long outage.  Every call
has a time limit (``timeout_s``): a partition costs a caller that long, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NewType, NoReturn, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc

from regional_agent.errors import LeaseLost, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

LeaseId = NewType("LeaseId", int)
T = TypeVar("T")

# gRPC keepalive pings find a dead connection (a partition, not a refused one) under an open
# watch stream.  etcd refuses pings more frequent than every 5 s (--grpc-keepalive-min-time).
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.initial_reconnect_backoff_ms": 500,
    "grpc.max_reconnect_backoff_ms": 5_000,
}
_LEASE_NOT_FOUND = "requested lease not found"


@dataclass(frozen=True, slots=True, kw_only=True)
class Value:
    """A key's value as etcd holds it."""

    value: bytes
    mod_revision: int  # revision of the key's last change
    version: int  # changes since the key was created (1 = just created)
    lease: int  # 0: no lease


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyValue:
    """One key of a range read or a watch: ``value`` ``None`` when the key was deleted at
    ``mod_revision``."""

    key: str
    value: bytes | None
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Every key under a prefix as of ``revision``."""

    revision: int
    entries: tuple[KeyValue, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """What :meth:`Store.follow` reports: the key's value (``None``: absent or deleted) as of
    ``revision`` (0 when the key has never existed)."""

    value: bytes | None
    revision: int


class Store:
    """``store = Store(endpoints=["http://127.0.0.1:2379"], timeout_s=2.0)``; ``await
    store.close()`` when done."""

    def __init__(self, *, endpoints: Sequence[str], timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("Store needs at least one etcd endpoint")
        self._endpoints = [_host_port(url) for url in endpoints]
        self._urls = list(endpoints)
        self._timeout_s = timeout_s
        self._index = 0
        self._client: aetcd.Client | None = None
        self._generation = 0  # bumped whenever the client is dropped
        self._closed = False
        self._answered_s = float("-inf")  # monotonic time of the last call etcd answered

    @property
    def endpoint(self) -> str:
        """The URL the store talks to now (or will, at the next call)."""
        return self._urls[self._index]

    # -- leases ----------------------------------------------------------------------------------

    async def grant(self, *, ttl_s: int) -> LeaseId:
        lease = await self._call("grant a lease", lambda c: c.lease(ttl_s))
        return LeaseId(int(lease.id))

    async def keep_alive(self, lease: LeaseId) -> int:
        """Refresh the lease; returns the TTL etcd granted again.  ``LeaseLost`` when etcd no
        longer knows it."""
        reply = await self._call("refresh the lease", lambda c: c.refresh_lease(lease))
        ttl = int(getattr(reply, "TTL", 0)) if reply is not None else 0
        if ttl <= 0:
            raise LeaseLost(f"etcd {self.endpoint} no longer knows lease {lease:x}")
        return ttl

    async def revoke(self, lease: LeaseId) -> None:
        """Revoke the lease: the keys under it are deleted at once."""
        await self._call("revoke the lease", lambda c: c.revoke_lease(lease))

    # -- keys ------------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> int:
        """Write ``key``; returns the store's revision after the write."""
        reply = await self._call(f"put {key}", lambda c: c.put(key.encode(), value, lease=lease))
        return int(reply.header.revision)

    async def get(self, key: str) -> Value | None:
        got = await self._call(f"get {key}", lambda c: c.get(key.encode()))
        if got is None:
            return None
        return Value(
            value=bytes(got.value),
            mod_revision=int(got.mod_revision),
            version=int(got.version),
            lease=int(got.lease),
        )

    async def get_prefix(self, prefix: str) -> Snapshot:
        got = await self._call(f"get {prefix}*", lambda c: c.get_prefix(prefix.encode()))
        entries = tuple(
            KeyValue(
                key=bytes(kv.key).decode(),
                value=bytes(kv.value),
                mod_revision=int(kv.mod_revision),
                lease=int(kv.lease),
            )
            for kv in got
        )
        return Snapshot(revision=int(got.header.revision), entries=entries)

    async def commit(
        self,
        *,
        puts: Sequence[tuple[str, bytes]],
        deletes: Sequence[str],
        expect: Mapping[str, int],
        lease: LeaseId | None,
    ) -> int | None:
        """One transaction: if every key of ``expect`` is at that mod revision (0: absent), put
        ``puts`` (under ``lease``) and delete ``deletes``.  Returns the revision it made, or
        ``None`` when a compare failed and nothing was written."""

        async def txn(c: aetcd.Client) -> tuple[bool, list[Any]]:
            t = c.transactions
            compare = [t.mod(k.encode()) == rev for k, rev in expect.items()]
            ops = [t.put(k.encode(), v, lease=lease) for k, v in puts]
            ops += [t.delete(k.encode()) for k in deletes]
            ok, responses = await c.transaction(compare=compare, success=ops, failure=[])
            return bool(ok), list(responses)

        ok, responses = await self._call(f"commit {len(puts)} puts, {len(deletes)} deletes", txn)
        if not ok:
            return None
        for response in responses:
            kind = response.WhichOneof("response")
            return int(getattr(response, kind).header.revision)
        raise StoreError("etcd committed a transaction without operations")

    async def follow_prefix(self, prefix: str) -> AsyncGenerator[Snapshot | KeyValue, None]:
        """Every key under ``prefix`` now (a :class:`Snapshot`), then each change to one of
        them (a :class:`KeyValue`), until the watch stream breaks (``StoreUnavailable``).
        Level-based like :meth:`follow`; use it under ``contextlib.aclosing``."""
        snapshot = await self.get_prefix(prefix)
        target = f"{prefix}*"
        watch, generation = await self._start_watch(
            target,
            lambda client: client.watch_prefix(
                prefix.encode(), start_revision=snapshot.revision + 1
            ),
        )
        try:
            yield snapshot
            try:
                async for event in watch:
                    self._answered_s = time.monotonic()
                    deleted = str(event.kind).upper().endswith("DELETE")
                    yield KeyValue(
                        key=bytes(event.kv.key).decode(),
                        value=None if deleted else bytes(event.kv.value),
                        mod_revision=int(event.kv.mod_revision),
                        lease=int(event.kv.lease),
                    )
            except BaseException as exc:
                await self._raise_translated(f"watch {target}", exc, generation)
            raise await self._watch_ended(target, generation)
        finally:
            await self._cancel_watch(watch)

    async def follow(self, key: str) -> AsyncGenerator[Change, None]:
        """The key's current value, then each change to it, until the watch stream breaks
        (``StoreUnavailable``).  Level-based: the first item is what etcd holds now, so a caller
        that re-follows after an outage misses nothing that still matters.  Use it under
        ``contextlib.aclosing`` so that the watch is cancelled when the caller stops."""
        watch, generation = await self._start_watch(key, lambda client: client.watch(key.encode()))
        try:
            current = await self.get(key)
            last = 0 if current is None else current.mod_revision
            self._answered_s = time.monotonic()
            yield Change(value=None if current is None else current.value, revision=last)
            try:
                async for event in watch:
                    revision = int(event.kv.mod_revision)
                    if revision <= last:
                        continue  # already reported by the read above
                    last = revision
                    self._answered_s = time.monotonic()
                    deleted = str(event.kind).upper().endswith("DELETE")
                    yield Change(value=None if deleted else bytes(event.kv.value), revision=last)
            except BaseException as exc:
                await self._raise_translated(f"watch {key}", exc, generation)
            raise await self._watch_ended(key, generation)
        finally:
            await self._cancel_watch(watch)

    async def close(self) -> None:
        self._closed = True
        await self._drop(self._generation, reason="closing", rotate=False)

    # -- internals -------------------------------------------------------------------------------

    def _connected(self) -> tuple[aetcd.Client, int]:
        if self._closed:
            raise StoreUnavailable("the store is closed")
        if self._client is None:
            host, port = self._endpoints[self._index]
            self._client = aetcd.Client(
                host=host,
                port=port,
                timeout=self._timeout_s,
                options=_CHANNEL_OPTIONS,
                connect_wait_timeout=max(1, round(self._timeout_s)),
            )
        return self._client, self._generation

    async def _call(self, what: str, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        client, generation = self._connected()
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await op(client)
        except BaseException as exc:
            await self._raise_translated(what, exc, generation)
        self._answered_s = time.monotonic()
        return result

    async def _start_watch(
        self, target: str, start: Callable[[aetcd.Client], Awaitable[Any]]
    ) -> tuple[Any, int]:
        """The watch ``start`` opens on the current client, and that client's generation."""
        client, generation = self._connected()
        try:
            async with asyncio.timeout(self._timeout_s):
                return await start(client), generation
        except BaseException as exc:
            await self._raise_translated(f"watch {target}", exc, generation)

    async def _watch_ended(self, target: str, generation: int) -> StoreUnavailable:
        """The error for a watch stream that ended without one; drops the client it ran on."""
        # aetcd ends a watch quietly when its client is closed: by us below, or by another
        # caller that met a failure first (and reported it: this one is then stale)
        ended = StoreUnavailable(f"etcd {self.endpoint}: the watch of {target} ended")
        ended.stale = generation != self._generation
        await self._drop(generation, reason="the watch stream ended")
        return ended

    async def _cancel_watch(self, watch: Any) -> None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(watch.cancel(), timeout=self._timeout_s)

    async def _raise_translated(self, what: str, exc: BaseException, generation: int) -> NoReturn:
        """Raise the agent's error for ``exc`` (from it), or ``exc`` itself where it must
        propagate as it is (see :meth:`_translate`)."""
        error = await self._translate(what, exc, generation)
        if error is None:
            raise exc
        raise error from exc

    async def _translate(self, what: str, exc: BaseException, generation: int) -> StoreError | None:
        """The agent's error for ``exc``; ``None`` when ``exc`` must propagate as it is (our
        task is being cancelled, or it is not etcd's doing: a bug to surface, not to hide)."""
        failed_s = time.monotonic()
        error = await self._error(what, exc, generation)
        if error is not None:
            error.stale = self._answered_s > failed_s  # another call succeeded meanwhile
            log.debug(
                "etcd call failed what=%s generation=%d stale=%s error=%s",
                what,
                generation,
                error.stale,
                error.message,
            )
        return error

    async def _error(self, what: str, exc: BaseException, generation: int) -> StoreError | None:
        where = f"etcd {self.endpoint}: cannot {what}"
        if isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                return None  # our own task is being cancelled: let it be
            # gRPC cancels the calls of a channel another caller closed: the call failed
            await self._drop(generation, reason="call cancelled by a closed channel")
            return StoreUnavailable(f"{where}: the connection was closed")
        if isinstance(exc, TimeoutError | aetcd.exceptions.ConnectionTimeoutError):
            await self._drop(generation, reason="timeout")
            return StoreUnavailable(f"{where}: no answer within {self._timeout_s:g} s")
        if isinstance(
            exc,
            aetcd.exceptions.ConnectionFailedError
            | aetcd.exceptions.WatchTimeoutError
            | aetcd.exceptions.InternalError
            | aetcd.rpc.RpcError
            | aetcd.rpc.BaseError
            | OSError,
        ):
            await self._drop(generation, reason="unavailable")
            return StoreUnavailable(f"{where}: {_first_line(exc)}")
        if isinstance(exc, aetcd.exceptions.ClientError):
            message = _first_line(exc)
            if _LEASE_NOT_FOUND in message:
                return LeaseLost(f"{where}: {message}")
            return StoreError(f"{where}: {message}")
        return None

    async def _drop(self, generation: int, *, reason: str, rotate: bool = True) -> None:
        """Close the client that failed (once, whoever notices first) and move to the next
        endpoint."""
        if generation != self._generation or self._client is None:
            return
        client, self._client = self._client, None
        self._generation += 1
        if rotate:
            self._index = (self._index + 1) % len(self._endpoints)
        log.debug(
            "etcd client dropped generation=%d reason=%s next=%s", generation, reason, self.endpoint
        )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), timeout=self._timeout_s)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"etcd URL must be http://host:port, got {url!r}")
    return parts.hostname, parts.port or 2379


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
