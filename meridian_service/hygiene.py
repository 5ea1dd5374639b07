"""Connection hygiene for our aiohttp servers: request read timeouts, keep-alive limits, and a cap
on the connections one client address may hold.

aiohttp's server (3.14) closes a connection only when it is idle between requests for its
``keepalive_timeout`` (3630 s by default); nothing bounds how long a client may take to send a
request.  A client that sends its headers a byte at a time, or declares a body and never sends
it, holds a connection and a file descriptor for as long as it likes (slowloris: 300 such
connections held an agent's descriptors at 319 for a minute).  :func:`runner` builds an
``AppRunner`` whose every connection is a :class:`_Connection`, which enforces
:class:`ConnectionLimits`:

* **headers**: a request's line and headers must arrive within ``header_timeout_s`` of the
  connection being accepted, or, on a kept-alive connection, of the first byte of that request;
  else the connection is answered 408 (if it sent anything) and closed.
* **body**: the whole declared body (``Content-Length`` or chunked to the last chunk) must arrive
  within ``body_timeout_s`` of the headers: a deadline, not a gap between chunks, so a client that
  sends a byte a second cannot stretch it.  The handler reading the body gets
  ``web.HTTPRequestTimeout`` (the app's middleware renders a 408; the agent never forwards a
  request whose body it does not have) and the connection is closed after that answer.
* **keep-alive**: an idle connection is closed ``keepalive_timeout_s`` after its last response;
  after ``max_requests_per_connection`` requests the response says ``Connection: close``.
* **per address**: a connection from an address that already holds ``max_connections_per_ip``
  is closed at once, before anything is read.

The timeouts apply to *reading a request*; nothing is armed while a handler runs or a response
is written, so a stream that lasts minutes (SSE from an LLM) is never cut.

The seam, in aiohttp 3.14's internals: :class:`Runner` overrides ``AppRunner._make_server`` to
wrap the ``web.Server`` the app builds in :class:`_Server`, whose ``__call__`` (the protocol
factory ``loop.create_server`` calls per accepted connection) returns a :class:`_Connection`, a
``web.RequestHandler`` subclass.  It hooks ``connection_made``/``connection_lost`` (the cap and
the first deadline), ``data_received`` (a request's first byte; ``_request_count`` rising means
its headers were parsed, and the new message's payload is the last of ``_messages``), the
payload's ``on_eof`` (the body is complete) and ``finish_response`` (a response is written: the
connection is idle again).  It closes with ``force_close()``/``close()``.
tests/test_connection_hygiene.py pins that behaviour against real sockets.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

log = logging.getLogger(__name__)

_REPORT_EVERY_S = 60.0  # summaries of what the limits did, at most this often per kind


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """What one server allows a connection (defaults: the agent's; docs/agent.md, Connections).

    0 turns ``max_requests_per_connection`` and ``max_connections_per_ip`` off.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_requests_per_connection: int = 1000
    max_connections_per_ip: int = 0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_requests_per_connection", "max_connections_per_ip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)!r}")


