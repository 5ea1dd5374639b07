"""Settings of ``meridian-agent``: one class, loaded once in ``main()`` and passed down.

Sources, highest first: command-line flags, environment variables (``MERIDIAN_AGENT_``, nested
groups joined by ``__``, e.g. ``MERIDIAN_AGENT_QUEUE__MAX_DEPTH=200``), the TOML file given with
``--config``, then the defaults below.  Invalid settings stop the agent at start with a message
naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from policies import routing


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Group):
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8080, ge=0, le=65535, description="TCP port; 0 picks a free one")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="largest request body accepted, in bytes (413 above)"
    )


class NodeSettings(_Group):
    url: str = Field(
        description="base URL of a vLLM (or meridian-sim) node, e.g. http://10.0.0.5:8000"
    )
    id: str | None = Field(None, description="node id; default host:port of the URL")
    weight: float = Field(1.0, gt=0, description="relative capacity for the weighted policy")
    slots: int | None = Field(
        None, gt=0, description="most requests in flight on this node; default queue.slots_per_node"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {value!r}")
        return value.rstrip("/")

    @property
    def node_id(self) -> str:
        if self.id:
            return self.id
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class RoutingSettings(_Group):
    policy: str = Field(
        "meridian", description=f"routing policy, one of {', '.join(routing.NAMES)}"
    )
    prefix_block_tokens: int = Field(
        16, gt=0, description="tokens per block when hashing prompt prefixes for routing"
    )
    tuning: dict[str, float | int] = Field(
        default_factory=dict,
        description="overrides of policies.routing.RoutingConfig fields (thresholds, weights)",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in routing.NAMES:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(routing.NAMES)}")
        return value

    @field_validator("tuning")
    @classmethod
    def _known_tuning(cls, value: dict[str, float | int]) -> dict[str, float | int]:
        try:
            routing.RoutingConfig(**value)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ValueError(f"bad routing tuning: {exc}") from exc
        return value

    def config(self) -> routing.RoutingConfig:
        return routing.RoutingConfig(**self.tuning)  # type: ignore[arg-type]


class TelemetrySettings(_Group):
    scrape_interval_s: float = Field(
        0.25, gt=0, description="seconds between /metrics scrapes of a node"
    )
    scrape_timeout_s: float = Field(1.0, gt=0, description="timeout of one scrape, seconds")
    stale_after_s: float = Field(
        1.0, gt=0, description="a sample older than this is unknown, never idle (seconds)"
    )
    models_refresh_s: float = Field(10.0, gt=0, description="seconds between /v1/models refreshes")


class HealthSettings(_Group):
    probe_interval_s: float = Field(1.0, gt=0, description="seconds between active /health probes")
    probe_timeout_s: float = Field(1.0, gt=0, description="timeout of one probe, seconds")
    unhealthy_after: int = Field(2, ge=1, description="consecutive failed probes before unhealthy")
    healthy_after: int = Field(2, ge=1, description="consecutive good probes before healthy again")
    eject_consecutive_errors: int = Field(
        5, ge=1, description="consecutive failed requests (5xx, reset, timeout) that eject a node"
    )
    eject_base_s: float = Field(30.0, gt=0, description="first ejection lasts this long (seconds)")
    eject_max_s: float = Field(300.0, gt=0, description="longest ejection (seconds)")
    max_ejected_fraction: float = Field(
        0.5, ge=0, le=1, description="most of the pool ejected at once (at least one node may be)"
    )
    latency_outlier_factor: float = Field(
        3.0,
        gt=1,
        description="eject a node whose time to first token is this many times its peers'",
    )
    latency_outlier_min_s: float = Field(
        0.5, ge=0, description="never call a node slow below this time to first token (seconds)"
    )
    latency_min_samples: int = Field(
        20, ge=1, description="samples before latency ejection applies"
    )
    slow_start_s: float = Field(
        30.0, ge=0, description="after (re)admission, traffic ramps up over this many seconds"
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="draining node: in-flight requests get this long to finish (seconds)",
    )


class QueueSettings(_Group):
    slots_per_node: int = Field(64, gt=0, description="most requests in flight on one node")
    max_depth: int = Field(1024, ge=0, description="requests waiting per model before 429")
    max_wait_low_s: float = Field(
        10.0, gt=0, description="a lower-priority request waits at most this long behind others"
    )
    deadline_s: float = Field(
        120.0, gt=0, description="a request still queued after this long gets 504 (seconds)"
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After sent with 429 (seconds)")
    tenant_priority: dict[str, str] = Field(
        default_factory=dict, description="X-Tenant value -> priority class (high, normal, low)"
    )


class RetrySettings(_Group):
    max_attempts: int = Field(3, ge=1, description="tries per request, the first included")
    budget_ratio: float = Field(
        0.2, ge=0, description="retries allowed as a fraction of requests (a retry budget)"
    )
    budget_min_per_s: float = Field(3.0, ge=0, description="retries always allowed per second")


class UpstreamSettings(_Group):
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout to a node")
    first_byte_timeout_s: float = Field(
        300.0, gt=0, description="time allowed for a node's response headers (seconds)"
    )
    read_timeout_s: float = Field(
        60.0, gt=0, description="longest silence inside a streaming response (seconds)"
    )


class AdminSettings(_Group):
    token: SecretStr | None = Field(
        None, description="bearer token for /admin/*; admin endpoints answer 401 when unset"
    )


class TelemetryExportSettings(_Group):
    console_spans: bool = Field(False, description="print OpenTelemetry spans to stderr")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MERIDIAN_AGENT_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    server: ServerSettings = ServerSettings()
    nodes: list[NodeSettings] = Field(default_factory=list, description="the region's nodes")
    routing: RoutingSettings = RoutingSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    health: HealthSettings = HealthSettings()
    queue: QueueSettings = QueueSettings()
    retry: RetrySettings = RetrySettings()
    upstream: UpstreamSettings = UpstreamSettings()
    admin: AdminSettings = AdminSettings()
    otel: TelemetryExportSettings = TelemetryExportSettings()

    @model_validator(mode="after")
    def _unique_nodes(self) -> Settings:
        seen: set[str] = set()
        for i, node in enumerate(self.nodes):
            if node.node_id in seen:
                raise ValueError(f"nodes[{i}]: duplicate node id {node.node_id!r}")
            seen.add(node.node_id)
        return self


def load(*, config_file: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Settings from flags (``overrides``) > environment > ``config_file`` > defaults."""
    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")

    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if config_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
            return tuple(sources)

    return _Loaded(**(overrides or {}))
