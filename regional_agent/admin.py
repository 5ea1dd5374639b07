"""The agent's admin endpoints, behind ``Authorization: Bearer <admin token>``
(``admin.token_file``, ``admin.token_sha256`` or ``MERIDIAN_AGENT_ADMIN__TOKEN``; only its
hash is kept, ``AdminSettings.verify``).

=======  ===============================  ===================================================
GET      /admin/nodes                     every node: source, state, load, telemetry, health
POST     /admin/nodes                     add a node: ``{"url": ..., "id"?, "weight"?, "slots"?}``
DELETE   /admin/nodes/{id}                remove a node (in-flight requests finish)
POST     /admin/nodes/{id}/drain          no new requests; in-flight ones finish (drain timeout)
POST     /admin/nodes/{id}/undrain        take traffic again
PUT      /admin/nodes/{id}/weight         ``{"weight": 2.0}``
GET      /admin/policy                    the routing policy and the ones available
PUT      /admin/policy                    ``{"policy": "prefix_aware"}``: switch at run time
                                          (``groups`` only when the agent keeps group tables)
GET      /admin/queue                     waiting requests per model, decisions and refusals
GET      /admin/autoscaler                who acts, the floors, the load policy's last decision
                                          and its reason, the signals it read, actuator errors
=======  ===============================  ===================================================
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pydantic
from aiohttp import web

from policies.model import AdminState, NodeId
from regional_agent.autoscaler import AUTOSCALER
from regional_agent.edge import EDGE, Edge
from regional_agent.errors import BadRequest, Conflict, NotFound, Unauthorized
from regional_agent.nodes import Node
from regional_agent.settings import GROUPS_POLICY, NodeSettings
from regional_agent.workers.runtime import Handler, from_sibling

log = logging.getLogger(__name__)


def add_routes(
    app: web.Application, *, relayed: Callable[[Handler], Handler] | None = None
) -> None:
    """The admin endpoints; ``relayed`` wraps the ones that change something (with several
    workers, ``WorkerRuntime.relayed`` makes the change on every worker)."""
    change = relayed or (lambda handler: handler)
    r = app.router
    r.add_get("/admin/nodes", list_nodes)
    r.add_post("/admin/nodes", change(add_node))
    r.add_delete("/admin/nodes/{node_id}", change(remove_node))
    r.add_post("/admin/nodes/{node_id}/drain", change(drain))
    r.add_post("/admin/nodes/{node_id}/undrain", change(undrain))
    r.add_put("/admin/nodes/{node_id}/weight", change(set_weight))
    r.add_get("/admin/policy", get_policy)
    r.add_put("/admin/policy", change(set_policy))
    r.add_get("/admin/queue", queue)
    r.add_get("/admin/autoscaler", autoscaler_state)


def _authorize(request: web.Request) -> Edge:
    agent = request.app[EDGE]
    if from_sibling(request, agent.sibling_secret):
        return agent  # a sibling worker passing on a change the admin token allowed
    admin = agent.settings.admin
    if not admin.enabled:
        raise Unauthorized(
            "the admin API is disabled: start the agent with admin.token_file, "
            "admin.token_sha256 or MERIDIAN_AGENT_ADMIN__TOKEN set"
        )
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not admin.verify(given):
        raise Unauthorized("send 'Authorization: Bearer <admin token>'")
    return agent


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _node(agent: Edge, request: web.Request) -> Node:
    node_id = request.match_info["node_id"]
    node = agent.pool.get(node_id)
    if node is None:
        known = ", ".join(n.node_id for n in agent.pool) or "none"
        raise NotFound(f"no node {node_id!r}; nodes: {known}")
    return node


def describe(agent: Edge, node: Node) -> dict[str, Any]:
    """A node as ``GET /admin/nodes`` shows it.  With several workers the load is every
    worker's (``in_flight`` ... ``prefill_tokens``, and "drained" when none has a request
    there); ``requests_total``, ``errors_total`` and the decisions are this worker's own."""
    now = agent.clock.now()
    in_flight, tokens, prefill = agent.pool.load(node)
    admin_state = node.admin.value
    if node.admin is AdminState.DRAINING and in_flight == 0:
        admin_state = "drained"
    return {
        "id": node.node_id,
        "url": node.url,
        "models": sorted(node.models),
        "admin": admin_state,
        "weight": node.weight,
        "slots": node.slots,
        "group": node.group or node.node_id,
        "source": node.source,
        "in_flight": in_flight,
        "in_flight_tokens": tokens,
        "prefill_tokens": prefill,
        "requests_total": node.requests_total,
        "errors_total": node.errors_total,
        "health": agent.health.describe(node.node_id, now=now),
        "telemetry": agent.scraper.describe(node.node_id),
        "recent_decisions": [d.reason for d in node.decisions],
        "kv_events": None if agent.kv_events is None else agent.kv_events.describe(node.node_id),
    }


