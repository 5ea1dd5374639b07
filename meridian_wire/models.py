"""Pydantic models of the JSON values in etcd.  Unknown fields are ignored on read, so an older
controller can read a newer agent's status; a value that does not validate is reported with its
key and skipped for that window by whoever reads it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

REGION_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
RESIDENCY_TAG = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")


class _Value(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


AdminState = Literal["active", "draining", "drained"]


class RegionLoad(_Value):
    queue_depth: int = Field(0, ge=0, description="requests waiting in the agent's queue")
    in_flight: int = Field(0, ge=0, description="requests on the region's nodes")
    kv_util: float = Field(0.0, ge=0, le=1, description="mean KV cache use of healthy nodes, 0..1")
    requests_per_s: float = Field(0.0, ge=0, description="requests finished per second")
    error_rate: float = Field(0.0, ge=0, le=1, description="failed share of finished requests")
    ttft_p99_s: float | None = Field(None, ge=0, description="p99 time to first token, seconds")
    spilled_per_s: float = Field(
        0.0, ge=0, description="requests per second other regions served for this one (spill-over)"
    )


class GroupLayout(_Value):
    """The GPU groups an agent routes over with group tables, and the parameters of their
    assignment (``policies.groups.assign``): with them a reader computes the same base table
    the agents paint their stored ranges over."""

    groups: dict[str, float] = Field(
        description="GPU group id -> weight (its nodes' weights summed)"
    )
    n_buckets: int = Field(16_384, ge=1, description="hash buckets per table")
    vnodes: int = Field(8, ge=1, description="ring points per group of mean weight")
    load_factor: float = Field(1.25, ge=1, description="bound on a group's share of buckets")


class RegionStatus(_Value):
    """What one agent of a region says of the region (``regions/<r>/agents/<a>/status``; the
    controller combines the statuses of a region's live agents into one of these)."""

    region: str
    geo: str = Field(description="the geography this region serves, e.g. eu, us-east")
    residency: list[str] = Field(default_factory=list, description="data-residency tags it meets")
    endpoints: list[str] = Field(default_factory=list, description="client-facing URLs")
    nodes_healthy: int = Field(ge=0)
    nodes_total: int = Field(ge=0)
    capacity: float = Field(
        ge=0, description="serving capacity: healthy nodes' weights summed (H100 = 1.0)"
    )
    capacity_floor: float = Field(0.0, ge=0, description="the floor the agent is honouring now")
    models: dict[str, float] | None = Field(
        None,
        description="model -> serving capacity (healthy nodes serving it, weights summed); a "
        "model of the region's nodes with none healthy is 0; None: not published (older agents)",
    )
    load: RegionLoad = RegionLoad()
    admin: AdminState = Field(
        "active", description="the admin state the agent last read from its desired value"
    )
    observed_generation: int = Field(
        0, ge=0, description="generation of the last desired value the agent applied"
    )
    agent_id: str = ""
    group_layout: GroupLayout | None = Field(
        None, description="the GPU groups of the agent's group tables; None: no group routing"
    )
    updated_at: float = Field(description="unix time of this status")

    @field_validator("region")
    @classmethod
    def _region(cls, value: str) -> str:
        if not REGION_ID.match(value):
            raise ValueError(f"region id {value!r} must be lowercase letters, digits and dashes")
        return value


class RegionDesired(_Value):
    """What the controller wants of a region (``regions/<r>/desired``)."""

    admin: AdminState = "active"
    weight: float = Field(1.0, ge=0, le=1, description="share of its geography's traffic, 0..1")
    capacity_floor: float = Field(
        0.0, ge=0, description="capacity to keep warm, node-equivalents (pre-warm for a backup)"
    )
    protects: list[str] = Field(default_factory=list, description="regions this one backs up")
    model_floors: dict[str, float] = Field(
        default_factory=dict,
        description="per model, the capacity to keep warm for the regions it backs up for it",
    )
    reason: str = ""
    generation: int = 0


HealthState = Literal["healthy", "suspect", "failed", "recovering", "drained"]


class RegionHealth(_Value):
    """The controller's judgement of a region (``regions/<r>/health``)."""

    state: HealthState
    strikes: int = Field(0, ge=0)
    good_windows: int = Field(0, ge=0)
    since: float = Field(description="unix time the region entered this state")
    reason: str
    weight: float = Field(1.0, ge=0, le=1)
    backup: str | None = None
    backup_reason: str = ""
    model_backups: dict[str, str | None] = Field(
        default_factory=dict,
        description="each of its models' backup; null: no compliant region serves the model",
    )
    manual: bool = False
    window: int = Field(0, ge=0, description="the controller's window counter")


class RegionOverride(_Value):
    """An operator's standing order for a region (``regions/<r>/override``), kept until
    cleared: a manual failover holds until a manual failback, a drain until an undrain."""

    failover: bool = False
    target: str | None = Field(None, description="the region to fail over to; default backup")
    admin: AdminState = "active"
    reason: str
    by: str = ""
    at: float


class FleetPlan(_Value):
    """The plan in force and the controller's memory between windows (``controller/plan``).

    ``serving`` is what DNS steering applies: per geography, region -> share of its traffic.
    ``state`` is the failover policy's own state, opaque to everyone but the controller;
    ``unreachable`` is what the last pass judged of the probes (an event when it changes);
    ``last_status`` keeps each region's last valid status, so a malformed one is ignored for a
    window rather than counted as missing.
    """

    window: int = 0
    serving: dict[str, dict[str, float]] = Field(default_factory=dict)
    alert: str | None = None
    state: dict[str, Any] = Field(default_factory=dict)
    last_status: dict[str, RegionStatus] = Field(default_factory=dict)
    unreachable: list[str] = Field(
        default_factory=list,
        description="regions a majority of the controller replicas that probed could not reach",
    )
    measured_latency_ms: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="round trip from a controller replica's region to a region, as its probes "
        "measured it (ms): from -> to -> ms",
    )
    updated_at: float = 0.0
    controller: str = ""


