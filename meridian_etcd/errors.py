"""The etcd layer's errors, and the one table that translates aetcd's and gRPC's into them.

::

    EtcdError                 message, retryable, stale
    ├── Unavailable           no member answered in time: refused, reset, timeout, no raft leader,
    │   │                     a channel closed under the call.  Retry later (fail static meanwhile)
    │   └── TokenExpired      etcd no longer takes the auth token the client got for its user: it
    │                         expired (--auth-token-ttl, 300 s of disuse), the member restarted
    │                         (simple tokens live in its memory) or the auth store changed.  The
    │                         client authenticates again and retries once by itself
    ├── LeaseLost             etcd no longer knows the lease (it expired, or etcd lost its data):
    │                         grant a new one and put its keys again
    ├── Fenced                a fenced transaction's guard failed: the fence key changed, so the
    │                         caller no longer holds what it was elected to (a deposed leader)
    └── Refused               etcd refused the request itself: a bad argument, authentication or
                              permission, a compacted revision.  Another try cannot fix it

``stale`` is set on an error when another call of the same client succeeded after this one
failed (calls on a connection being replaced can fail late): etcd answers, the failure is old news.

:func:`classify` is the only place that looks at a foreign exception.  Every exception class that
aetcd, ``grpc`` and ``grpc.aio`` define is named in :data:`BY_CLASS` (a test enumerates them, in
the style of httpx's ``test_httpcore_all_exceptions_mapped``), and every gRPC status code but OK in
:data:`BY_STATUS`: aetcd raises its generic ``ClientError`` from the ``AioRpcError`` of a code it
does not map, so the code under it decides.  A few of etcd's answers share a code with others
that mean something else (a lost lease is NOT_FOUND, an expired token UNAUTHENTICATED like a
refused one): :data:`BY_DETAILS` picks them out by code and words before either table.
"""

from __future__ import annotations

import asyncio

import aetcd.exceptions
import grpc
import grpc.aio


class EtcdError(Exception):
    retryable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.stale = False


class Unavailable(EtcdError):
    retryable = True


class TokenExpired(Unavailable):
    """The user's auth token is no longer valid: authenticate again (the client does)."""


class LeaseLost(EtcdError):
    retryable = True


class Fenced(EtcdError):
    """The fence key is no longer the one the caller holds: nothing was written."""


class Refused(EtcdError):
    pass


Kind = type[EtcdError]

# Every gRPC status code but OK.  etcd says "etcdserver: no leader" and "request timed out" with
# UNAVAILABLE, "context deadline exceeded" with DEADLINE_EXCEEDED or UNKNOWN while a cluster
# re-elects, "too many requests" and "database space exceeded" with RESOURCE_EXHAUSTED: all are
# the cluster's state now, not the request's fault, so another member or a later try may answer.
BY_STATUS: dict[grpc.StatusCode, Kind] = {
    grpc.StatusCode.CANCELLED: Unavailable,  # the channel was closed under the call
    grpc.StatusCode.UNKNOWN: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: Refused,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.NOT_FOUND: Refused,  # "requested lease not found": LeaseLost, by its message
    grpc.StatusCode.ALREADY_EXISTS: Refused,
    grpc.StatusCode.PERMISSION_DENIED: Refused,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: Refused,
    grpc.StatusCode.ABORTED: Unavailable,
    grpc.StatusCode.OUT_OF_RANGE: Refused,
    grpc.StatusCode.UNIMPLEMENTED: Refused,
    grpc.StatusCode.INTERNAL: Unavailable,  # this member is in trouble: try the next
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DATA_LOSS: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Refused,  # "invalid auth token": TokenExpired, by its words
}