async def list_nodes(request: web.Request) -> web.Response:
    agent = _authorize(request)
    panic = agent.pool.panic(now=agent.clock.now())
    return web.json_response(
        {
            "policy": agent.dispatcher.policy.name,
            "panic": {
                "active": panic.active,
                "routable": panic.routable,
                "eligible": panic.eligible,
                "threshold": panic.threshold,
                "reason": panic.reason,
            },
            "nodes": [describe(agent, n) for n in agent.pool],
        }
    )


async def add_node(request: web.Request) -> web.Response:
    agent = _authorize(request)
    try:
        settings = NodeSettings.model_validate(await _body(request))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise BadRequest(f"invalid node: {problems}") from exc
    if settings.node_id in agent.pool:
        raise Conflict(f"node {settings.node_id!r} already exists")
    node = await agent.roster.add(agent.roster.make(settings, source="admin"))
    log.info(
        "node added node=%s url=%s models=%s", node.node_id, node.url, ",".join(sorted(node.models))
    )
    return web.json_response(describe(agent, node), status=201)


async def remove_node(request: web.Request) -> web.Response:
    agent = _authorize(request)
    node = _node(agent, request)
    agent.roster.remove(node.node_id)
    log.info("node removed node=%s in_flight=%d", node.node_id, node.in_flight)
    return web.json_response({"removed": node.node_id, "in_flight": node.in_flight})


def _node_or_hold(
    agent: Edge, request: web.Request, *, drain: bool | None = None, weight: float | None = None
) -> Node | None:
    """The node named in the path; or, for a change a sibling worker passes on about a node
    this worker's discovery has not found yet, None: the change is held and made when the node
    is added (``Roster.held``)."""
    node_id = request.match_info["node_id"]
    if agent.pool.get(node_id) is not None or not from_sibling(request, agent.sibling_secret):
        return _node(agent, request)
    draining, held_weight = agent.roster.held.get(node_id, (False, 1.0))
    agent.roster.held[node_id] = (
        draining if drain is None else drain,
        held_weight if weight is None else weight,
    )
    log.info("admin change held until the node is found node=%s path=%s", node_id, request.path)
    return None


def _held(request: web.Request) -> web.Response:
    return web.json_response({"held": request.match_info["node_id"]}, status=202)


async def drain(request: web.Request) -> web.Response:
    agent = _authorize(request)
    node = _node_or_hold(agent, request, drain=True)
    if node is None:
        return _held(request)
    if node.admin is not AdminState.DRAINING:
        node.admin = AdminState.DRAINING
        node.drain_started_s = agent.clock.now()
        agent.pool.notify()
        log.info("node draining node=%s in_flight=%d", node.node_id, node.in_flight)
    return web.json_response(describe(agent, node))


async def undrain(request: web.Request) -> web.Response:
    agent = _authorize(request)
    node = _node_or_hold(agent, request, drain=False)
    if node is None:
        return _held(request)
    if node.admin is not AdminState.ACTIVE:
        node.admin = AdminState.ACTIVE
        node.drain_started_s = None
        agent.pool.notify()
        log.info("node active again node=%s", node.node_id)
    return web.json_response(describe(agent, node))


async def set_weight(request: web.Request) -> web.Response:
    agent = _authorize(request)
    weight = (await _body(request)).get("weight")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
        raise BadRequest(f"'weight' must be a number > 0, got {weight!r}", param="weight")
    node = _node_or_hold(agent, request, weight=float(weight))
    if node is None:
        return _held(request)
    node.weight = float(weight)
    agent.pool.notify()
    log.info("node weight node=%s weight=%g", node.node_id, node.weight)
    return web.json_response(describe(agent, node))


def _policies(agent: Edge) -> dict[str, Any]:
    out: dict[str, Any] = {"policy": agent.dispatcher.policy.name}
    out["available"] = list(agent.policy_names())
    if GROUPS_POLICY not in out["available"]:
        out["unavailable"] = {GROUPS_POLICY: _NO_GROUP_TABLES}
    return out


