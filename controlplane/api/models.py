"""Bodies of the admin API and the values it keeps in etcd (pydantic, the API's edge).

The OpenAPI document (``/v1/openapi.json``) is generated from these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from controlplane.failover_policy import PolicyValues
from meridian_wire.models import DnsApplied
from policies.failover import BackupRank, ShareRule

Action = Literal["drain", "undrain", "failover", "failback", "policies"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class Problem(_Out):
    """RFC 9457 problem details (``application/problem+json``)."""

    type: str = Field(description="a URN naming the kind of problem")
    title: str
    status: int
    detail: str = Field(description="what went wrong")
    fix: str = Field("", description="what to do instead")
    errors: list[str] = Field(default_factory=list, description="each invalid field, if any")


# -- policies -----------------------------------------------------------------------------------


class PoliciesView(_Out):
    values: PolicyValues
    source: Literal["settings", "etcd"] = Field(
        description="settings: the controller's configuration; etcd: set through this API"
    )
    reason: str = ""
    by: str = ""
    at: float | None = None


class PoliciesUpdate(_Body):
    """Fields to change (the rest keep their value), and why."""

    reason: str = Field(min_length=1, max_length=500, description="why (audited)")
    window_s: float | None = Field(None, gt=0, le=3600)
    strikes: int | None = Field(None, ge=1, le=100)
    recovery_windows: int | None = Field(None, ge=1, le=100)
    ramp: list[float] | None = Field(None, min_length=1, max_length=20)
    min_hold_s: float | None = Field(None, ge=0, le=86400)
    status_stale_s: float | None = Field(None, gt=0, le=86400)
    min_healthy_fraction: float | None = Field(None, ge=0, le=1)
    max_error_rate: float | None = Field(None, ge=0, le=1)
    ttft_p99_slo_s: float | None = Field(None, gt=0, le=3600)
    ttft_check: bool | None = Field(None, description="false turns the TTFT check off")
    prewarm_fraction: float | None = Field(None, ge=0, le=1)
    shares: ShareRule | None = Field(
        None, description="a region's base share of its geography: capacity or equal"
    )
    backup_rank: BackupRank | None = Field(
        None, description="automatic backups by round trip + p99 TTFT (latency) or proximity"
    )
    latency_hysteresis_ms: float | None = Field(None, ge=0, le=60_000)


# -- actions ------------------------------------------------------------------------------------


class ActionRequest(_Body):
    reason: str = Field(min_length=1, max_length=500, description="why (audited)")


class FailoverRequest(_Body):
    reason: str = Field(min_length=1, max_length=500, description="why (audited)")
    target: str | None = Field(
        None,
        max_length=63,
        description="region to move the traffic to; default: the compliant backup the "
        "policy chooses.  A target that lacks the region's residency tags is refused.",
    )


class RegionChange(_Out):
    region: str
    state_before: str | None
    state_after: str
    weight_before: float | None
    weight_after: float
    backup_after: str | None
    floor_after: float


class ActionResult(_Out):
    action: Action
    region: str | None
    dry_run: bool
    applied: bool = Field(description="true when the change was written (never on a dry run)")
    reason: str
    by: str
    audit_id: str
    changes: list[RegionChange] = Field(description="regions whose state, weight or floor move")
    serving_before: dict[str, dict[str, float]] = Field(
        description="per geography, region -> share of traffic, before"
    )
    serving_after: dict[str, dict[str, float]] = Field(description="the same, after")
    events: list[str] = Field(description="what the policy says happens, in words")
    alert: str | None = None


# -- reads --------------------------------------------------------------------------------------


class RegionRow(_Out):
    region: str
    geo: str | None = None
    residency: list[str] = Field(default_factory=list)
    alive: bool
    state: str | None = Field(description="healthy, suspect, failed, recovering, drained")
    strikes: int = 0
    capacity: float | None = Field(description="serving capacity, node-equivalents")
    load: dict[str, Any] | None = Field(description="the agent's load figures")
    weight: float | None = Field(description="share of its own traffic it keeps, 0..1")
    backup: str | None = None
    floor: float | None = Field(description="capacity kept warm for regions it protects")
    admin: str = "active"
    manual_failover: bool = False
    models: dict[str, float] | None = Field(
        None, description="model -> serving capacity, as its agents publish it (null: not)"
    )
    model_backups: dict[str, str | None] = Field(
        default_factory=dict,
        description="each of its models' backup; null: no compliant region serves the model",
    )
    model_floors: dict[str, float] = Field(
        default_factory=dict, description="per model, capacity kept warm for regions it backs up"
    )
    unreachable: bool = Field(
        False,
        description="a majority of the controller replicas that probed its endpoints could not "
        "reach it, at the last pass (probe.enabled)",
    )
    reason: str = ""


class RegionList(_Out):
    regions: list[RegionRow]
    alert: str | None = None
    window: int = 0
    serving: dict[str, dict[str, float]] = Field(default_factory=dict)
    bad_values: list[str] = Field(default_factory=list)


class RegionDetail(_Out):
    row: RegionRow
    status: dict[str, Any] | None
    health: dict[str, Any] | None
    desired: dict[str, Any] | None
    override: dict[str, Any] | None
    agents: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="each agent replica of the region: alive, status readable, updated at",
    )
    tables: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="its group routing tables per kind: groups and their buckets, ranges "
        "stored, staleness (routing.policy = groups)",
    )
    probes: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="each controller replica's last probe of its endpoints: the round's age "
        "and, per endpoint, ok, HTTP status, latency and error (probe.enabled)",
    )
    measured_latency_ms: dict[str, float] = Field(
        default_factory=dict,
        description="round trip to it from each region a controller replica probes from "
        "(probe.region), as measured, ms; used for backups where latency_ms says nothing",
    )
    reach: dict[str, Any] | None = Field(
        None,
        description="the replicas' votes now: reached, failed, unreachable, reason; null when "
        "no replica's round votes",
    )


class DnsView(_Out):
    applied: DnsApplied | None = Field(
        description="dns/applied as the leader stored it; null before the first apply"
    )
    problem: str | None = Field(None, description="why a stored value could not be read")


class EventList(_Out):
    events: list[dict[str, Any]]
    cursor: str | None = Field(description="pass as ?after= to get only newer events")


class AuditEntry(_Out):
    """``audit/<time>-<id>``: who did what, when, why, and what came of it."""

    id: str
    at: float
    who: str
    role: str
    action: Action
    region: str | None = None
    target: str | None = None
    reason: str
    dry_run: bool = False
    result: Literal["applied", "dry-run", "refused", "error"]
    status: int
    detail: str = ""
    controller: str = ""
    received_by: str = ""
    idempotency_key: str | None = None


class AuditList(_Out):
    entries: list[AuditEntry]


class ApiHealth(_Out):
    status: Literal["ok"] = "ok"
    id: str
    leading: bool
    leader: str | None
    etcd: Literal["ok", "unavailable"]
    window: int | None
    alert: str | None
    pass_s: float | None = Field(None, description="how long this replica's last window pass took")
    pass_writes: int | None = Field(None, description="keys the last window pass wrote")


class IdempotencyRecord(_Out):
    """``idempotency/<hash>``: the answer given to one Idempotency-Key."""

    body_sha256: str
    status: int
    body: dict[str, Any]
    at: float


class AdminEndpoint(_Out):
    """``controller/admin``: where the leader's admin API listens (for forwarded writes)."""

    id: str
    url: str