class Connections:
    """One server's connections: the open ones by client address, and what the limits did.

    ``label`` is the settings group the limits came from (``server``, ``api``), for log lines.
    """

    def __init__(self, limits: ConnectionLimits, *, label: str = "server") -> None:
        self.limits = limits
        self.label = label
        self.by_address: dict[str, int] = {}
        self.accepted = 0  # connections admitted, ever
        self.refused = 0
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.idle_closed = 0
        self.recycled = 0
        self._pending: dict[str, int] = {}
        self._reported: dict[str, float] = {}

    @property
    def open(self) -> int:
        return sum(self.by_address.values())

    def admit(self, address: str) -> bool:
        """Count a new connection from ``address``, or refuse it: that address is at the cap."""
        cap = self.limits.max_connections_per_ip
        held = self.by_address.get(address, 0)
        if cap and address and held >= cap:
            self.refused += 1
            self._report(
                "refused",
                logging.WARNING,
                "refused %d connection(s) over %s=%d (last from %s)",
                f"{self.label}.max_connections_per_ip",
                cap,
                address,
            )
            return False
        self.by_address[address] = held + 1
        self.accepted += 1
        return True

    def release(self, address: str) -> None:
        held = self.by_address.get(address, 0) - 1
        if held > 0:
            self.by_address[address] = held
        else:
            self.by_address.pop(address, None)

    def timed_out(self, what: str, address: str) -> None:
        """A connection closed by a limit: ``header``, ``body`` or ``idle``."""
        if what == "header":
            self.header_timeouts += 1
        elif what == "body":
            self.body_timeouts += 1
        else:
            self.idle_closed += 1
            return  # the normal end of a kept-alive connection: not worth a line
        setting = f"{self.label}.{what}_timeout_s"
        limit = getattr(self.limits, f"{what}_timeout_s")
        log.debug("closed a connection from %s: over %s=%g", address, setting, limit)
        self._report(
            what,
            logging.INFO,
            "closed %d connection(s) that did not send their request in time: %s=%g (last from %s)",
            setting,
            limit,
            address,
        )

    def _report(self, kind: str, level: int, message: str, *args: object) -> None:
        """Log ``message`` with the count since the last line of this kind, at most once per
        minute: a flood of bad connections must not become a flood of log lines."""
        self._pending[kind] = self._pending.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._reported.get(kind, -_REPORT_EVERY_S) < _REPORT_EVERY_S:
            return
        count = self._pending.pop(kind)
        self._reported[kind] = now
        log.log(level, message, count, *args)


