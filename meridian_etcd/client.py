"""The etcd client both shells use: key-value reads and writes, leases, transactions (guarded by
expected revisions, or fenced by a leader key), and watches.

``Store(ClientConfig(endpoints=[...], timeout_s=2.0))``; ``await store.close()`` when done.  It
connects lazily, on the first call.

**TLS and users.**  ``https://`` endpoints with ``ca_file`` (and ``cert_file``/``key_file`` for
etcd's ``--client-cert-auth``) are dialled over TLS, ``user`` with ``password_file`` authenticates
on each new connection (:mod:`meridian_etcd.security`).  aetcd's client only dials plaintext, so
:class:`_Client` overrides its ``connect`` with the same steps over a channel of ours.  etcd's
tokens lapse (``--auth-token-ttl`` of disuse, a member's restart): a call that meets
:class:`~meridian_etcd.errors.TokenExpired` drops the client, so the next try connects and
authenticates again, on the same member, once.

**Members.**  One client (one gRPC channel) to one member at a time serves every caller.  When a
call finds the member unavailable (refused, timeout, no raft leader, the channel closed under it)
the client is dropped and the call is tried on the next member, once around the list, before it
raises :class:`~meridian_etcd.errors.Unavailable`.  A fresh channel also skips gRPC's reconnect
backoff, which grows to two minutes during a long outage.  When two calls fail on the same
channel, it is dropped once (a concurrent failure never skips a good member), and a call that
failed because another caller closed the channel under it gets one more try on the fresh one.

**Time.**  Every call has a time limit (``timeout_s``): a partition costs a caller that long per
member, never a hang.  gRPC keepalive pings find a dead connection under an open watch.

**Errors.**  Every foreign exception is translated by :func:`meridian_etcd.errors.classify` and
raised as the layer's own, ``from`` the original; our own task's cancellation and exceptions
that are no etcd failure (a bug) propagate as they are.  A task cancelled while its call fails
gets ``CancelledError``, never the call's error: gRPC spends the cancel on the call.

**Fencing.**  :meth:`Store.commit` with ``fence=`` runs one transaction guarded by a
:class:`Fence` (the leader key's create revision and value as they were at election): if another
replica has been elected since, nothing is written and :class:`~meridian_etcd.errors.Fenced` is
raised, even before the old leader notices.

**Counts.**  :attr:`Store.failures` counts the calls that raised, by kind (``unavailable``,
``token_expired``, ``lease_lost``, ``fenced``, ``refused``): a call retried on another member
that then succeeds is no failure.  The shells' metrics read it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import aetcd
import aetcd.watcher
import grpc
import grpc.aio
from aetcd import rpc

from meridian_etcd import endpoints as endpoints_
from meridian_etcd import security
from meridian_etcd.errors import (
    EtcdError,
    Fenced,
    LeaseLost,
    Refused,
    TokenExpired,
    Unavailable,
    classify,
    message_of,
    status_code,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# etcd refuses pings more frequent than every 5 s (--grpc-keepalive-min-time).
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.initial_reconnect_backoff_ms": 500,
    "grpc.max_reconnect_backoff_ms": 5_000,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    """How to reach etcd: the members' client URLs, the time limit of one call, and how to
    prove who the client is (:mod:`meridian_etcd.security`).

    ``ca_file``: the CA that signed the members' certificates (required with ``https://``
    endpoints, refused with ``http://`` ones); ``cert_file`` and ``key_file``: the client
    certificate etcd's ``--client-cert-auth`` asks for, whose CN etcd takes as the user;
    ``user`` with ``password_file`` (or ``password``, a secret kept out of the repr): an etcd
    user authenticated by password.  ``max_txn_ops``: the most operations the members take in one
    transaction (etcd's ``--max-txn-ops``, 128 unless raised there): the bound of
    :meth:`Store.commit_batches`."""

    endpoints: Sequence[str]
    timeout_s: float = 3.0
    max_txn_ops: int = 128
    ca_file: security.PathLike | None = None
    cert_file: security.PathLike | None = None
    key_file: security.PathLike | None = None
    user: str | None = None
    password_file: security.PathLike | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        security.check(  # ValueError naming the bad URL or setting; files are read by the Store
            endpoints=list(self.endpoints),
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            user=self.user,
            password_file=self.password_file,
            password=self.password,
            files=False,
        )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_txn_ops < 2:
            raise ValueError(
                f"max_txn_ops must be >= 2 (etcd's --max-txn-ops), got {self.max_txn_ops}"
            )

    @property
    def tls(self) -> bool:
        """Whether the members are dialled over TLS (``https://``)."""
        return endpoints_.parse(self.endpoints[0]).tls

    def credentials(self) -> security.Credentials:
        """Read the files now; ``ValueError`` naming the one that cannot be read."""
        return security.load(
            tls=self.tls,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            user=self.user,
            password_file=self.password_file,
            password=self.password,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """A key as etcd holds it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int  # revision of the key's last change
    version: int  # changes since the key was created (1 = just created)
    lease: int  # 0: no lease


@dataclass(frozen=True, slots=True, kw_only=True)
class Deleted:
    """A watched key deleted at ``mod_revision``."""

    key: str
    mod_revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Every key under a prefix as of ``revision``."""

    revision: int
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """What :meth:`Store.follow` reports: the key's value (``None``: absent or deleted) as of
    ``revision`` (0 when the key has never existed)."""

    value: bytes | None
    revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    id: int
    ttl_s: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """A key as it was when the caller came to hold it (the leader key at election)."""

    key: str
    value: bytes
    create_revision: int


_AUTH_NOT_ENABLED = "authentication is not enabled"
_INVALID_WATCH_ID = -1  # etcd's answer to a watch it refuses (permission denied, stale token)


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """aetcd's client over a channel of ours: TLS when given credentials, plaintext without.

    ``connect`` does what aetcd 1.0's does (one connection however many callers wait for it;
    authenticate when a user is given and carry the token in the calls' metadata; the stubs
    and the watcher), except that it builds ``grpc.aio.secure_channel`` with the channel
    credentials, and that, as etcd's clientv3 does, a cluster whose auth is not enabled yet is
    used without a token rather than refused (the bootstrap enables it)."""

    _is_connecting: bool  # aetcd's, set in its __init__

    def __init__(
        self, *, channel_credentials: grpc.ChannelCredentials | None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._channel_credentials = channel_credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another caller is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._channel_credentials is None:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            else:
                self.channel = grpc.aio.secure_channel(
                    target, self._channel_credentials, options=options
                )
            self.auth_stub = rpc.AuthStub(self.channel)
            if self._username is not None and self._password is not None:
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                try:
                    reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                except grpc.aio.AioRpcError as exc:
                    if not (
                        exc.code() is grpc.StatusCode.FAILED_PRECONDITION
                        and _AUTH_NOT_ENABLED in (exc.details() or "")
                    ):
                        raise
                else:
                    self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        except BaseException:
            if self.channel is not None:  # authentication failed: no channel left behind
                with contextlib.suppress(Exception):
                    await self.channel.close()
                self._init_channel_attrs()
            raise
        finally:
            self._is_connecting = False


class Store:
    def __init__(self, config: ClientConfig) -> None:
        self._endpoints = endpoints_.parse_all(config.endpoints)
        self._timeout_s = config.timeout_s
        self._config = config
        self._credentials = config.credentials()  # ValueError naming an unreadable file
        self._index = 0
        self._client: aetcd.Client | None = None
        self._generation = 0  # bumped whenever the client is dropped
        self._closed = False
        self._answered_s = float("-inf")  # monotonic time of the last call etcd answered
        self.failures: collections.Counter[str] = collections.Counter()  # calls that raised

    @property
    def endpoint(self) -> str:
        """The URL the store talks to now (or will, at the next call)."""
        return self._endpoints[self._index].url

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(e.url for e in self._endpoints)

    # -- keys ------------------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        got = await self._call(f"get {key}", lambda c: c.get(key.encode()))
        return None if got is None else _entry(got)

    async def get_prefix(self, prefix: str) -> Snapshot:
        got = await self._call(f"get {prefix}*", lambda c: c.get_prefix(prefix.encode()))
        return Snapshot(revision=int(got.header.revision), entries=tuple(_entry(kv) for kv in got))

    async def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        """Write ``key``; returns the store's revision after the write."""
        lease_id = None if lease is None else lease.id
        reply = await self._call(f"put {key}", lambda c: c.put(key.encode(), value, lease=lease_id))
        return int(reply.header.revision)

    async def delete(self, key: str) -> None:
        await self._call(f"delete {key}", lambda c: c.delete(key.encode()))

    # -- transactions ----------------------------------------------------------------------------

    async def commit(
        self,
        *,
        puts: Mapping[str, bytes] | Sequence[tuple[str, bytes]] = (),
        deletes: Sequence[str] = (),
        expect: Mapping[str, int] | None = None,
        fence: Fence | None = None,
        lease: Lease | None = None,
    ) -> int | None:
        """One transaction: put ``puts`` (under ``lease``) and delete ``deletes``, guarded.

        ``expect``: only if every key of it is at that mod revision (0: absent); returns ``None``
        when one is not, and nothing was written.  ``fence``: only while the fence's key is the
        one the caller holds; raises :class:`Fenced` when it is not.  Give one guard or none (an
        unguarded write).  Returns the revision the write made."""
        if expect and fence is not None:
            raise ValueError("commit takes expect= or fence=, not both")
        items = list(puts.items()) if isinstance(puts, Mapping) else list(puts)
        lease_id = None if lease is None else lease.id

        async def run(c: aetcd.Client) -> tuple[bool, int]:
            t = c.transactions
            compare: list[Any] = [t.mod(k.encode()) == rev for k, rev in (expect or {}).items()]
            if fence is not None:
                key = fence.key.encode()
                compare += [t.create(key) == fence.create_revision, t.value(key) == fence.value]
            ops: list[Any] = [t.put(k.encode(), v, lease=lease_id) for k, v in items]
            ops += [t.delete(k.encode()) for k in deletes]
            ok, responses = await c.transaction(compare=compare, success=ops, failure=[])
            revision = 0
            for response in responses:
                kind = response.WhichOneof("response")
                revision = int(getattr(response, kind).header.revision)
                break
            return bool(ok), revision

        ok, revision = await self._call(f"commit {len(items)} puts, {len(deletes)} deletes", run)
        if ok:
            return revision
        if fence is not None:
            raise self._counted(
                Fenced(f"{fence.key} changed: this replica's writes are fenced off")
            )
        return None

    async def commit_batches(
        self,
        *,
        puts: Sequence[tuple[str, bytes]] = (),
        deletes: Sequence[str] = (),
        fence: Fence | None = None,
        last: Mapping[str, bytes] | None = None,
    ) -> int:
        """Write more than one transaction may hold: ``puts`` then ``deletes`` in order, in
        transactions of at most ``max_txn_ops`` operations each, every one guarded by ``fence``,
        and ``last`` together in the final one (give it what must not land before the rest: a
        plan that names what the other keys say).  Not atomic as a whole: when a batch fails
        (:class:`Fenced`, :class:`Unavailable`) the batches before it stay written.  Returns how
        many transactions it took."""
        limit = self._config.max_txn_ops
        tail = list((last or {}).items())
        if len(tail) > limit:
            raise ValueError(f"{len(tail)} keys cannot land in one transaction of {limit}")
        ops: list[tuple[str, bytes | None]] = [*puts, *((k, None) for k in deletes)]
        split = max(0, len(ops) - (limit - len(tail)))  # what does not fit beside ``last``
        head, final = ops[:split], ops[split:]
        batches = [head[i : i + limit] for i in range(0, len(head), limit)]
        batches.append([*final, *tail])
        for batch in batches:
            await self.commit(
                puts=[(k, v) for k, v in batch if v is not None],
                deletes=[k for k, v in batch if v is None],
                fence=fence,
            )
        return len(batches)

    async def claim(self, key: str, value: bytes, *, lease: Lease) -> Entry | None:
        """Create ``key`` under ``lease`` unless it exists; return whatever holds it now
        (``None``: it expired between the two calls; try again)."""

        async def run(c: aetcd.Client) -> None:
            t = c.transactions
            await c.transaction(
                compare=[t.create(key.encode()) == 0],
                success=[t.put(key.encode(), value, lease=lease.id)],
                failure=[],
            )

        await self._call(f"claim {key}", run)
        return await self.get(key)

    # -- leases ----------------------------------------------------------------------------------

    async def grant(self, *, ttl_s: int) -> Lease:
        lease = await self._call("grant a lease", lambda c: c.lease(ttl_s))
        return Lease(id=int(lease.id), ttl_s=int(lease.ttl))

    async def keep_alive(self, lease: Lease) -> int:
        """Refresh the lease; returns the TTL etcd granted again.  :class:`LeaseLost` when etcd
        no longer knows it."""
        reply = await self._call("refresh the lease", lambda c: c.refresh_lease(lease.id))
        ttl = int(getattr(reply, "TTL", 0)) if reply is not None else 0
        if ttl <= 0:
            raise LeaseLost(f"etcd {self.endpoint} no longer knows lease {lease.id:x}")
        return ttl

    async def revoke(self, lease: Lease) -> None:
        """Revoke the lease: the keys under it are deleted at once."""
        await self._call("revoke the lease", lambda c: c.revoke_lease(lease.id))

    # -- watches ---------------------------------------------------------------------------------

    async def follow(self, key: str) -> AsyncGenerator[Change, None]:
        """The key's current value, then each change to it, until the watch stream breaks
        (:class:`Unavailable`).  Level-based: the first item is what etcd holds now, so a caller
        that re-follows after an outage misses nothing that still matters.  Use it under
        ``contextlib.aclosing`` so that the watch is cancelled when the caller stops."""
        watch, generation = await self._start_watch(key, lambda client: client.watch(key.encode()))
        try:
            current = await self.get(key)
            last = 0 if current is None else current.mod_revision
            yield Change(value=None if current is None else current.value, revision=last)
            try:
                async for event in watch:
                    revision = int(event.kv.mod_revision)
                    if revision <= last:
                        continue  # already reported by the read above
                    last = revision
                    self._answered_s = time.monotonic()
                    value = None if _is_delete(event) else bytes(event.kv.value)
                    yield Change(value=value, revision=last)
            except BaseException as exc:
                await self._raise_translated(f"watch {key}", exc, generation)
            raise await self._watch_ended(key, generation)
        finally:
            await self._cancel_watch(watch)

    async def follow_prefix(self, prefix: str) -> AsyncGenerator[Snapshot | Entry | Deleted, None]:
        """Every key under ``prefix`` now (a :class:`Snapshot`), then each change to one of
        them (an :class:`Entry`, or :class:`Deleted`), until the watch stream breaks
        (:class:`Unavailable`).  Level-based like :meth:`follow`."""
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
                    if _is_delete(event):
                        yield Deleted(
                            key=bytes(event.kv.key).decode(),
                            mod_revision=int(event.kv.mod_revision),
                        )
                    else:
                        yield _entry(event.kv)
            except BaseException as exc:
                await self._raise_translated(f"watch {target}", exc, generation)
            raise await self._watch_ended(target, generation)
        finally:
            await self._cancel_watch(watch)

    # -- lifetime --------------------------------------------------------------------------------

    async def diagnose(self) -> str | None:
        """Why a member refuses this client's TLS (:func:`security.probe`), as
        ``"<url>: <reason>"`` for the first member that does; ``None`` without TLS, or when
        every member either cannot be reached or accepts the client."""
        if not self._config.tls:
            return None
        for endpoint in self._endpoints:
            reason = await security.probe(
                endpoint.host,
                endpoint.port,
                ca_file=self._config.ca_file,
                cert_file=self._config.cert_file,
                key_file=self._config.key_file,
                timeout_s=self._timeout_s,
            )
            if reason is not None:
                return f"{endpoint.url}: {reason}"
        return None

    async def close(self) -> None:
        self._closed = True
        await self._drop(self._generation, reason="closing", rotate=False)

    # -- internals -------------------------------------------------------------------------------

    def _connected(self) -> tuple[aetcd.Client, int]:
        if self._closed:
            raise Unavailable("the etcd client is closed")
        if self._client is None:
            endpoint = self._endpoints[self._index]
            if self._generation > 0:  # a new connection: the files again (rotated certificates)
                try:
                    self._credentials = self._config.credentials()
                except ValueError as exc:
                    log.warning("etcd credentials not reloaded, the last good ones kept: %s", exc)
            credentials = self._credentials
            self._client = _Client(
                channel_credentials=credentials.channel,
                host=endpoint.host,
                port=endpoint.port,
                username=credentials.user,
                password=credentials.password,
                timeout=self._timeout_s,
                options=_CHANNEL_OPTIONS,
                connect_wait_timeout=max(1, round(self._timeout_s)),
            )
        return self._client, self._generation

    async def _call(self, what: str, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run ``op(client)``; on an unavailable member, on the next one, once around; on an
        expired token, once more after authenticating again."""
        attempts = len(self._endpoints)
        closed_under_us = False
        reauthenticated = False
        while True:
            client, generation = self._connected()
            try:
                async with asyncio.timeout(self._timeout_s):
                    result = await op(client)
            except BaseException as exc:
                replaced = generation != self._generation  # another caller dropped it first
                error = await self._translate(what, exc, generation)
                if error is None:
                    raise
                if isinstance(error, TokenExpired) and not reauthenticated and not self._closed:
                    reauthenticated = True  # the client was dropped: the next one authenticates
                    continue
                if isinstance(error, Unavailable) and not self._closed:
                    if replaced and isinstance(exc, asyncio.CancelledError) and not closed_under_us:
                        closed_under_us = True  # not this member's fault: once more, not counted
                        continue
                    attempts -= 1
                    if attempts > 0:
                        continue
                    if len(self._endpoints) > 1:
                        error = _unreachable(error, self.endpoints)
                raise self._counted(error) from exc
            self._answered_s = time.monotonic()
            return result

    async def _start_watch(
        self, target: str, start: Callable[[aetcd.Client], Awaitable[Any]]
    ) -> tuple[Any, int]:
        """The watch ``start`` opens on the current client, and that client's generation.

        etcd refuses a watch by answering it created and cancelled at once, with no id (aetcd
        hands back a watch that never yields): for want of permission, or because the stream's
        token expired.  With a password, the client authenticates again and tries once more;
        else, or again refused, :class:`Refused`."""
        for attempt in (1, 2):
            client, generation = self._connected()
            try:
                async with asyncio.timeout(self._timeout_s):
                    watch = await start(client)
            except BaseException as exc:
                await self._raise_translated(f"watch {target}", exc, generation)
            if getattr(watch, "watch_id", None) != _INVALID_WATCH_ID:
                return watch, generation
            await self._cancel_watch(watch)
            if attempt == 1 and self._credentials.password is not None:
                await self._drop(generation, reason="watch refused: authenticating again",
                                 rotate=False)  # fmt: skip
                continue
            break
        raise Refused(f"etcd {self.endpoint}: cannot watch {target}: etcdserver: permission denied")

    async def _watch_ended(self, target: str, generation: int) -> Unavailable:
        """The error for a watch stream that ended without one; drops the client it ran on."""
        # aetcd ends a watch quietly when its client is closed: by us below, or by another
        # caller that met a failure first (and reported it: this one is then stale)
        ended = Unavailable(f"etcd {self.endpoint}: the watch of {target} ended")
        ended.stale = generation != self._generation
        await self._drop(generation, reason="the watch stream ended")
        return ended

    async def _cancel_watch(self, watch: Any) -> None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(watch.cancel(), timeout=self._timeout_s)

    async def _raise_translated(self, what: str, exc: BaseException, generation: int) -> NoReturn:
        error = await self._translate(what, exc, generation)
        if error is None:
            raise exc
        raise self._counted(error) from exc

    def _counted(self, error: EtcdError) -> EtcdError:
        """``error``, counted in :attr:`failures` by its kind (``LeaseLost``: ``lease_lost``)."""
        self.failures[_KIND.sub("_", type(error).__name__).lower()] += 1
        return error

    async def _translate(self, what: str, exc: BaseException, generation: int) -> EtcdError | None:
        """The layer's error for ``exc`` (dropping the client when the member is unavailable);
        ``None`` when ``exc`` must propagate as it is: our own task is being cancelled, or it is
        no etcd failure (a bug to surface, not to hide).  Any other failure of a task being
        cancelled raises ``CancelledError``: the cancel is never lost in the call's error."""
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            if isinstance(exc, asyncio.CancelledError):
                return None
            # gRPC turns a cancel that meets its call's end into the call's error: the task's
            # cancellation was spent on the call and would be lost, and a caller that retries
            # on Unavailable would never stop (a controller whose shutdown hung on it)
            raise asyncio.CancelledError from exc
        kind = classify(exc)
        if kind is None:
            return None
        failed_s = time.monotonic()
        if isinstance(exc, TimeoutError):
            detail = f"no answer within {self._timeout_s:g} s"
        elif isinstance(exc, asyncio.CancelledError):
            detail = "the connection was closed under the call"
        else:
            detail = message_of(exc) + self._hint(exc)
        if kind is TokenExpired and self._credentials.password is None:
            kind = Refused  # no token to renew: only credentials can cure it
            detail += (
                " (etcd has auth enabled: give a user and password file, or a client "
                "certificate whose CN is an etcd user)"
            )
        where = f"etcd {self.endpoint}" + (" unreachable" if kind is Unavailable else "")
        error = kind(f"{where}: cannot {what}: {detail}")
        if isinstance(error, Unavailable):
            await self._drop(generation, reason=detail, rotate=not isinstance(error, TokenExpired))
        error.stale = self._answered_s > failed_s  # another call succeeded meanwhile
        log.debug(
            "etcd call failed what=%s generation=%d kind=%s stale=%s error=%s",
            what,
            generation,
            kind.__name__,
            error.stale,
            error.message,
        )
        return error

    async def _reconnect(self, reason: str) -> None:
        """Drop the client: the next call connects (and authenticates) again, same member."""
        await self._drop(self._generation, reason=reason, rotate=False)

    def _hint(self, exc: BaseException) -> str:
        """What a connection failure of gRPC's usually means here, when it is about TLS."""
        if status_code(exc) is not grpc.StatusCode.UNAVAILABLE:
            return ""
        text = message_of(exc)
        if not self._endpoints[0].tls and "Socket closed" in text:
            return (
                " (a member that serves TLS closes plaintext connections: if it does, write "
                "https:// endpoints and set the CA file)"
            )
        if self._endpoints[0].tls and any(
            m in text for m in ("TSI_", "SSL", "ssl", "handshake", "certificate")
        ):
            return (
                " (the TLS handshake failed: check that the CA file signed the member's "
                "certificate, whose names must include the endpoint's host, and that the "
                "member trusts the client certificate)"
            )
        return ""

    async def _drop(self, generation: int, *, reason: str, rotate: bool = True) -> None:
        """Close the client that failed (once, whoever notices first) and move to the next
        member."""
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


_KIND = re.compile(r"(?<=[a-z])(?=[A-Z])")


def _entry(kv: Any) -> Entry:
    return Entry(
        key=bytes(kv.key).decode(),
        value=bytes(kv.value),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
        version=int(kv.version),
        lease=int(kv.lease),
    )


def _unreachable(error: EtcdError, urls: Sequence[str]) -> Unavailable:
    """The error of a call that every member failed: the last member's, naming them all."""
    last = error.message.split(": ", 1)[-1]
    out = Unavailable(f"etcd unreachable (tried {', '.join(urls)}): {last}")
    out.stale = error.stale
    return out


def _is_delete(event: Any) -> bool:
    return str(event.kind).upper().endswith("DELETE")
