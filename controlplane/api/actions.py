"""Operators' actions: drain, undrain, failover, failback, and setting the policies.

Each runs on the leader, one at a time (``windows.pass_lock``, shared with the window loop):

1. read the fleet and plan it as it is (``windows.prepare``, no window counted);
2. build the region's new override (``regions/<r>/override``) and plan again with it;
3. refuse what is unsafe: an unknown region, a target that breaks residency, a drain or
   failover that would leave a geography with no region serving (the plan's "never all off"
   alert), an action that does not apply (undrain a region that is not drained);
4. on a dry run, answer the plan; else write the override, the new plan (health, desired,
   events) and the audit entry in one transaction fenced by the leader key.

Every action, refused or not, dry run or not, leaves an audit entry (``audit/<time>-<id>``);
one that fails with a 5xx (etcd unavailable, leadership lost) leaves one with result
``error`` when etcd still takes it (best effort: the original error is what the caller gets).
An ``Idempotency-Key`` answers a repeated request with the first answer and does nothing again.

The leader's :class:`Hooks` hear of each action's verb and result (as its audit entry says it:
``applied``, ``dry-run``, ``refused``, ``error``; or ``replayed``) and of every pass an action
commits: the replica's metrics (``controlplane.observability``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic

import meridian_etcd as etcd
from controlplane import failover_policy
from controlplane.api import keys as api_keys
from controlplane.api.auth import Caller
from controlplane.api.models import (
    Action,
    ActionResult,
    AuditEntry,
    IdempotencyRecord,
    PoliciesUpdate,
    PoliciesView,
    RegionChange,
)
from controlplane.api.problems import ApiProblem, Conflict, Invalid, NotFound, Unavailable
from controlplane.election import Election
from controlplane.errors import ControllerError
from controlplane.reconcile import windows
from controlplane.settings import ControllerSettings, stale_problem
from meridian_service.clock import Clock
from meridian_wire import keys
from meridian_wire.models import RegionOverride

_EPS = 1e-9
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One write as the leader receives it."""

    caller: Caller
    action: Action
    region: str | None
    reason: str
    target: str | None = None
    dry_run: bool = False
    idempotency_key: str | None = None
    fingerprint: str = ""  # hash of method, path, query and body: same key, same request
    received_by: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    status: int
    body: dict[str, Any]
    replayed: bool = False


def _no_action(action: str, result: str) -> None:
    return None


def _no_commit(prepared: windows.Prepared) -> None:
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Hooks:
    """Who hears of the leader's actions: ``action(verb, result)`` once per action, and
    ``committed(prepared)`` for every pass an action writes."""

    action: Callable[[str, str], None] = _no_action
    committed: Callable[[windows.Prepared], None] = _no_commit


@dataclass(slots=True, kw_only=True)
class Leader:
    settings: ControllerSettings
    store: etcd.Store
    election: Election
    clock: Clock
    hooks: Hooks = field(default_factory=Hooks)

    def fence(self) -> etcd.Fence:
        fence = self.election.fence
        if fence is None:
            raise Unavailable(
                "this replica stopped leading while handling the request; nothing was changed",
                fix="retry: the request goes to the new leader",
            )
        return fence


# -- idempotency and audit ----------------------------------------------------------------------


def _idem_key(caller: Caller, key: str) -> str:
    return api_keys.idempotency(hashlib.sha256(f"{caller.name}\0{key}".encode()).hexdigest())


async def _replay(leader: Leader, req: Request) -> Reply | None:
    if req.idempotency_key is None:
        return None
    entry = await leader.store.get(_idem_key(req.caller, req.idempotency_key))
    if entry is None:
        return None
    try:
        record = IdempotencyRecord.model_validate_json(entry.value)
    except pydantic.ValidationError:
        return None
    if leader.clock.now() - record.at > leader.settings.api.idempotency_ttl_s:
        return None
    if record.body_sha256 != req.fingerprint:
        raise Invalid(
            "this Idempotency-Key was used for a different request; nothing was done",
            fix="send a new Idempotency-Key with a new request (the same key only to retry "
            "the very same request)",
        )
    return Reply(status=record.status, body=record.body, replayed=True)