_NO_GROUP_TABLES = (
    "needs the group tables, which the agent keeps in sync through etcd from its start: "
    'start it with routing.policy = "groups" (and region.id, region.etcd)'
)


async def get_policy(request: web.Request) -> web.Response:
    agent = _authorize(request)
    return web.json_response(_policies(agent))


async def set_policy(request: web.Request) -> web.Response:
    agent = _authorize(request)
    name = (await _body(request)).get("policy")
    names = agent.policy_names()
    if name == GROUPS_POLICY and name not in names:
        raise Conflict(f"policy {GROUPS_POLICY!r} {_NO_GROUP_TABLES}", param="policy")
    if not isinstance(name, str) or name not in names:
        raise BadRequest(
            f"'policy' must be one of {', '.join(names)}; got {name!r}", param="policy"
        )
    agent.dispatcher.set_policy(agent.make_policy(name))
    log.info("routing policy switched policy=%s", name)
    return web.json_response(_policies(agent))


async def queue(request: web.Request) -> web.Response:
    agent = _authorize(request)
    return web.json_response(
        {
            "waiting": {m: agent.dispatcher.depth(m) for m in sorted(agent.pool.models())},
            "routed_by_reason": dict(agent.dispatcher.stats.routed),
            "refused_by_cause": dict(agent.dispatcher.stats.rejected),
            "retry_budget": round(agent.budget.available, 2),
        }
    )


async def autoscaler_state(request: web.Request) -> web.Response:
    _authorize(request)
    scaler = request.app.get(AUTOSCALER)
    if scaler is None:
        raise NotFound(
            "this agent runs no autoscaler: set autoscaler.actuator (docs/autoscaling.md)"
        )
    return web.json_response(scaler.describe())


async def catch_up(agent: Edge, state: dict[str, Any]) -> list[str]:
    """Make this worker's nodes and policy what a sibling's ``GET /admin/nodes`` says: a
    restarted worker starts from the settings, and this brings it the admin changes made at run
    time (nodes added or removed, drains, weights, the policy).  Returns what it changed."""
    done: list[str] = []
    theirs = {n["id"]: n for n in state.get("nodes", [])}
    for node in agent.pool:
        if node.node_id not in theirs and node.source in ("static", "admin"):
            agent.roster.remove(node.node_id)
            done.append(f"removed {node.node_id}")
    for node_id, seen in theirs.items():
        known = agent.pool.get(node_id)
        if known is not None and seen.get("source") == "admin" and seen.get("url") != known.url:
            agent.roster.remove(node_id)  # removed and added again elsewhere since the start
            done.append(f"removed {node_id} at {known.url}")
            known = None
        if known is None:
            if seen.get("source") != "admin":  # discovered: this worker's discovery finds it
                agent.roster.held[node_id] = (
                    seen.get("admin") in ("draining", "drained"),
                    float(seen.get("weight", 1.0)),
                )
                done.append(f"held for {node_id} until discovered")
                continue
            group = seen.get("group")
            spec = NodeSettings(
                id=node_id,
                url=seen["url"],
                weight=seen["weight"],
                slots=seen["slots"],
                group=None if group in (None, node_id) else group,
            )
            known = await agent.roster.add(agent.roster.make(spec, source="admin"))
            done.append(f"added {node_id}")
        node = known
        draining = seen.get("admin") in ("draining", "drained")
        if draining and node.admin is not AdminState.DRAINING:
            node.admin = AdminState.DRAINING
            node.drain_started_s = agent.clock.now()
            done.append(f"draining {node_id}")
        elif not draining and node.admin is AdminState.DRAINING:
            node.admin = AdminState.ACTIVE
            node.drain_started_s = None
            done.append(f"active {node_id}")
        if seen.get("weight") != node.weight and isinstance(seen.get("weight"), int | float):
            node.weight = float(seen["weight"])
            done.append(f"weight {node_id} {node.weight:g}")
    policy = state.get("policy")
    current = agent.dispatcher.policy.name
    if isinstance(policy, str) and policy != current and policy in agent.policy_names():
        agent.dispatcher.set_policy(agent.make_policy(policy))
        done.append(f"policy {policy}")
    if done:
        agent.pool.notify()
    return done


__all__ = ["NodeId", "add_routes", "catch_up", "describe"]
