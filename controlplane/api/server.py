"""The admin API's aiohttp app, served by every controller replica on its own port.

``create_app`` (controlplane/app.py) builds an :class:`AdminApi` and appends :func:`serving` to
its ``cleanup_ctx``: the admin site starts and stops with the replica, on ``api.host:api.port``
(``--admin-port``), over HTTPS when ``api.tls`` names a certificate and key
(``meridian_service.tls.ServerTls``, read again on SIGHUP, as the agent's listener).

**Any replica answers; writes go through the leader.**  Reads come from etcd on the replica
that receives them.  A write (an action, ``PUT /v1/policies``) on a follower is authenticated
there, then forwarded as it is (token, body, ``Idempotency-Key``) to the leader's admin URL,
which the leader publishes under ``controller/admin`` (fenced): ``api.forward``, the
controller's only HTTP client.  The leader runs the action
and writes it in one transaction fenced by its leader key, so a deposed leader cannot write.
A forwarded request that reaches a replica that no longer leads is answered 503 (retry).
A replica with TLS never forwards to a plain ``http://`` leader URL (503, nothing sent), and
verifies an ``https://`` leader against ``api.tls.ca_file`` (``api.forward``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic
from aiohttp import web

import meridian_etcd as etcd
from controlplane.api import actions, auth, forward, routes, ui
from controlplane.api import keys as api_keys
from controlplane.api.models import AdminEndpoint, Problem
from controlplane.api.problems import (
    ApiProblem,
    BadRequest,
    Invalid,
    NotFound,
    Unavailable,
    response,
)
from controlplane.errors import ControllerError
from controlplane.replica import Replica
from controlplane.settings import ControllerSettings
from meridian_service import hygiene, strict_json
from meridian_service.tls import ServerTls

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class AdminApi:
    replica: Replica
    url: str | None = None  # set once the site is bound
    forwarder: forward.Forwarder | None = None  # set once the site is bound
    published: object = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    tls: ServerTls | None = None  # set once the site is bound, when api.tls is set
    runner: hygiene.Runner | None = None  # the admin site's: its connections, for tests
    hooks: actions.Hooks = field(default_factory=actions.Hooks)  # the replica's metrics

    @property
    def settings(self) -> ControllerSettings:
        return self.replica.settings

    @property
    def leader(self) -> actions.Leader:
        r = self.replica
        return actions.Leader(
            settings=r.settings, store=r.store, election=r.election, clock=r.clock,
            hooks=self.hooks,
        )  # fmt: skip


ADMIN_API = web.AppKey("admin_api", AdminApi)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


READ_ONLY = web.AppKey("read_only", bool)
MAX_BODY_BYTES = 64 * 1024


def create_admin_app(api: AdminApi) -> web.Application:
    app = web.Application(middlewares=[problems], client_max_size=MAX_BODY_BYTES)
    app[ADMIN_API] = api
    add_routes(app)
    return app


def add_routes(app: web.Application, *, read_only: bool = False) -> None:
    """Mount :data:`routes.ROUTES` on ``app`` (which holds ``ADMIN_API`` and the :func:`problems`
    middleware): every route, or with ``read_only`` only the GETs, with the same handlers, roles
    and shapes, so each resource has one handler wherever it is served.  A write sent to a
    read-only app is answered 405 with a pointer to the admin port.  The fleet page
    (``api.ui``, ``/ui/``) is served on the admin port only; the read port answers 404 there."""
    app[READ_ONLY] = read_only
    for route in routes.ROUTES:
        writable = read_only and route.method != "GET"
        handler = _read_only(route) if writable else _endpoint(route)
        app.router.add_route(route.method, route.path, handler)
    if read_only:  # the load balancers' and supervisors' liveness path: /v1/health as it is
        health = next(r for r in routes.ROUTES if r.path == "/v1/health")
        app.router.add_get("/health", _endpoint(health))
        ui.add_refusal(app)
    else:
        ui.add_routes(app)


def _read_only(route: routes.Route) -> Handler:
    """A write route on the read port: 405, pointing at the admin port (see :func:`problems`)."""
    reads = [r.method for r in routes.ROUTES if r.path == route.path and r.method == "GET"]

    async def refuse(request: web.Request) -> web.StreamResponse:
        raise web.HTTPMethodNotAllowed(request.method, allowed_methods=reads)

    return refuse


def serving(api: AdminApi) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` entry of the replica's main app that runs the admin site."""

    async def ctx(_: web.Application) -> AsyncIterator[None]:
        s = api.settings.api
        if s.port is None:
            yield
            return
        tls = server_tls(api.settings)
        api.tls = tls
        runner = hygiene.runner(create_admin_app(api), s.limits(), label="api", access_log=None)
        await runner.setup()
        api.runner = runner
        site = hygiene.site(runner, s.host, s.port, ssl_context=tls.context if tls else None)
        await site.start()
        port = site.bound_port
        scheme = "https" if tls is not None else "http"
        api.url = s.advertise_url or f"{scheme}://{s.host}:{port}"
        api.forwarder = forward.Forwarder(replica=api.replica, settings=api.settings)
        task = asyncio.create_task(_publish(api), name="meridian-admin-publish")
        task.add_done_callback(_crashed)
        api.tasks.append(task)
        log.info("admin API url=%s tokens=%d", api.url, len(s.tokens))
        print(f"ADMIN {api.url}", flush=True)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await api.forwarder.close()
            await runner.cleanup()

    return ctx