def _record(leader: Leader, req: Request, reply: Reply) -> dict[str, bytes]:
    if req.idempotency_key is None or req.dry_run:
        return {}
    record = IdempotencyRecord(
        body_sha256=req.fingerprint, status=reply.status, body=reply.body, at=leader.clock.now()
    )
    return {_idem_key(req.caller, req.idempotency_key): record.model_dump_json().encode()}


def _audit(
    leader: Leader,
    req: Request,
    fence: etcd.Fence,
    *,
    result: str,
    status: int,
    detail: str,
    entry_id: str | None = None,
) -> dict[str, bytes]:
    now = leader.clock.now()
    entry_id = entry_id or uuid.uuid4().hex[:12]
    entry = AuditEntry.model_validate(
        {
            "id": entry_id,
            "at": now,
            "who": req.caller.name,
            "role": req.caller.role,
            "action": req.action,
            "region": req.region,
            "target": req.target,
            "reason": req.reason,
            "dry_run": req.dry_run,
            "result": result,
            "status": status,
            "detail": detail,
            "controller": fence.value.decode(),
            "received_by": req.received_by,
            "idempotency_key": req.idempotency_key,
        }
    )
    return {keys.audit(int(now * 1000), entry_id): entry.model_dump_json().encode()}


async def _prune(leader: Leader, fence: etcd.Fence) -> None:
    deletes: list[str] = []
    audit = sorted((await leader.store.get_prefix(keys.AUDIT)).entries, key=lambda e: e.key)
    keep = leader.settings.api.audit_retention
    deletes += [e.key for e in audit[: max(0, len(audit) - keep)]]
    horizon = leader.clock.now() - leader.settings.api.idempotency_ttl_s
    for entry in (await leader.store.get_prefix(api_keys.IDEMPOTENCY)).entries:
        try:
            if IdempotencyRecord.model_validate_json(entry.value).at < horizon:
                deletes.append(entry.key)
        except pydantic.ValidationError:
            deletes.append(entry.key)
    if deletes:
        await leader.store.commit_batches(deletes=deletes, fence=fence)


async def _run(
    leader: Leader, req: Request, work: Callable[[etcd.Fence, str], Awaitable[Reply]]
) -> Reply:
    """:func:`_execute`, its result told to ``leader.hooks.action``."""
    result = "error"
    try:
        reply = await _execute(leader, req, work)
        result = "replayed" if reply.replayed else "dry-run" if req.dry_run else "applied"
        return reply
    except ApiProblem as problem:
        result = "refused" if problem.status < 500 else "error"
        raise
    finally:
        leader.hooks.action(req.action, result)


async def _execute(
    leader: Leader, req: Request, work: Callable[[etcd.Fence, str], Awaitable[Reply]]
) -> Reply:
    """Replay, or do ``work`` under the pass lock; audit a refusal (and keep its answer)."""
    fence = leader.fence()
    async with windows.pass_lock(leader.store):
        replayed = await _replay(leader, req)
        if replayed is not None:
            return replayed
        audit_id = uuid.uuid4().hex[:12]
        try:
            reply = await work(fence, audit_id)
        except (ControllerError, etcd.EtcdError) as exc:  # etcd unavailable, fenced: a 503
            await _audit_error(leader, req, fence, status=503, detail=str(exc), entry_id=audit_id)
            raise
        except ApiProblem as problem:
            if problem.status >= 500:
                await _audit_error(
                    leader, req, fence, status=problem.status, detail=problem.detail,
                    entry_id=audit_id,
                )  # fmt: skip
                raise
            audit = _audit(
                leader, req, fence, result="refused", status=problem.status,
                detail=problem.detail, entry_id=audit_id,
            )  # fmt: skip
            refused = Reply(status=problem.status, body=problem.body().model_dump())
            await leader.store.commit(puts={**audit, **_record(leader, req, refused)}, fence=fence)
            raise
    await _prune(leader, fence)
    return reply


