"""The admin API's routes: one table that serves requests and generates the OpenAPI document.

=========================================  =========  ==============================================
route                                      role       what
=========================================  =========  ==============================================
GET  /v1/health                            none       this replica: leading, leader, etcd, window
GET  /v1/openapi.json                      none       this document
GET  /v1/regions                           viewer     every region: state, strikes, capacity, ...
GET  /v1/regions/{region}                  viewer     one region, with its raw etcd values
GET  /v1/dns                               viewer     the DNS plan last applied (dns/applied)
GET  /v1/dns/bind-config                   admin      named.conf text for BIND (views, keys)
GET  /v1/events                            viewer     the newest events; ?after=cursor to follow
GET  /v1/audit                             operator   the newest audit entries
GET  /v1/policies                          viewer     the failover policy in force
PUT  /v1/policies                          admin      change it (applied from the next window)
POST /v1/regions/{region}/drain            operator   take a region out of service
POST /v1/regions/{region}/undrain          operator   put it back (it ramps up)
POST /v1/regions/{region}/failover         operator   move its traffic to a compliant backup
POST /v1/regions/{region}/failback         operator   end a manual failover (it ramps up)
=========================================  =========  ==============================================

Every POST and the PUT take ``?dry_run=true`` (answer the plan, change nothing) and an optional
``Idempotency-Key`` header; every write needs a ``reason``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from aiohttp import web
from pydantic.json_schema import models_json_schema

from controlplane.api import actions, auth
from controlplane.api.models import (
    Action,
    ActionRequest,
    ActionResult,
    ApiHealth,
    AuditEntry,
    AuditList,
    DnsView,
    EventList,
    FailoverRequest,
    PoliciesUpdate,
    PoliciesView,
    Problem,
    RegionDetail,
    RegionList,
    RegionRow,
)
from controlplane.api.problems import BadRequest, NotFound
from controlplane.dns import bindconf
from controlplane.reconcile import fleet
from controlplane.replica import Replica
from controlplane.settings.api import Role
from meridian_wire import keys
from meridian_wire.models import REGION_ID, DnsApplied, Event

Result = pydantic.BaseModel | actions.Reply | web.StreamResponse


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    request: web.Request
    caller: auth.Caller | None
    body: pydantic.BaseModel | None
    leader: actions.Leader
    replica: Replica
    fingerprint: str
    received_by: str

    @property
    def who(self) -> auth.Caller:
        assert self.caller is not None  # routes with a role always have one
        return self.caller


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    name: str
    where: str  # "query" or "path"
    schema: dict[str, Any]
    description: str
    required: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    method: str
    path: str
    handler: Callable[[Call], Awaitable[Result]]
    summary: str
    role: Role | None
    response: type[pydantic.BaseModel] | None  # None: text/plain
    body: type[pydantic.BaseModel] | None = None
    params: tuple[Param, ...] = ()
    write: bool = False  # forwarded to the leader
    errors: tuple[int, ...] = ()
    example: str = ""


# -- query helpers --------------------------------------------------------------------------------


def _int(call: Call, name: str, default: int, lo: int, hi: int) -> int:
    raw = call.request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise BadRequest(f"?{name}={raw!r} is not an integer", fix=f"send ?{name}=N") from exc
    if not lo <= value <= hi:
        raise BadRequest(f"?{name}={value} is out of range", fix=f"send {lo} <= {name} <= {hi}")
    return value


def _bool(call: Call, name: str) -> bool:
    raw = call.request.query.get(name, "false").lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no", ""):
        return False
    raise BadRequest(f"?{name}={raw!r} is not a boolean", fix=f"send ?{name}=true or false")


def _region(call: Call) -> str:
    region = call.request.match_info["region"]
    if not REGION_ID.match(region):
        raise NotFound(
            f"{region!r} is not a region id (lowercase letters, digits and dashes)",
            fix="see `meridianctl status` for the regions",
        )
    return region


# -- reads ----------------------------------------------------------------------------------------


async def get_health(call: Call) -> ApiHealth:
    r = call.replica
    last = r.last_pass
    return ApiHealth(
        id=r.election.identity,
        leading=r.election.leading,
        leader=r.election.leader,
        etcd="ok" if r.etcd_ok else "unavailable",
        window=last.window if last else None,
        alert=last.alert if last else None,
        pass_s=round(r.last_pass_s, 6) if r.last_pass_s is not None else None,
        pass_writes=last.writes if last else None,
    )


async def get_openapi(call: Call) -> web.StreamResponse:
    return web.json_response(openapi())


def _rows(view: fleet.FleetView, configured: dict[str, tuple[str, list[str]]]) -> list[RegionRow]:
    names = set(configured) | set(view.regions) | set(view.plan.state.get("verdicts", {}))
    rows = []
    for region in sorted(names):
        record = view.regions.get(region) or fleet.RegionRecord(region=region)
        status = record.status or view.plan.last_status.get(region)
        health, desired, override = record.health, record.desired, record.override
        geo, residency = configured.get(region, (None, []))
        rows.append(
            RegionRow(
                region=region,
                geo=geo or (status.geo if status else None),
                residency=residency or (list(status.residency) if status else []),
                alive=record.alive,
                state=health.state if health else None,
                strikes=health.strikes if health else 0,
                capacity=status.capacity if status else None,
                load=status.load.model_dump() if status else None,
                weight=health.weight if health else None,
                backup=health.backup if health else None,
                floor=desired.capacity_floor if desired else None,
                admin=override.admin if override else "active",
                manual_failover=bool(override and override.failover),
                models=status.models if status else None,
                model_backups=health.model_backups if health else {},
                model_floors=desired.model_floors if desired else {},
                unreachable=region in view.plan.unreachable,
                reason=health.reason if health else "",
            )
        )
    return rows


def _configured(call: Call) -> dict[str, tuple[str, list[str]]]:
    return {r.id: (r.geo, list(r.residency)) for r in call.replica.settings.regions}


async def get_regions(call: Call) -> RegionList:
    view = await fleet.read(call.replica.store, tables=True)  # bad values: ranges too
    return RegionList(
        regions=_rows(view, _configured(call)),
        alert=view.plan.alert,
        window=view.plan.window,
        serving=view.plan.serving,
        bad_values=[str(b) for b in view.bad],
    )


async def get_region(call: Call) -> RegionDetail:
    region = _region(call)
    view = await fleet.read(call.replica.store, tables=True)
    rows = {r.region: r for r in _rows(view, _configured(call))}
    if region not in rows:
        raise NotFound(
            f"unknown region {region!r}",
            fix=f"known regions: {', '.join(sorted(rows)) or 'none'} (`meridianctl status`)",
        )
    record = view.regions.get(region) or fleet.RegionRecord(region=region)

    def dump(m: pydantic.BaseModel | None) -> dict[str, Any] | None:
        return m.model_dump(mode="json") if m is not None else None

    now = call.replica.clock.now()
    status = record.status or view.plan.last_status.get(region)
    reach = None
    if status is not None:
        votes = fleet.reach(
            view, region, status.endpoints, now=now,
            max_age_s=call.replica.settings.probe.vote_age_s,
        )  # fmt: skip
        if votes is not None:
            reach = {
                "reached": list(votes.reached),
                "failed": list(votes.failed),
                "unreachable": votes.unreachable,
                "reason": votes.reason,
            }
    return RegionDetail(
        row=rows[region],
        status=dump(record.status or view.plan.last_status.get(region)),
        health=dump(record.health),
        desired=dump(record.desired),
        override=dump(record.override),
        agents=fleet.describe_agents(record),
        tables=fleet.describe_tables(record, now=now),
        probes=fleet.describe_probes(view, region, now=now),
        reach=reach,
        measured_latency_ms={
            a: row[region] for a, row in view.plan.measured_latency_ms.items() if region in row
        },
    )


async def get_dns(call: Call) -> DnsView:
    entry = await call.replica.store.get(keys.DNS_APPLIED)
    if entry is None:
        return DnsView(applied=None)
    try:
        return DnsView(applied=DnsApplied.model_validate_json(entry.value))
    except pydantic.ValidationError as exc:
        return DnsView(applied=None, problem=f"{keys.DNS_APPLIED} does not validate: {exc}")


async def get_bind_config(call: Call) -> web.StreamResponse:
    text = bindconf.render(call.replica.settings.dns)  # holds TSIG secrets: admin only
    return web.Response(text=text, content_type="text/plain")


async def get_events(call: Call) -> EventList:
    limit = _int(call, "limit", 100, 1, 1000)
    after = call.request.query.get("after")
    region = call.request.query.get("region")
    entries = sorted(
        (await call.replica.store.get_prefix(keys.EVENTS)).entries, key=lambda e: e.key
    )
    if after:
        entries = [e for e in entries if e.key.removeprefix(keys.EVENTS) > after]
    out: list[tuple[str, dict[str, Any]]] = []
    for entry in entries:
        with contextlib.suppress(pydantic.ValidationError, ValueError):
            event = Event.model_validate_json(entry.value)
            if region is None or event.region == region:
                out.append((entry.key.removeprefix(keys.EVENTS), event.model_dump(mode="json")))
    out = out[-limit:]
    cursor = out[-1][0] if out else (after or None)
    if not out and not after and entries:
        cursor = entries[-1].key.removeprefix(keys.EVENTS)
    return EventList(events=[e for _, e in out], cursor=cursor)


async def get_audit(call: Call) -> AuditList:
    limit = _int(call, "limit", 100, 1, 1000)
    entries = sorted((await call.replica.store.get_prefix(keys.AUDIT)).entries, key=lambda e: e.key)
    out = []
    for entry in entries:
        with contextlib.suppress(pydantic.ValidationError):
            out.append(AuditEntry.model_validate_json(entry.value))
    return AuditList(entries=out[-limit:])


async def get_policies(call: Call) -> PoliciesView:
    return await actions.current_policies(call.replica.settings, call.replica.store)


# -- writes ---------------------------------------------------------------------------------------


async def put_policies(call: Call) -> actions.Reply:
    update = call.body
    assert isinstance(update, PoliciesUpdate)
    req = _request(call, "policies", None, update.reason)
    return await actions.set_policies(call.leader, req, update)


def _request(
    call: Call, action: Action, region: str | None, reason: str, target: str | None = None
) -> actions.Request:
    key = call.request.headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 200:
        raise BadRequest("Idempotency-Key must be 1 to 200 characters", fix="send a UUID")
    return actions.Request(
        caller=call.who,
        action=action,
        region=region,
        reason=reason,
        target=target,
        dry_run=_bool(call, "dry_run"),
        idempotency_key=key,
        fingerprint=call.fingerprint,
        received_by=call.received_by,
    )


def _action(action: Action) -> Callable[[Call], Awaitable[Result]]:
    async def run(call: Call) -> Result:
        body = call.body
        assert isinstance(body, ActionRequest | FailoverRequest)
        target = body.target if isinstance(body, FailoverRequest) else None
        req = _request(call, action, _region(call), body.reason, target)
        return await actions.region_action(call.leader, req)

    run.__name__ = f"post_{action}"
    return run


# -- the table ------------------------------------------------------------------------------------

_REGION = Param(
    name="region", where="path", schema={"type": "string"}, description="region id", required=True
)
_DRY_RUN = Param(
    name="dry_run",
    where="query",
    schema={"type": "boolean", "default": False},
    description="answer the plan, change nothing",
)
_LIMIT = Param(
    name="limit",
    where="query",
    schema={"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
    description="at most this many, newest last",
)
_REASON = '{"reason": "why"}'


def _post(action: Action, summary: str, body: type[pydantic.BaseModel]) -> Route:
    return Route(
        method="POST",
        path=f"/v1/regions/{{region}}/{action}",
        handler=_action(action),
        summary=summary,
        role="operator",
        response=ActionResult,
        body=body,
        params=(_REGION, _DRY_RUN),
        write=True,
        errors=(400, 401, 403, 404, 409, 422, 503),
        example=_REASON,
    )


ROUTES: tuple[Route, ...] = (
    Route(method="GET", path="/v1/health", handler=get_health, role=None, response=ApiHealth,
          summary="this replica: leading or not, the leader, etcd, the last window"),
    Route(method="GET", path="/v1/openapi.json", handler=get_openapi, role=None, response=None,
          summary="this OpenAPI 3 document"),
    Route(method="GET", path="/v1/regions", handler=get_regions, role="viewer",
          response=RegionList, errors=(401, 403, 503),
          summary="every region: state, strikes, capacity, load, weight, backup, floor"),
    Route(method="GET", path="/v1/regions/{region}", handler=get_region, role="viewer",
          response=RegionDetail, params=(_REGION,), errors=(401, 403, 404, 503),
          summary="one region, with its status, health, desired state and override"),
    Route(method="GET", path="/v1/dns", handler=get_dns, role="viewer", response=DnsView,
          errors=(401, 403, 503), summary="the DNS plan the controller last applied"),
    Route(method="GET", path="/v1/dns/bind-config", handler=get_bind_config, role="admin",
          response=None, errors=(401, 403),
          summary="named.conf for the authoritative BIND9 (views, TSIG key, zones)"),
    Route(method="GET", path="/v1/events", handler=get_events, role="viewer", response=EventList,
          params=(
              Param(name="after", where="query", schema={"type": "string"},
                    description="cursor of the last event seen: only newer ones"),
              Param(name="region", where="query", schema={"type": "string"},
                    description="only this region's events"),
              _LIMIT,
          ),
          errors=(400, 401, 403, 503), summary="the newest events (strikes, failovers, ...)"),
    Route(method="GET", path="/v1/audit", handler=get_audit, role="operator", response=AuditList,
          params=(_LIMIT,), errors=(400, 401, 403, 503),
          summary="the newest audit entries: who did what, when, why, and the result"),
    Route(method="GET", path="/v1/policies", handler=get_policies, role="viewer",
          response=PoliciesView, errors=(401, 403, 503),
          summary="the failover policy in force"),
    Route(method="PUT", path="/v1/policies", handler=put_policies, role="admin",
          response=PoliciesView, body=PoliciesUpdate, write=True, params=(_DRY_RUN,),
          errors=(400, 401, 403, 422, 503), example='{"reason": "why", "strikes": 4}',
          summary="change the failover policy; the leader applies it from the next window"),
    _post("drain", "drain a region: its traffic moves to its backup", ActionRequest),
    _post("undrain", "end a drain: the region ramps back up", ActionRequest),
    _post("failover", "manual failover to a compliant backup, held until failback",
          FailoverRequest),
    _post("failback", "end a manual failover: the region ramps back up", ActionRequest),
)  # fmt: skip


# -- OpenAPI --------------------------------------------------------------------------------------


def openapi() -> dict[str, Any]:
    models: set[type[pydantic.BaseModel]] = {Problem}
    for route in ROUTES:
        models |= {m for m in (route.body, route.response) if m is not None}
    _, defs = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, dict[str, Any]] = {}
    problem = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for route in ROUTES:
        op: dict[str, Any] = {
            "operationId": route.handler.__name__,
            "summary": route.summary,
            "parameters": [
                {
                    "name": p.name,
                    "in": p.where,
                    "required": p.required or p.where == "path",
                    "description": p.description,
                    "schema": p.schema,
                }
                for p in route.params
            ],
            "responses": {},
        }
        if route.method == "POST" or route.method == "PUT":
            op["parameters"].append(
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "description": "the same key and request answer the first answer again",
                    "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                }
            )
        if route.body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{route.body.__name__}"}
                    }
                },
            }
        if route.response is not None:
            content = {
                "application/json": {
                    "schema": {"$ref": f"#/components/schemas/{route.response.__name__}"}
                }
            }
        elif route.path.endswith(".json"):
            content = {"application/json": {"schema": {"type": "object"}}}
        else:
            content = {"text/plain": {"schema": {"type": "string"}}}
        op["responses"]["200"] = {"description": "OK", "content": content}
        for status in route.errors:
            op["responses"][str(status)] = {"description": _REASONS[status], "content": problem}
        if route.role is not None:
            op["security"] = [{"bearer": []}]
            op["x-role"] = route.role
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Meridian admin API",
            "version": "1",
            "description": "Regions, DNS, events, policies and operators' actions. Bearer "
            "tokens with roles viewer < operator < admin. Errors are application/problem+json.",
        },
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


_REASONS = {
    400: "malformed request (not JSON, bad query parameter)",
    401: "no token or an unknown token",
    403: "the token's role may not do this",
    404: "unknown region",
    409: "refused: unsafe or not applicable now; nothing changed",
    422: "invalid body, or a target that breaks residency; nothing changed",
    503: "no leader or etcd unavailable; retry",
}