def _crashed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("admin API task crashed", exc_info=task.exception())


def server_tls(settings: ControllerSettings) -> ServerTls | None:
    """``api.tls``'s certificate and key, as the agent's listener has them
    (``meridian_service.tls``: read again on SIGHUP, a bad new pair keeps the old one)."""
    tls = settings.api.tls
    if tls is None:
        return None
    return ServerTls(
        tls.cert_file,
        tls.key_file,
        cert_setting="api.tls.cert_file",
        key_setting="api.tls.key_file",
    )


async def _publish(api: AdminApi) -> None:
    """While leading, keep ``controller/admin`` pointing here (fenced)."""
    replica = api.replica
    while True:
        fence = replica.election.fence
        if fence is None:
            api.published = None
        elif fence != api.published and api.url is not None:
            value = AdminEndpoint(id=replica.election.identity, url=api.url)
            try:
                await replica.store.commit(
                    puts={api_keys.ADMIN: value.model_dump_json().encode()}, fence=fence
                )
                api.published = fence
            except (etcd.Unavailable, etcd.Fenced) as exc:
                log.info("admin endpoint not published yet error=%s", exc)
        await asyncio.sleep(0.2)


# -- the request path ---------------------------------------------------------------------------


@web.middleware
async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal and failure as problem+json; never a stack trace to the client."""
    try:
        return await handler(request)
    except ApiProblem as refused:
        return refused.response()
    except etcd.Unavailable as exc:
        return Unavailable(
            f"etcd unavailable: {exc}; nothing was changed",
            fix="retry later; see the runbook docs/runbooks/etcd-degraded.md",
        ).response()
    except etcd.Fenced:
        return Unavailable(
            "leadership changed during the request; nothing was changed",
            fix="retry: the request goes to the new leader",
        ).response()
    except (ControllerError, etcd.EtcdError) as exc:
        return Unavailable(f"{exc}; nothing was changed", fix="retry later").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        problem: ApiProblem
        if exc.status == 404:
            problem = NotFound(
                f"no such path: {request.path}", fix="see GET /v1/openapi.json for the paths"
            )
        elif exc.status == 405 and request.app.get(READ_ONLY, False):
            problem = BadRequest(
                f"{request.method} is not allowed on {request.path} here: this is the "
                "controller's read port (server.port), which serves the admin API's reads only",
                fix="send writes to the admin port (api.port, meridian-controller --admin-port)",
            )
            problem.status = 405
        elif exc.status == 405:
            allowed = sorted(getattr(exc, "allowed_methods", ()))
            problem = BadRequest(
                f"{request.method} is not allowed on {request.path}"
                + (f"; it allows {', '.join(allowed)}" if allowed else ""),
                fix="see GET /v1/openapi.json for the methods",
            )
            problem.status = 405
        elif exc.status == 413:
            problem = BadRequest("the body is too large", fix="send at most 64 KiB")
            problem.status = 413
        else:
            problem = BadRequest(exc.text or exc.reason)
            problem.status = exc.status
        answer = problem.response()
        if isinstance(exc, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 lists what is allowed
            answer.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return answer
    except Exception:  # the outermost middleware: never a stack trace to the client
        log.exception("admin API request failed path=%s", request.path)
        return response(
            Problem(
                type="urn:meridian:problem:internal",
                title="Internal error",
                status=500,
                detail="the controller failed to handle this request; nothing is known to "
                "have changed",
                fix="retry; if it persists, read the controller's log",
            )
        )


def _endpoint(route: routes.Route) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        api = request.app[ADMIN_API]
        caller: auth.Caller | None = None
        if route.role is not None:
            caller = auth.identify(request, api.settings.api.tokens)
            auth.require(caller, route.role, f"{route.method} {route.path}")
        raw = await request.read() if route.body is not None else b""
        if route.write and api.replica.election.fence is None:
            if api.forwarder is None:
                raise Unavailable("the admin API is starting", fix="retry in a few seconds")
            return await api.forwarder.forward(request, raw)
        call = routes.Call(
            request=request,
            caller=caller,
            body=_parse(route, raw),
            leader=api.leader,
            replica=api.replica,
            fingerprint=_fingerprint(request, raw),
            received_by=request.headers.get(forward.FORWARDED) or api.replica.election.identity,
        )
        out = await route.handler(call)
        if isinstance(out, web.StreamResponse):
            return out
        if isinstance(out, actions.Reply):
            headers = {forward.LEADER_HEADER: api.replica.election.identity}
            if out.replayed:
                headers["Idempotent-Replayed"] = "true"
            if out.status >= 400:
                return web.json_response(
                    out.body, status=out.status, content_type="application/problem+json",
                    headers=headers,
                )  # fmt: skip
            return web.json_response(out.body, status=out.status, headers=headers)
        return web.Response(text=out.model_dump_json(), content_type="application/json")

    handle.__name__ = route.handler.__name__
    return handle


def _parse(route: routes.Route, raw: bytes) -> pydantic.BaseModel | None:
    if route.body is None:
        return None
    try:
        data = strict_json.loads(raw) if raw.strip() else None
    except strict_json.BodyError as exc:
        if exc.literal:
            where = exc.field or "body"
            raise BadRequest(
                f"{where}: {exc.literal} is not a JSON number; nothing was changed",
                fix="send a finite number (JSON has no NaN or Infinity), for example "
                f"{route.example}",
                errors=[f"{where}: {exc.literal} is not a JSON number"],
            ) from None
        raise BadRequest(
            f"the body {exc.problem}; nothing was changed",
            fix=f"send a JSON object, for example {route.example}",
        ) from None
    if not isinstance(data, dict):
        raise BadRequest(
            "the body must be a JSON object; nothing was changed",
            fix=f"send a JSON object, for example {route.example}",
        )
    try:
        return route.body.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = [
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        ]
        raise Invalid(
            "the body does not validate: " + "; ".join(errors) + "; nothing was changed",
            fix=f"fix those fields, for example {route.example}",
            errors=errors,
        ) from exc


def _fingerprint(request: web.Request, raw: bytes) -> str:
    h = hashlib.sha256()
    for part in (request.method, request.path, str(sorted(request.query.items()))):
        h.update(part.encode() + b"\0")
    h.update(raw)
    return h.hexdigest()


def openapi_json(_: Any = None) -> dict[str, Any]:
    return routes.openapi()