async def _audit_error(
    leader: Leader, req: Request, fence: etcd.Fence, *, status: int, detail: str, entry_id: str
) -> None:
    """Audit an action that failed with a 5xx, if etcd takes it; never raises (the caller
    re-raises the original error). No idempotency record: a retry with the key runs again."""
    audit = _audit(leader, req, fence, result="error", status=status, detail=detail,
                   entry_id=entry_id)  # fmt: skip
    try:
        await leader.store.commit(puts=audit, fence=fence)
    except (ControllerError, etcd.EtcdError) as exc:
        log.warning(
            "api: could not audit a failed action=%s region=%s who=%s: %s",
            req.action, req.region, req.caller.name, exc,
        )  # fmt: skip


# -- region actions -----------------------------------------------------------------------------


def _new_override(
    req: Request, current: RegionOverride | None, now: float
) -> RegionOverride | None:
    region = req.region
    cur_admin = current.admin if current is not None else "active"
    cur_failover = bool(current is not None and current.failover)
    base: dict[str, Any] = {"reason": req.reason, "by": req.caller.name, "at": now}
    if req.action == "drain":
        if cur_admin != "active":
            raise Conflict(
                f"{region} is already drained (since: {current.reason if current else ''})",
                fix=f"nothing to do; undrain it with `meridianctl undrain {region}`",
            )
        return RegionOverride(
            failover=cur_failover, target=current.target if current else None,
            admin="draining", **base,
        )  # fmt: skip
    if req.action == "undrain":
        if cur_admin == "active":
            raise Conflict(
                f"{region} is not drained",
                fix=f"nothing to do; drain it with `meridianctl drain {region}`",
            )
        if not cur_failover:
            return None
        return RegionOverride(failover=True, target=current.target if current else None, **base)
    if req.action == "failover":
        if cur_failover and (current is not None and current.target == req.target):
            raise Conflict(
                f"{region} is already failed over manually"
                + (f" to {req.target}" if req.target else ""),
                fix=f"fail it back with `meridianctl failback {region}`, or name another --to",
            )
        return RegionOverride(failover=True, target=req.target, admin=cur_admin, **base)
    # failback
    if not cur_failover:
        raise Conflict(
            f"{region} is not failed over manually; automatic failovers end by themselves "
            "when the region recovers",
            fix=f"see `meridianctl regions show {region}` for its state and ramp",
        )
    if cur_admin == "active":
        return None
    return RegionOverride(admin=cur_admin, **base)


def _check_target(req: Request, before: windows.Prepared) -> None:
    region, target = req.region, req.target
    if target is None or region is None:
        return
    regions = before.topology.regions
    if target == region:
        raise Invalid(f"cannot fail {region} over to itself", fix="name another region with --to")
    if target not in regions:
        raise Invalid(
            f"unknown target region {target!r}",
            fix=f"pick one of {', '.join(sorted(regions))}, or omit the target to let the "
            "policy choose a compliant backup",
        )
    need = regions[region].residency  # type: ignore[index]
    missing = sorted(set(need) - set(regions[target].residency))  # type: ignore[index]
    if missing:
        compliant = sorted(
            r for r, info in regions.items() if r != region and need <= info.residency
        )
        raise Invalid(
            f"failing {region} over to {target} would break data residency: {target} lacks "
            f"{missing} that {region} requires; nothing was changed",
            fix=(
                f"pick a compliant target ({', '.join(compliant)})"
                if compliant
                else "no region meets its residency; restore one of its own regions"
            )
            + ", or omit the target to let the policy choose",
        )
    verdict = before.result.state.verdicts.get(target)  # type: ignore[call-overload]
    if verdict is not None and verdict.state in ("failed", "drained"):
        raise Conflict(
            f"{target} is {verdict.state}: it cannot take {region}'s traffic",
            fix="pick a serving target, or omit the target to let the policy choose",
        )


