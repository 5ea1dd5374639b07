"""OTLP export of a process's spans and metrics to an OpenTelemetry collector.

The agent (``[otel]`` of its settings), the controller (its ``[otel]``) and the simulated node
(``meridian-sim node --otlp-traces-endpoint``) export with the official exporters
(``opentelemetry-exporter-otlp-proto-http``; ``...-proto-grpc`` with ``protocol = "grpc"``):

- spans through a ``BatchSpanProcessor`` with a bounded queue (``max_queue_size``): ending a
  span appends it to the queue and returns; a worker thread sends batches.  A full queue drops
  the newest span (the SDK's rule), so a collector that is down or slow never slows a request
  and never grows memory;
- metrics through a ``PeriodicExportingMetricReader`` (every ``metrics_interval_s``, on its
  own thread) beside the Prometheus reader of ``/metrics``: the same instruments, read twice.

What the exporters log when a collector does not answer (a line per failed batch, and one per
retry) goes through one rate-limited filter (:func:`meridian_service.logs.install_export_filter`):
at most one line a minute, with a count of what it left out.  Header values are secrets
(``SecretStr``): never logged, ``***`` in ``--check-config``.

The exporters are imported only when an endpoint is set: a process that exports nothing loads
none of them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from meridian_service import logs, version

log = logging.getLogger(__name__)

Protocol = Literal["http/protobuf", "grpc"]
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP token (RFC 9110)


class OtlpSettings(BaseModel):
    """``[otel]``: where and what to export over OTLP; without ``endpoint``, nothing is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str | None = Field(
        None,
        description="the OTLP collector's base URL: http://collector:4318 for http/protobuf "
        "(/v1/traces and /v1/metrics are appended), http://collector:4317 for grpc (https:// "
        "for TLS with the system's CAs); unset: nothing is exported",
    )
    protocol: Protocol = Field(
        "http/protobuf",
        description="http/protobuf (the default: requests on a worker thread, through any "
        "HTTP balancer) or grpc",
    )
    headers: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="headers sent with every export (a collector's API key); the values are "
        "secrets: never logged, masked by --check-config; best set in the environment, e.g. "
        'MERIDIAN_AGENT_OTEL__HEADERS=\'{"x-api-key": "..."}\' (MERIDIAN_CONTROLLER_ for the '
        "controller)",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        le=120,
        description="one export's deadline, retries included (seconds); also bounds how long "
        "a stop waits to flush what is left",
    )
    traces: bool = Field(True, description="export spans (with endpoint set)")
    trace_sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="share of requests traced when the client sends no trace context (0..1); "
        "a client's traceparent decides for its own request (parent-based sampling: sampled "
        "flag 01 traced, 00 not).  A request that is not traced costs no span at all",
    )
    metrics: bool = Field(True, description="export metrics (with endpoint set)")
    metrics_interval_s: float = Field(
        60.0, gt=0, description="how often metrics are exported (seconds)"
    )
    max_queue_size: int = Field(
        2048,
        ge=1,
        le=1_000_000,
        description="spans waiting to be exported; beyond it new spans are dropped, never "
        "waited for",
    )
    service_name: str | None = Field(
        None, description="service.name of the exported resource, instead of the process's own"
    )
    resource_attributes: dict[str, str] = Field(
        default_factory=dict,
        description="more attributes of the exported resource, e.g. "
        '{"deployment.environment.name" = "prod"}',
    )

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"must be an http:// or https:// URL with a host, e.g. http://collector:4318, "
                f"got {value!r}"
            )
        return value.strip().rstrip("/")

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, secret in value.items():
            if not _HEADER_NAME.match(name):
                raise ValueError(f"header name {name!r} is not an HTTP token")
            if any(c in secret.get_secret_value() for c in "\r\n\0"):
                raise ValueError(f"the value of header {name!r} holds a line break or NUL")
        return value

    @property
    def exports_traces(self) -> bool:
        return self.endpoint is not None and self.traces

    @property
    def exports_metrics(self) -> bool:
        return self.endpoint is not None and self.metrics

    def plain_headers(self) -> dict[str, str]:
        """The headers with their values, for the exporters only (grpc wants lowercase names)."""
        return {k.lower(): v.get_secret_value() for k, v in self.headers.items()}


def resource(
    settings: OtlpSettings, *, service: str, instance: str, region: str | None = None
) -> Resource:
    """The exported resource: ``service.name`` (``service_name``, else ``service``),
    ``service.version``, ``service.instance.id``, ``meridian.region`` when there is one, and
    ``resource_attributes``; ``OTEL_RESOURCE_ATTRIBUTES`` is merged in by the SDK."""
    attributes: dict[str, str] = dict(settings.resource_attributes)
    attributes.update(
        {
            "service.name": settings.service_name or service,
            "service.version": version.version(),
            "service.instance.id": instance,
        }
    )
    if region is not None:
        attributes["meridian.region"] = region
    return Resource.create(attributes)