# Every exception class of aetcd.exceptions, grpc and grpc.aio.  ``None``: decided by the gRPC
# status code under it (an ``AioRpcError`` has one; aetcd's generic ``ClientError`` is raised from
# one), or Unavailable when there is none.
BY_CLASS: dict[type[BaseException], Kind | None] = {
    aetcd.exceptions.ClientError: None,
    aetcd.exceptions.ConnectionFailedError: Unavailable,
    aetcd.exceptions.ConnectionTimeoutError: Unavailable,
    aetcd.exceptions.InternalError: Unavailable,
    aetcd.exceptions.InvalidArgumentError: Refused,
    aetcd.exceptions.UnauthenticatedError: Refused,
    aetcd.exceptions.PreconditionFailedError: Refused,
    aetcd.exceptions.DuplicateLeaseError: Refused,
    aetcd.exceptions.RevisionCompactedError: Refused,
    aetcd.exceptions.WatchTimeoutError: Unavailable,
    grpc.RpcError: None,
    grpc.FutureTimeoutError: Unavailable,
    grpc.FutureCancelledError: Unavailable,
    grpc.aio.BaseError: Unavailable,
    grpc.aio.AbortError: Unavailable,
    grpc.aio.InternalError: Unavailable,
    grpc.aio.UsageError: Unavailable,  # a call on a channel that was closed meanwhile
    grpc.aio.AioRpcError: None,
    # not foreign, but what a call meets on a dead or partitioned member
    OSError: Unavailable,
    TimeoutError: Unavailable,  # our own time limit on the call
    asyncio.CancelledError: Unavailable,  # only when not our own task's: see the client
}

# etcd's answers that a code alone does not tell apart (etcd's api/v3rpc/rpctypes/error.go), by
# code and a phrase of the details.  The client answers a TokenExpired by authenticating again
# (as etcd's own clientv3 refreshes its token on these three); "user name is empty" is what a
# client without a token meets once auth is enabled, which only credentials can cure.
BY_DETAILS: dict[tuple[grpc.StatusCode, str], Kind] = {
    (grpc.StatusCode.NOT_FOUND, "requested lease not found"): LeaseLost,
    (grpc.StatusCode.UNAUTHENTICATED, "invalid auth token"): TokenExpired,
    (grpc.StatusCode.INVALID_ARGUMENT, "revision of auth store is old"): TokenExpired,
    (grpc.StatusCode.INVALID_ARGUMENT, "user name is empty"): TokenExpired,
    # "auth: authentication failed, password was given for no password user": UNKNOWN, which
    # alone would read as a member in trouble
    (grpc.StatusCode.UNKNOWN, "authentication failed"): Refused,
}


def classify(exc: BaseException) -> Kind | None:
    """The error class for ``exc``, or ``None`` when it is no etcd failure (a bug: let it rise).

    An answer of etcd's listed in :data:`BY_DETAILS` is that kind.  Otherwise the most specific
    class in :data:`BY_CLASS` along ``exc``'s MRO decides; where that says ``None``, the gRPC
    status code of ``exc`` (or of the ``AioRpcError`` it was raised from) does.
    """
    for cls in type(exc).__mro__:
        if cls in BY_CLASS:
            code = status_code(exc)
            if code is not None:
                details = message_of(exc)
                for (known, phrase), special in BY_DETAILS.items():
                    if code is known and phrase in details:
                        return special
            kind = BY_CLASS[cls]
            if kind is not None:
                return kind
            if code is None:
                return Unavailable
            return BY_STATUS.get(code, Unavailable)
    return None


def status_code(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status code of ``exc`` or of the ``AioRpcError`` it was raised from."""
    for candidate in (exc, exc.__cause__):
        if isinstance(candidate, grpc.aio.AioRpcError):
            return candidate.code()
    return None


def message_of(exc: BaseException) -> str:
    """One line saying what went wrong: the gRPC details where there are some."""
    for candidate in (exc, exc.__cause__):
        if isinstance(candidate, grpc.aio.AioRpcError) and candidate.details():
            return _first_line(candidate.details() or "")
    text = _first_line(str(exc))
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if isinstance(exc, OSError) else text


def _first_line(text: str) -> str:
    lines = text.strip().splitlines() or [""]
    return lines[0][:300]