def _result(
    req: Request, before: windows.Prepared, after: windows.Prepared, *, audit_id: str, applied: bool
) -> ActionResult:
    old, new = before.result.state, after.result.state
    changes = []
    for region, v in sorted(new.verdicts.items()):
        o = old.verdicts.get(region)
        if (
            o is None
            or o.state != v.state
            or abs(o.weight - v.weight) > _EPS
            or abs(o.capacity_floor - v.capacity_floor) > _EPS
            or o.backup != v.backup
        ):
            changes.append(
                RegionChange(
                    region=region,
                    state_before=o.state if o else None,
                    state_after=v.state,
                    weight_before=o.weight if o else None,
                    weight_after=v.weight,
                    backup_after=v.backup,
                    floor_after=round(v.capacity_floor, 6),
                )
            )

    def shares(serving: Any) -> dict[str, dict[str, float]]:
        return {g: {r: round(s, 6) for r, s in m.items()} for g, m in serving.items()}

    return ActionResult(
        action=req.action,
        region=req.region,
        dry_run=req.dry_run,
        applied=applied,
        reason=req.reason,
        by=req.caller.name,
        audit_id=audit_id,
        changes=changes,
        serving_before=shares(old.serving),
        serving_after=shares(new.serving),
        events=[e.reason if e.region is None else f"{e.region}: {e.reason}" for e in after.events],
        alert=new.alert,
    )


async def region_action(leader: Leader, req: Request) -> Reply:
    async def work(fence: etcd.Fence, audit_id: str) -> Reply:
        me = fence.value.decode()
        region = req.region or ""
        before = await windows.prepare(
            store=leader.store, settings=leader.settings, clock=leader.clock, judge=False,
            controller=me,
        )  # fmt: skip
        if region not in before.topology.regions:
            raise NotFound(
                f"unknown region {region!r}; nothing was changed",
                fix=f"known regions: {', '.join(sorted(before.topology.regions)) or 'none'} "
                "(`meridianctl status`)",
            )
        _check_target(req, before)
        record = before.view.regions.get(region)
        current = record.override if record is not None else None
        override = _new_override(req, current, leader.clock.now())
        after = await windows.prepare(
            store=leader.store, settings=leader.settings, clock=leader.clock, judge=False,
            overrides={region: override}, controller=me,
        )  # fmt: skip
        _check_safe(req, before, after)
        result = _result(req, before, after, audit_id=audit_id, applied=not req.dry_run)
        reply = Reply(status=200, body=result.model_dump(mode="json"))
        detail = "; ".join(
            f"{c.region} {c.state_before}->{c.state_after} weight {c.weight_after:g}"
            for c in result.changes
        )
        audit = _audit(
            leader, req, fence, result="dry-run" if req.dry_run else "applied", status=200,
            detail=detail or "no change in the plan", entry_id=audit_id,
        )  # fmt: skip
        if req.dry_run:
            await leader.store.commit(puts=audit, fence=fence)
            return reply
        puts = {**audit, **_record(leader, req, reply)}
        deletes: tuple[str, ...] = ()
        if override is None:
            deletes = (keys.override(region),)
        else:
            puts[keys.override(region)] = override.model_dump_json().encode()
        await windows.commit(
            after, store=leader.store, fence=fence, settings=leader.settings, extra_puts=puts,
            deletes=deletes, on_commit=leader.hooks.committed,
        )  # fmt: skip
        return reply

    return await _run(leader, req, work)


