"""Settings of ``meridian-controller``: flags over ``MERIDIAN_CONTROLLER_*`` over the TOML file
given with ``--config`` over these defaults.  Invalid settings stop the process at start with a
message naming the field.

``ControllerSettings`` (here) groups ``etcd``, ``election``, ``failover``, ``server``, ...; the
admin API's group is in ``settings.api`` and DNS steering's in ``settings.dns``, so that every
layer of the controller reads its settings from below.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

import meridian_etcd
from controlplane.settings.api import ApiSettings, ConnectionSettings
from controlplane.settings.dns import DnsSettings
from meridian_etcd import endpoints as etcd_endpoints
from meridian_service import otlp
from meridian_service import settings as settings_loading
from meridian_wire import keys
from meridian_wire.models import REGION_ID, RESIDENCY_TAG
from policies.failover import BackupRank, ShareRule


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EtcdSettings(_Group):
    endpoints: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:2379"],
        description="etcd client URLs; the controller moves to the next when one fails",
    )
    timeout_s: float = Field(3.0, gt=0, description="timeout of one etcd call, seconds")
    max_txn_ops: int = Field(
        128,
        ge=2,
        description="the most operations etcd takes in one transaction (its --max-txn-ops, 128 "
        "by default): a window pass that writes more is split into transactions of this many",
    )
    ca_file: Path | None = Field(
        None,
        description="PEM CA that signed the etcd members' certificates; required with https:// "
        "endpoints, refused with http:// ones (docs/security.md#etcd-tls-users-and-roles)",
    )
    cert_file: Path | None = Field(
        None,
        description="PEM client certificate for etcd's --client-cert-auth; its CN is the etcd "
        "user (meridian-controller); with key_file",
    )
    key_file: Path | None = Field(None, description="PEM private key of cert_file")
    user: str | None = Field(
        None, description="etcd user to authenticate as by password (with password_file)"
    )
    password_file: Path | None = Field(
        None, description="file holding the user's password (one line; never logged)"
    )

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            etcd_endpoints.parse(url)  # one parser for every etcd URL (meridian_etcd.endpoints)
        return value

    @model_validator(mode="after")
    def _access(self) -> EtcdSettings:
        # TLS and auth go with the URLs (no https:// without a CA, no TLS files with http://,
        # no mix); the files must be usable now
        meridian_etcd.check_settings(prefix="etcd.", **self._fields())
        return self

    def _fields(self) -> dict[str, Any]:
        return {
            "endpoints": self.endpoints,
            "ca_file": self.ca_file,
            "cert_file": self.cert_file,
            "key_file": self.key_file,
            "user": self.user,
            "password_file": self.password_file,
        }

    def client_config(self) -> meridian_etcd.ClientConfig:
        """How the controller reaches etcd: URLs, time limit, TLS and credentials."""
        return meridian_etcd.ClientConfig(
            timeout_s=self.timeout_s, max_txn_ops=self.max_txn_ops, **self._fields()
        )


class ElectionSettings(_Group):
    id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="this replica's name in the leader key; default host-pid",
    )
    lease_ttl_s: int = Field(
        10, ge=2, description="leader lease TTL, seconds: a dead leader is replaced within it"
    )


def stale_problem(*, status_stale_s: float, agent_heartbeat_s: float) -> str | None:
    """Why ``status_stale_s`` cannot work with agents that heartbeat every
    ``agent_heartbeat_s``, or ``None``.  An idle agent's status is up to a heartbeat old when
    judged, plus its debounce and retries: a stale limit under two heartbeats fails healthy idle
    regions now and then (a limit of 10 s against the default 30 s heartbeat failed both eu
    regions 13 times in 10 minutes)."""
    if status_stale_s >= 2 * agent_heartbeat_s:
        return None
    return (
        f"failover.status_stale_s ({status_stale_s:g} s) must be at least twice "
        f"failover.agent_heartbeat_s ({agent_heartbeat_s:g} s, the agents' region.window_s): "
        f"raise status_stale_s to {2 * agent_heartbeat_s:g} or more, or lower both heartbeats"
    )


class FailoverSettings(_Group):
    window_s: float = Field(30.0, gt=0, description="length of a health window, seconds")
    strikes: int = Field(3, ge=1, description="consecutive failed windows before failed")
    recovery_windows: int = Field(2, ge=1, description="consecutive good windows to recover")
    ramp: list[float] = Field(
        default_factory=lambda: [0.05, 0.25, 0.5, 1.0],
        description="traffic weight per good window while recovering; increasing, ends at 1.0",
    )
    min_hold_s: float = Field(60.0, ge=0, description="least time in failed before recovering")
    status_stale_s: float = Field(
        60.0,
        gt=0,
        description="a region status older than this fails the window (seconds); at least "
        "twice agent_heartbeat_s",
    )
    agent_heartbeat_s: float = Field(
        30.0,
        gt=0,
        description="how often an idle agent rewrites its status (the agents' region.window_s); "
        "status_stale_s must be at least twice this, or idle regions flap",
    )
    min_healthy_fraction: float = Field(
        0.5, ge=0, le=1, description="a window fails below this share of healthy nodes"
    )
    max_error_rate: float = Field(0.05, ge=0, le=1, description="a window fails above this")
    ttft_p99_slo_s: float = Field(
        5.0, gt=0, description="a window fails when p99 time to first token is above (seconds)"
    )
    prewarm_fraction: float = Field(
        0.5, ge=0, le=1, description="backup capacity floor, as a share of what it protects"
    )
    shares: ShareRule = Field(
        "capacity",
        description="each region's base share of its geography's traffic (DNS): its serving "
        "capacity, or equal",
    )
    backup_rank: BackupRank = Field(
        "latency",
        description="how automatic backups rank: the round trip plus the candidate's published "
        "p99 TTFT (latency), or the round trip alone (proximity)",
    )
    latency_hysteresis_ms: float = Field(
        250.0,
        ge=0,
        description="with backup_rank latency, a region's backup is replaced only by one whose "
        "first token is expected this much sooner (TTFTs move with load)",
    )

    @model_validator(mode="after")
    def _stale_after_heartbeats(self) -> FailoverSettings:
        problem = stale_problem(
            status_stale_s=self.status_stale_s, agent_heartbeat_s=self.agent_heartbeat_s
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_validator("ramp")
    @classmethod
    def _ramp(cls, value: list[float]) -> list[float]:
        if not value or value[-1] != 1.0:
            raise ValueError("the ramp must end at 1.0")
        if any(b <= a for a, b in itertools.pairwise(value)) or value[0] <= 0:
            raise ValueError("the ramp must be increasing and positive")
        return value


class RegionConfig(_Group):
    id: str
    geo: str = Field(description="the geography it serves (one DNS view per geography)")
    residency: list[str] = Field(default_factory=list, description="data-residency tags it meets")
    backups: list[str] = Field(
        default_factory=list, description="backup regions in order of preference"
    )
    lat: float | None = Field(None, ge=-90, le=90)
    lon: float | None = Field(None, ge=-180, le=180)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not REGION_ID.match(value):
            raise ValueError(f"region id {value!r}: lowercase letters, digits and dashes")
        return value

    @field_validator("residency")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        for tag in value:
            if not RESIDENCY_TAG.match(tag):
                raise ValueError(f"residency tag {tag!r}: lowercase letters, digits and dashes")
        return value


class ProbeSettings(_Group):
    """Probing regions' published endpoints from every controller replica (docs/controller.md,
    "Probing from outside")."""

    enabled: bool = Field(
        False,
        description="probe every region's published endpoints from this replica; a window fails "
        "when a majority of the replicas that probed could not reach the region",
    )
    interval_s: float = Field(10.0, gt=0, description="one probe round every this many seconds")
    timeout_s: float = Field(
        2.0, gt=0, description="a probe not answered within this fails (connect and answer)"
    )
    path: str = Field(
        "/v1/models",
        description="the cheap OpenAI call each probe makes (GET); no GPU work on the agent",
    )
    api_key_file: Path | None = Field(
        None,
        description="file holding the API key the probes send as 'Authorization: Bearer' (one "
        "line; never logged); a 401 or 403 still counts as reached",
    )
    ca_file: Path | None = Field(
        None, description="PEM CA that signed https:// endpoints' certificates; default: system"
    )
    max_age_s: float | None = Field(
        None,
        gt=0,
        description="a replica's round older than this does not vote; default 3 x interval_s",
    )
    concurrency: int = Field(64, ge=1, description="probes in flight at once per replica")
    region: str | None = Field(
        None,
        description="the region this replica runs in (its vantage point): its probes' times "
        "then measure the round trip from there to each region, for backups where latency_ms "
        "does not say",
    )

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"probe.path must start with '/', e.g. /v1/models; got {value!r}")
        return value

    @field_validator("api_key_file", "ca_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"{value}: no such file")
        return value

    @model_validator(mode="after")
    def _timing(self) -> ProbeSettings:
        if self.timeout_s >= self.interval_s:
            raise ValueError(
                f"probe.timeout_s ({self.timeout_s:g} s) must be below probe.interval_s "
                f"({self.interval_s:g} s): a round must end before the next starts"
            )
        if self.max_age_s is not None and self.max_age_s < self.interval_s:
            raise ValueError(
                f"probe.max_age_s ({self.max_age_s:g} s) must be at least probe.interval_s "
                f"({self.interval_s:g} s), or every round is stale before the next"
            )
        return self

    @property
    def vote_age_s(self) -> float:
        """How old a replica's round may be and still vote."""
        return self.max_age_s if self.max_age_s is not None else 3 * self.interval_s

    def api_key(self) -> str | None:
        """The key from ``api_key_file``, read now (rotated keys are picked up each round)."""
        if self.api_key_file is None:
            return None
        return self.api_key_file.read_text().strip() or None