def span_exporter(
    url: str, *, protocol: Protocol, headers: Mapping[str, str], timeout_s: float
) -> SpanExporter:
    """The official OTLP span exporter: ``url`` is the full URL the spans are posted to for
    ``http/protobuf`` (``.../v1/traces``), the collector's address for ``grpc``."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        exporter: SpanExporter = GrpcSpanExporter(
            endpoint=url,
            insecure=url.startswith("http://"),
            headers=dict(headers),
            timeout=timeout_s,
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=url, headers=dict(headers), timeout=timeout_s)
    logs.install_export_filter()  # on the exporters' loggers, created by the imports above
    return exporter


def metric_exporter(
    url: str, *, protocol: Protocol, headers: Mapping[str, str], timeout_s: float
) -> MetricExporter:
    """The official OTLP metric exporter (``url`` as for :func:`span_exporter`)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        exporter: MetricExporter = GrpcMetricExporter(
            endpoint=url,
            insecure=url.startswith("http://"),
            headers=dict(headers),
            timeout=timeout_s,
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter(endpoint=url, headers=dict(headers), timeout=timeout_s)
    logs.install_export_filter()
    return exporter


def _signal_url(settings: OtlpSettings, path: str) -> str:
    assert settings.endpoint is not None
    return settings.endpoint if settings.protocol == "grpc" else settings.endpoint + path


class Export:
    """One process's OTLP export as its settings ask: :attr:`span_processor` for its tracer
    provider, :attr:`metric_reader` for its meter provider (each ``None`` when not exported),
    and :meth:`shutdown`, which flushes and stops both in a bounded time."""

    def __init__(self, settings: OtlpSettings, *, what: str) -> None:
        self.settings = settings
        self._what = what
        self._span_exporter: SpanExporter | None = None
        self._metric_exporter: MetricExporter | None = None
        self.span_processor: BatchSpanProcessor | None = None
        self.metric_reader: PeriodicExportingMetricReader | None = None
        headers = settings.plain_headers()
        if settings.exports_traces:
            self._span_exporter = span_exporter(
                _signal_url(settings, "/v1/traces"),
                protocol=settings.protocol,
                headers=headers,
                timeout_s=settings.timeout_s,
            )
            self.span_processor = BatchSpanProcessor(
                self._span_exporter,
                max_queue_size=settings.max_queue_size,
                max_export_batch_size=min(512, settings.max_queue_size),  # the SDK's default
            )
        if settings.exports_metrics:
            self._metric_exporter = metric_exporter(
                _signal_url(settings, "/v1/metrics"),
                protocol=settings.protocol,
                headers=headers,
                timeout_s=settings.timeout_s,
            )
            self.metric_reader = PeriodicExportingMetricReader(
                self._metric_exporter,
                export_interval_millis=settings.metrics_interval_s * 1000,
                export_timeout_millis=settings.timeout_s * 1000,
            )
        if settings.endpoint is not None:
            log.info(
                "%s exports over OTLP endpoint=%s protocol=%s traces=%s metrics=%s "
                "metrics_interval_s=%g headers=%s",
                what,
                settings.endpoint,
                settings.protocol,
                settings.exports_traces,
                settings.exports_metrics,
                settings.metrics_interval_s,
                ",".join(sorted(settings.headers)) or "none",  # names only, never values
            )

    @property
    def traces(self) -> bool:
        return self.span_processor is not None

    def shutdown(self, *, tracers: TracerProvider | None, meters: MeterProvider | None) -> None:
        """Stop ``meters`` and ``tracers`` (which hold this export's reader and processor),
        exporting what is pending; after ``timeout_s`` the exporters are shut down, which
        abandons what is left, so that a collector that never answers delays a stop by about
        ``timeout_s`` at most.  Blocking: call it off the event loop."""
        abort = threading.Timer(self.settings.timeout_s, self._abandon)
        abort.daemon = True
        abort.start()
        try:
            if meters is not None:
                meters.shutdown(timeout_millis=self.settings.timeout_s * 1000)
            if tracers is not None:
                tracers.shutdown()
        finally:
            abort.cancel()

    def _abandon(self) -> None:
        log.warning(
            "%s: OTLP export did not finish within %gs of the stop: what is left is dropped",
            self._what,
            self.settings.timeout_s,
        )
        for exporter in (self._span_exporter, self._metric_exporter):
            if exporter is not None:
                try:
                    exporter.shutdown()
                except Exception:  # the SDK's shutdown may race the processor's own
                    log.debug("OTLP exporter shutdown failed", exc_info=True)