def _check_safe(req: Request, before: windows.Prepared, after: windows.Prepared) -> None:
    region = req.region or ""
    new = after.result.state
    if req.action in ("drain", "failover"):
        alert = new.alert
        if alert is not None and alert != before.result.state.alert:
            raise Conflict(
                f"{req.action} of {region} would leave a geography with no region serving "
                f"({alert}); nothing was changed",
                fix="bring another region of that geography back first (undrain or failback "
                "it), or fail over to a region that can serve it",
            )
    if req.action == "failover":
        verdict = new.verdicts.get(region)  # type: ignore[call-overload]
        if verdict is None or verdict.backup is None:
            why = verdict.backup_reason if verdict is not None else "no verdict"
            raise Conflict(
                f"{region} has no compliant backup to take its traffic ({why}); nothing was "
                "changed",
                fix="bring a region that meets its residency back into service first",
            )
        if req.target is not None and verdict.backup != req.target:
            raise Conflict(
                f"{req.target} cannot take {region}'s traffic ({verdict.backup_reason}); "
                "nothing was changed",
                fix="omit the target to let the policy choose a compliant backup",
            )


# -- policies ---------------------------------------------------------------------------------


async def current_policies(settings: ControllerSettings, store: etcd.Store) -> PoliciesView:
    stored = await failover_policy.stored(store)
    if stored is None:
        return PoliciesView(values=failover_policy.configured(settings), source="settings")
    return PoliciesView(
        values=stored.values, source="etcd", reason=stored.reason, by=stored.by, at=stored.at
    )


def merge(
    values: failover_policy.PolicyValues, update: PoliciesUpdate, *, agent_heartbeat_s: float
) -> failover_policy.PolicyValues:
    changed = update.model_dump(exclude_none=True, exclude={"reason", "ttft_check"})
    merged = values.model_dump()
    merged.update(changed)
    if update.ttft_check is False:
        merged["ttft_p99_slo_s"] = None
    elif update.ttft_check is True and merged["ttft_p99_slo_s"] is None:
        merged["ttft_p99_slo_s"] = 5.0
    try:
        out = failover_policy.PolicyValues.model_validate(merged)
        failover_policy.config_of(out)
        problem = stale_problem(
            status_stale_s=out.status_stale_s, agent_heartbeat_s=agent_heartbeat_s
        )
        if problem is not None:
            raise ValueError(problem)
    except (pydantic.ValidationError, ValueError) as exc:
        raise Invalid(
            f"these policies are not valid: {_plain(exc)}; nothing was changed",
            fix="send values in range: see GET /v1/openapi.json (PoliciesUpdate)",
        ) from exc
    return out


def _plain(exc: Exception) -> str:
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return str(exc).replace("FailoverConfig.", "")


async def set_policies(leader: Leader, req: Request, update: PoliciesUpdate) -> Reply:
    async def work(fence: etcd.Fence, audit_id: str) -> Reply:
        now = leader.clock.now()
        view = await current_policies(leader.settings, leader.store)
        values = merge(
            view.values, update, agent_heartbeat_s=leader.settings.failover.agent_heartbeat_s
        )
        stored = failover_policy.StoredPolicies(
            values=values, reason=req.reason, by=req.caller.name, at=now
        )
        out = PoliciesView(
            values=values, source="etcd", reason=req.reason, by=req.caller.name, at=now
        )
        reply = Reply(status=200, body=out.model_dump(mode="json"))
        changed = {k: v for k, v in values.model_dump().items() if v != view.values.model_dump()[k]}
        verb = "would set " if req.dry_run else "set "
        audit = _audit(
            leader, req, fence, result="dry-run" if req.dry_run else "applied", status=200,
            entry_id=audit_id,
            detail=verb + (json.dumps(changed, sort_keys=True) if changed else "nothing new"),
        )  # fmt: skip
        if req.dry_run:  # answer the values it would store; store nothing but the audit
            await leader.store.commit(puts=audit, fence=fence)
            return reply
        puts = {failover_policy.KEY: stored.model_dump_json().encode(), **audit}
        puts.update(_record(leader, req, reply))
        await leader.store.commit(puts=puts, fence=fence)
        return reply

    return await _run(leader, req, work)