class EventSettings(_Group):
    retention: int = Field(1000, ge=10, description="events kept in etcd; older ones are pruned")


class ServerSettings(ConnectionSettings):
    host: str = Field(
        "127.0.0.1", description="address of the read port: /health and the admin API's reads"
    )
    port: int = Field(8090, ge=0, le=65535, description="the read port; 0 picks one")


class ControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MERIDIAN_CONTROLLER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    etcd: EtcdSettings = EtcdSettings()
    election: ElectionSettings = ElectionSettings()
    failover: FailoverSettings = FailoverSettings()
    regions: list[RegionConfig] = Field(
        default_factory=list,
        description="known regions; regions that only appear in etcd get automatic backups",
    )
    latency_ms: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="round-trip latency between regions, ms (for backups)"
    )
    probe: ProbeSettings = ProbeSettings()
    events: EventSettings = EventSettings()
    server: ServerSettings = ServerSettings()
    api: ApiSettings = Field(
        default_factory=ApiSettings,
        description="the admin API: port, TLS, bearer tokens (controlplane/settings/api.py)",
    )
    dns: DnsSettings = Field(
        default_factory=DnsSettings,
        description="DNS steering: server, views, TSIG keys; off by default (docs/dns.md)",
    )
    otel: otlp.OtlpSettings = Field(
        default_factory=otlp.OtlpSettings,
        description="OTLP export of the replica's metrics; off without an endpoint "
        "(docs/observability.md#otlp)",
    )

    @model_validator(mode="after")
    def _probe_id(self) -> ControllerSettings:
        if self.probe.enabled and not keys.AGENT_ID.match(self.election.id):
            raise ValueError(
                f"election.id {self.election.id!r}: with probe.enabled it names this replica's "
                "probe key, so it must be 1-63 lowercase letters, digits, dots, dashes, "
                "underscores; set election.id (--id)"
            )
        return self

    @model_validator(mode="after")
    def _backups(self) -> ControllerSettings:
        by_id = {r.id: r for r in self.regions}
        if len(by_id) != len(self.regions):
            raise ValueError("regions: duplicate region id")
        for i, region in enumerate(self.regions):
            for j, backup in enumerate(region.backups):
                where = f"regions[{i}].backups[{j}]"
                if backup == region.id:
                    raise ValueError(f"{where}: {region.id} cannot back itself up")
                if backup not in by_id:
                    raise ValueError(f"{where}: unknown region {backup!r}")
                missing = set(region.residency) - set(by_id[backup].residency)
                if missing:
                    raise ValueError(
                        f"{where}: {backup} lacks residency {sorted(missing)} that {region.id} "
                        "requires; pick a compliant backup"
                    )
        for a, row in self.latency_ms.items():
            for b, ms in row.items():
                if ms < 0:
                    raise ValueError(f"latency_ms.{a}.{b}: must be >= 0")
        return self


def load(
    *, config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> ControllerSettings:
    """Settings from flags (``overrides``) > environment > ``config_file`` > defaults."""
    return settings_loading.load_settings(
        ControllerSettings, config_file=config_file, overrides=overrides
    )