class GroupTable(_Value):
    """One range of a region's routing table (``routing/<r>/groups/<kind>-<first>``): the hash
    buckets ``[first, end)`` of prefix or session keys are served by GPU group ``owner``
    (``policies.groups``).  Written by agents, debounced, under their lease."""

    region: str
    kind: Literal["prefix", "session"] = "prefix"
    first: int = Field(ge=0)
    end: int = Field(gt=0)
    owner: str = Field(min_length=1, description="the GPU group serving these buckets")
    n_buckets: int = Field(16_384, ge=1, description="buckets in the whole table")
    agent: str = ""
    updated_at: float

    @model_validator(mode="after")
    def _span(self) -> GroupTable:
        if not self.first < self.end <= self.n_buckets:
            raise ValueError(
                f"range [{self.first}, {self.end}) is not a non-empty span of [0, {self.n_buckets})"
            )
        return self


class EndpointProbe(_Value):
    """One probe of one of a region's published endpoints (``ProbeReport.regions``)."""

    endpoint: str
    ok: bool = Field(description="the endpoint answered (2xx, or 401/403: reached, key refused)")
    status: int | None = Field(None, description="HTTP status; None: no answer")
    latency_ms: float | None = Field(None, ge=0, description="time to the answer, ms")
    error: str = Field("", description="why not ok, e.g. 'timed out after 2 s'")


class ProbeReport(_Value):
    """One controller replica's last probe round (``controller/probes/<replica>``), under the
    replica's own lease: a replica that stops probing stops counting."""

    replica: str
    region: str | None = Field(None, description="the region the replica runs in (probe.region)")
    at: float = Field(description="unix time the round ended")
    interval_s: float = Field(gt=0, description="the replica's probe interval")
    regions: dict[str, list[EndpointProbe]] = Field(
        default_factory=dict, description="region -> a probe of each of its endpoints"
    )


class Event(_Value):
    at: float
    kind: str
    region: str | None = None
    reason: str
    data: dict[str, object] = Field(default_factory=dict)
    controller: str = ""


class DnsRecord(_Value):
    """One RRset as the controller wants it served (``DnsApplied.views[].records``)."""

    name: str = Field(description="absolute name, e.g. api.meridian.example.")
    type: Literal["A", "AAAA", "SRV", "TXT"]
    ttl_s: int = Field(ge=0)
    values: list[str] = Field(description="rdata in presentation form, e.g. '10 95 443 host.'")


class DnsViewApplied(_Value):
    """One view of the authoritative server, as last applied."""

    view: str
    zone: str
    geo: str = Field(description="the geography whose answer the view serves")
    records: list[DnsRecord] = Field(default_factory=list)
    hold: bool = Field(False, description="no answer to give: the zone was left as it was")
    reason: str = Field("", description="why these records, e.g. 'serving eu-west 95%, ...'")
    changes: int = Field(0, ge=0, description="RRsets changed by the last update of this view")


class DnsApplied(_Value):
    """What DNS steering last applied (``dns/applied``), written by the leader when it changes.

    ``generation`` is the DNS plan generation every view serves now (the TXT record says the
    same); ``desired_generation`` is the newest plan, ahead of ``generation`` while an update is
    failing (``error`` says why, e.g. the server is down or refuses the key).
    """

    backend: Literal["rfc2136", "dry-run"]
    server: str = Field(description="host:port of the authoritative server")
    generation: int = Field(0, ge=0, description="plan generation applied (0: none yet)")
    desired_generation: int = Field(0, ge=0, description="the newest plan's generation")
    fingerprint: str = Field("", description="digest of the applied records, sans generation")
    window: int = Field(0, ge=0, description="the controller window the plan came from")
    applied_at: float | None = Field(None, description="unix time of the last successful apply")
    views: dict[str, DnsViewApplied] = Field(default_factory=dict)
    updates: int = Field(0, ge=0, description="update messages sent by this leader so far")
    error: str | None = Field(None, description="the last failure, until an apply succeeds")
    error_at: float | None = None
    controller: str = ""
