"""Request ids: one per request, echoed on its response and on every log line it causes.

The id is the client's ``X-Request-ID`` when it sends one (1 to 200 visible ASCII characters;
anything else is a 400 naming the header), else one the agent makes: 32 hex digits like a
uuid4's, unique across processes (a random prefix per process, drawn again in a forked child
such as a ``--workers`` worker) at the cost of a counter.
:func:`middleware` sets it before anything else runs, puts it on every response the agent
answers (errors, 404s and streams too: a stream carries it from its first byte) and in a
context variable that :func:`install_log_ids` appends to every log record made while the
request runs (``... request_id=<id>``).  The node is sent the same id, so the agent's, the
node's and the client's logs meet.

:class:`ResponseHomes` remembers which node made each Responses-API response the agent relayed
(the last :data:`RESPONSE_HOMES`), so ``GET /v1/responses/{id}`` and its cancel reach it.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from policies.model import NodeId
from regional_agent.errors import BadRequest

HEADER: Final = "X-Request-ID"
REQUEST_ID: Final = web.RequestKey("request_id", str)  # the aiohttp request's key for it
RESPONSE_HOMES: Final = 10_000
_MAX_LENGTH: Final = 200
_PREFIX = secrets.token_hex(8)  # this process's: ids stay unique across agents and workers
_COUNTER = itertools.count(1)


def _renew_prefix() -> None:
    """In a forked child: a prefix of its own (the parent's would repeat its ids)."""
    global _PREFIX
    _PREFIX = secrets.token_hex(8)


os.register_at_fork(after_in_child=_renew_prefix)
CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meridian_request_id", default=None
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def new() -> str:
    """A fresh request id."""
    return f"{_PREFIX}{next(_COUNTER):016x}"


def _given(value: str | None) -> str | None:
    """The client's id, if it sent a usable one; a 400 naming the header if not."""
    if value is None or value == "":
        return None
    if len(value) > _MAX_LENGTH or not all("!" <= c <= "~" for c in value):
        raise BadRequest(
            f"the {HEADER} header must be 1 to {_MAX_LENGTH} visible ASCII characters (no "
            "spaces); send a shorter id, or none and the agent makes one"
        )
    return value


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: the id for the request, on its response and its log lines."""
    try:
        request_id = _given(request.headers.get(HEADER)) or new()
    except BadRequest as exc:
        return web.json_response(exc.body(), status=exc.http_status, headers={HEADER: new()})
    request[REQUEST_ID] = request_id
    token = CURRENT.set(request_id)
    try:
        response = await handler(request)
    finally:
        CURRENT.reset(token)
    if not response.prepared:  # a stream's were sent with its first byte
        response.headers[HEADER] = request_id
    return response


_installed = False


def install_log_ids() -> None:
    """Every log record made while a request runs ends in `` request_id=<id>`` (a log record
    factory: it covers every logger of the process, ours and the libraries')."""
    global _installed
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = make(*args, **kwargs)
        request_id = CURRENT.get()
        if request_id is not None and not isinstance(record.args, dict):
            message = str(record.msg)
            if not record.args:
                message = message.replace("%", "%%")
            record.msg = f"{message} request_id=%s"
            record.args = (*(record.args or ()), request_id)
        return record

    logging.setLogRecordFactory(factory)


class ResponseHomes:
    """Response id -> the node that made it, for the last ``capacity`` responses."""

    def __init__(self, capacity: int = RESPONSE_HOMES) -> None:
        self._capacity = capacity
        self._homes: OrderedDict[str, NodeId] = OrderedDict()

    def put(self, response_id: str, node: NodeId) -> None:
        self._homes[response_id] = node
        self._homes.move_to_end(response_id)
        while len(self._homes) > self._capacity:
            self._homes.popitem(last=False)

    def get(self, response_id: str) -> NodeId | None:
        return self._homes.get(response_id)

    def __len__(self) -> int:
        return len(self._homes)
