"""etcd through aetcd, with endpoint failover and one place that translates its errors.

``Store`` holds a client to one endpoint of the cluster at a time; when a call fails because the
member is unreachable it moves to the next endpoint and tries again, once around the list,
then raises ``StoreUnavailable``.  Every other aetcd/grpc failure is translated here too.

Fenced writes: ``commit(puts, deletes, fence=...)`` runs one transaction whose guard is the
leader key's create revision (and value).  If another replica has been elected since — its key
has a newer create revision — the guard fails and nothing is written: a deposed leader cannot
write, even if it has not noticed yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import aetcd.exceptions
import grpc

from controlplane.errors import ControllerError, NotLeader, StoreUnavailable

log = logging.getLogger(__name__)

# Refusals that another try cannot fix: a bug or a misconfiguration, raised as they are.
_REFUSED = (
    aetcd.exceptions.InvalidArgumentError,
    aetcd.exceptions.UnauthenticatedError,
    aetcd.exceptions.PreconditionFailedError,
    aetcd.exceptions.DuplicateLeaseError,
)
# Everything else means this member cannot answer now (unreachable, no raft leader yet —
# "context deadline exceeded" while a cluster re-elects): try the next member.
_UNREACHABLE = (
    aetcd.exceptions.ClientError,
    grpc.RpcError,
    OSError,
    asyncio.TimeoutError,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    lease_id: int
    ttl_s: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """The leader key as it was when this replica was elected."""

    key: str
    value: bytes
    create_revision: int


def parse_endpoints(urls: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for url in urls:
        rest = url.split("://", 1)[-1].rstrip("/")
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {url!r} must look like http://host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("at least one etcd endpoint is required")
    return out


class Store:
    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 3.0) -> None:
        self._endpoints = parse_endpoints(endpoints)
        self._timeout_s = timeout_s
        self._index = 0
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._endpoints[self._index]
        return f"http://{host}:{port}"

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(*_UNREACHABLE):
                await client.close()

    def _connect(self) -> aetcd.Client:
        if self._client is None:
            host, port = self._endpoints[self._index]
            self._client = aetcd.Client(
                host=host, port=port, timeout=max(1, round(self._timeout_s))
            )
        return self._client

    async def _call(self, op: str, fn: Any) -> Any:
        """Run ``fn(client)``; on an unreachable member, try the next endpoint."""
        last: BaseException | None = None
        attempts, cancelled = len(self._endpoints), False
        while attempts > 0:
            attempts -= 1
            client = self._connect()
            try:
                async with asyncio.timeout(self._timeout_s + 1):
                    return await fn(client)
            except _REFUSED as exc:
                raise ControllerError(f"etcd refused {op}: {_why(exc)}") from exc
            except (*_UNREACHABLE, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError):
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # our own task is being cancelled: let it be
                    # gRPC cancels the calls of a channel another caller closed (the leader's
                    # keep-alive and its window pass share this store): not this member's
                    # fault, so one more try on a fresh channel
                    if not cancelled:
                        cancelled, attempts = True, attempts + 1
                last = exc
                log.info(
                    "etcd call failed endpoint=%s op=%s error=%s", self.endpoint, op, _why(exc)
                )
                await self._drop(client)
        raise StoreUnavailable(f"etcd unreachable ({op}): {_why(last)}") from last

    async def _drop(self, client: aetcd.Client) -> None:
        """Close ``client`` and move on to the next endpoint, unless another caller whose call
        failed on the same client already did (two failures must not skip a good member)."""
        if self._client is client:
            await self.close()
            self._index = (self._index + 1) % len(self._endpoints)

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        got = await self._call("get", lambda c: c.get(key.encode()))
        return None if got is None else _entry(got)

    async def get_prefix(self, prefix: str) -> list[Entry]:
        async def run(c: aetcd.Client) -> list[Entry]:
            result = await c.get_prefix(prefix.encode())
            return [_entry(kv) for kv in result]

        out: list[Entry] = await self._call("get_prefix", run)
        return out

    # -- writes --------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> None:
        await self._call("put", lambda c: c.put(key.encode(), value, lease=lease))

    async def delete(self, key: str) -> None:
        await self._call("delete", lambda c: c.delete(key.encode()))

    async def commit(
        self,
        puts: Mapping[str, bytes],
        *,
        deletes: Sequence[str] = (),
        fence: Fence | None,
    ) -> None:
        """Write all of ``puts`` and ``deletes`` in one transaction, guarded by ``fence``."""

        async def run(c: aetcd.Client) -> bool:
            t = c.transactions
            ops: list[Any] = [t.put(k.encode(), v) for k, v in puts.items()]
            ops += [t.delete(k.encode()) for k in deletes]
            compare: list[Any] = []
            if fence is not None:
                compare = [
                    t.create(fence.key.encode()) == fence.create_revision,
                    t.value(fence.key.encode()) == fence.value,
                ]
            ok, _ = await c.transaction(compare=compare, success=ops, failure=[])
            return bool(ok)

        if not await self._call("commit", run):
            raise NotLeader("the leader key changed: this replica's writes are fenced off")

    # -- leases and election -----------------------------------------------------------------

    async def grant(self, ttl_s: int) -> Lease:
        lease = await self._call("lease", lambda c: c.lease(ttl_s))
        return Lease(lease_id=int(lease.id), ttl_s=int(lease.ttl))

    async def keep_alive(self, lease: Lease) -> int:
        """Refresh ``lease``; returns the remaining TTL (0 or less: the lease is gone)."""

        async def run(c: aetcd.Client) -> int:
            reply = await c.refresh_lease(lease.lease_id)
            return int(reply.TTL) if reply is not None else 0

        ttl: int = await self._call("keep_alive", run)
        return ttl

    async def revoke(self, lease: Lease) -> None:
        await self._call("revoke", lambda c: c.revoke_lease(lease.lease_id))

    async def claim(self, key: str, value: bytes, lease: Lease) -> Entry:
        """Create ``key`` under ``lease`` unless it exists; return whatever holds it now."""

        async def run(c: aetcd.Client) -> None:
            t = c.transactions
            await c.transaction(
                compare=[t.create(key.encode()) == 0],
                success=[t.put(key.encode(), value, lease=lease.lease_id)],
                failure=[],
            )

        await self._call("claim", run)
        holder = await self.get(key)
        if holder is None:  # expired between the two calls; the next round tries again
            raise NotLeader(f"{key} vanished right after the claim")
        return holder


def _entry(kv: Any) -> Entry:
    return Entry(
        key=kv.key.decode(),
        value=bytes(kv.value),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
        lease=int(kv.lease),
    )


def _why(exc: BaseException | None) -> str:
    if exc is None:
        return "no endpoint answered"
    if isinstance(exc, grpc.RpcError):
        return f"{type(exc).__name__}: {exc.details() if hasattr(exc, 'details') else exc}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