class Runner(web.AppRunner):
    """An ``AppRunner`` whose server applies ``limits`` to every connection it accepts."""

    __slots__ = ("connections",)

    def __init__(
        self,
        app: web.Application,
        limits: ConnectionLimits,
        *,
        label: str = "server",
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self.connections = Connections(limits, label=label)

    async def _make_server(self) -> web.Server:
        return _Server(await super()._make_server(), self.connections)


def runner(
    app: web.Application, limits: ConnectionLimits, *, label: str = "server", **kwargs: Any
) -> Runner:
    """``app``'s runner with ``limits`` applied; ``kwargs`` go to ``web.AppRunner``
    (``handler_cancellation``, ``access_log``, ...).  ``label`` names the settings group in logs.
    Start sites on it with :func:`site` (or as on any runner, ``web.TCPSite(runner, host,
    port)``, which leaves a TLS handshake asyncio's 60 s)."""
    _check_aiohttp()
    return Runner(app, limits, label=label, **kwargs)


class Site(web.TCPSite):
    """A TCP site whose TLS handshakes must complete within the runner's ``header_timeout_s``
    (asyncio's ``ssl_handshake_timeout``; else 60 s), so a client that opens a connection and
    never finishes its ClientHello is cut as one that never sends its headers is."""

    __slots__ = ("_handshake_timeout_s",)

    def __init__(
        self,
        runner: Runner,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
        self._handshake_timeout_s = runner.connections.limits.header_timeout_s

    async def start(self) -> None:
        if self._ssl_context is None:
            await super().start()
            return
        self._runner._reg_site(self)  # BaseSite.start; then TCPSite.start's create_server, timed
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout_s,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    @property
    def bound_port(self) -> int:
        """The port the site listens on (the one picked when it was asked for 0)."""
        server = self._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else int(self._port)


def site(
    runner: Runner,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    reuse_port: bool = False,
) -> Site:
    """A site of ``runner`` on ``host:port``, HTTPS with ``ssl_context`` (see :class:`Site`);
    ``reuse_port``: bound with SO_REUSEPORT, beside other processes' sockets on the port."""
    return Site(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port)


def _check_aiohttp() -> None:
    """Refuse to start on an aiohttp whose ``RequestHandler`` lacks what :class:`_Connection`
    relies on, rather than serve without limits."""
    slots = set(getattr(web.RequestHandler, "__slots__", ()))
    missing = {"_request_count", "_messages"} - slots
    missing |= {
        name
        for name in ("finish_response", "data_received", "force_close", "close")
        if not callable(getattr(web.RequestHandler, name, None))
    }
    if missing or not hasattr(web.AppRunner, "_make_server"):
        raise RuntimeError(
            "meridian_service.hygiene does not know this aiohttp's server internals (missing: "
            f"{', '.join(sorted(missing)) or 'AppRunner._make_server'}); it was written "
            "against aiohttp 3.14"
        )


# -- the mechanism ------------------------------------------------------------------------------


class _Server(web.Server):
    """The app's ``web.Server``, rebuilt so that each accepted connection is a
    :class:`_Connection`; its request factory marks a connection's last request."""

    def __init__(self, plain: web.Server, connections: Connections) -> None:
        super().__init__(
            plain.request_handler,
            request_factory=_recycling(plain.request_factory, connections),
            handler_cancellation=plain.handler_cancellation,
            **plain._kwargs,
        )
        self.guard = connections

    def __call__(self) -> _Connection:
        return _Connection(self, loop=self._loop, connections=self.guard, **self._kwargs)


def _recycling(
    make: Callable[..., web.BaseRequest], connections: Connections
) -> Callable[..., web.BaseRequest]:
    """The request factory, marking a connection's ``max_requests_per_connection``-th request
    ``should_close`` so that its response says ``Connection: close`` and aiohttp closes after it
    (clients reconnect, and an L4 balancer spreads them over the replicas again)."""
    cap = connections.limits.max_requests_per_connection

    def factory(
        message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        last = cap and isinstance(protocol, _Connection) and protocol.answered + 1 >= cap
        if last and not message.should_close:
            connections.recycled += 1
            message = message._replace(should_close=True)
        return make(message, payload, protocol, writer, task)

    return factory


class _Payload(Protocol):
    def is_eof(self) -> bool: ...
    def on_eof(self, callback: Callable[[], None]) -> None: ...
    def feed_eof(self) -> None: ...
    def set_exception(self, exc: BaseException) -> None: ...


# A timer may fire this much before its time (uvloop's clock counts milliseconds): a deadline
# that close is taken as reached, not waited for again
_TIMER_RESOLUTION_S = 0.001

# What a connection is doing, as far as reading requests goes.
_NEW = "new"  # accepted, nothing received: the first request's header deadline runs
_HEADERS = "headers"  # a request's first bytes arrived, not all its headers: header deadline
_BODY = "body"  # the last request's headers arrived, not all its body: body deadline
_BUSY = "busy"  # every request read; a response is owed: no deadline (handlers, streams)
_IDLE = "idle"  # every response written, kept alive: keep-alive deadline
_CLOSING = "closing"  # a limit was hit: no further request on this connection


class _Connection(web.RequestHandler):
    """aiohttp's protocol for one connection, with the deadlines of :class:`ConnectionLimits`.

    The phase the connection is in (see the constants above) has one deadline, and one timer
    waits for it, lazily: a phase that begins sets its deadline and leaves a timer that fires no
    later alone; a timer that fires before the deadline is set again for it.  A timer is set at
    most the shortest of the three timeouts ahead (``_step``), so the next phase's deadline is
    never before it: a request on a kept-alive connection (idle, headers, busy, idle again) sets
    no timer and cancels none, where each phase used to (two timers set and two cancelled a
    request); a connection's timer fires about once every ``_step`` instead.
    """

    __slots__ = ("_address", "_answered", "_body", "_clock", "_deadline", "_guard", "_phase",
                 "_refused", "_step", "_timer", "_timer_at")  # fmt: skip

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        connections: Connections,
        **kwargs: Any,
    ) -> None:
        limits = connections.limits
        # aiohttp's own idle close stays, as a backstop that never fires before ours
        kwargs["keepalive_timeout"] = limits.keepalive_timeout_s + limits.header_timeout_s
        super().__init__(manager, loop=loop, **kwargs)
        self._guard = connections
        self._clock = loop
        self._address = ""
        self._phase = _NEW
        self._deadline = math.inf  # the phase's, in the loop's time; none while busy
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # when the timer fires; never after the deadline
        self._step = min(limits.header_timeout_s, limits.body_timeout_s, limits.keepalive_timeout_s)
        self._body: _Payload | None = None
        self._answered = 0
        self._refused = False

    @property
    def answered(self) -> int:
        """Responses written on this connection."""
        return self._answered

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._guard.admit(self._address):
            self._refused = True  # never handed to aiohttp: nothing is read, no task
            transport.close()
            return
        super().connection_made(transport)
        self._arm(_NEW, self._guard.limits.header_timeout_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._disarm()
        self._phase = _CLOSING
        self._guard.release(self._address)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if data and self._phase == _IDLE:  # the next request on a kept-alive connection begins
            self._arm(_HEADERS, self._guard.limits.header_timeout_s)
        elif data and self._phase == _NEW:  # the deadline stays: from the connection's accept
            self._phase = _HEADERS
        before = self._request_count
        super().data_received(data)
        if self._request_count != before and self._messages and self._phase != _CLOSING:
            self._read_body(self._messages[-1][1])  # the newest request's headers are in

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if self._phase == _CLOSING and not resp.prepared:
            resp.force_close()  # the 408 of a body that did not arrive says Connection: close
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._answered += 1
            if self._phase == _BUSY:
                self._settle()

    # -- the phases -----------------------------------------------------------------------------

    def _read_body(self, payload: _Payload) -> None:
        if payload.is_eof():
            self._settle()
            return
        self._body = payload
        self._arm(_BODY, self._guard.limits.body_timeout_s)
        payload.on_eof(functools.partial(self._body_read, payload))

    def _body_read(self, payload: _Payload) -> None:
        if self._body is payload and self._phase == _BODY:
            self._body = None
            self._settle()

    def _settle(self) -> None:
        """Nothing is being read: busy while a response is owed, else idle (kept alive)."""
        if self._phase == _CLOSING:
            return
        if self._request_count > self._answered:
            self._deadline = math.inf  # busy: no deadline (a timer left fires and ends)
            self._phase = _BUSY
        else:
            self._arm(_IDLE, self._guard.limits.keepalive_timeout_s)

    def _arm(self, phase: str, delay_s: float) -> None:
        """Enter ``phase``, whose deadline is ``delay_s`` from now (the class docstring)."""
        self._phase = phase
        now = self._clock.time()
        deadline = self._deadline = now + delay_s
        if deadline < self._timer_at:  # no timer, or one that fires too late
            self._set_timer(now, deadline)

    def _set_timer(self, now: float, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        at = self._timer_at = min(deadline, now + self._step)
        self._timer = self._clock.call_at(at, self._tick)

    def _disarm(self) -> None:
        self._deadline = math.inf
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf

    def _tick(self) -> None:
        """The timer fired: the phase's time is up, or a timer is set again for its deadline,
        or (busy) none."""
        self._timer, self._timer_at = None, math.inf
        now = self._clock.time()
        if now + _TIMER_RESOLUTION_S >= self._deadline:
            self._expired()
        elif self._deadline < math.inf:
            self._set_timer(now, self._deadline)

    def _expired(self) -> None:
        self._deadline = math.inf
        phase = self._phase
        if phase in (_NEW, _HEADERS):
            self._guard.timed_out("header", self._address)
            if phase == _HEADERS and self.transport is not None:
                limit = self._guard.limits.header_timeout_s
                self.transport.write(
                    _timeout_response(
                        f"the request line and headers did not arrive within {limit:g} s "
                        f"({self._guard.label}.header_timeout_s)\n"
                    )
                )
            self._phase = _CLOSING
            self.force_close()
        elif phase == _IDLE:
            self._guard.timed_out("idle", self._address)
            self._phase = _CLOSING
            self.force_close()
        elif phase == _BODY:
            self._body_expired()

    def _body_expired(self) -> None:
        payload, self._body = self._body, None
        self._phase = _CLOSING
        self._guard.timed_out("body", self._address)
        if payload is None:  # pragma: no cover - the body phase always has its payload
            self.force_close()
            return
        if self._request_count > self._answered:
            # A handler owes this request an answer: its read of the body fails with 408 (the
            # app's middleware renders it), no further request is read, and aiohttp closes the
            # connection once that answer is written.  Marking the payload at EOF skips
            # aiohttp's lingering read of the rest.
            limit = self._guard.limits.body_timeout_s
            payload.set_exception(
                web.HTTPRequestTimeout(
                    text=f"the request body did not arrive within {limit:g} s "
                    f"({self._guard.label}.body_timeout_s)"
                )
            )
            payload.feed_eof()
            self.close()
        else:  # answered already (its handler did not read the body): nothing left to say
            payload.feed_eof()
            self.force_close()


def _timeout_response(text: str) -> bytes:
    body = text.encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
        f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
