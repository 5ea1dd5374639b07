"""OTLP tracing of a simulated node, as vLLM's ``--otlp-traces-endpoint`` does it.

vLLM with ``--otlp-traces-endpoint`` makes one ``llm_request`` span (kind SERVER) per request,
a child of the W3C ``traceparent`` the request came with, with ``gen_ai.*`` attributes: the
model, the request id, ``max_tokens``, the prompt and completion tokens, and the latencies
(time in queue, to the first token, end to end).  The simulated node does the same, so that a
trace through the agent shows the node's span under the agent's.  The span's start and end are
wall-clock times of this process; the ``gen_ai.latency.*`` attributes are the simulated GPU's
(simulation seconds, what vLLM on that GPU would report).

The endpoint is given as for vLLM: ``http://collector:4318/v1/traces`` (or the base URL,
``http://collector:4318``) for ``http/protobuf`` (the default here), the collector's
``http://collector:4317`` for ``grpc`` (vLLM's default);
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` picks one, as for vLLM.  Spans leave through a batch
processor with a bounded queue (meridian_service.otlp).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Literal, cast

import pydantic
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from meridian_service import otlp

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_W3C = TraceContextTextMapPropagator()
_EXPORT_TIMEOUT_S = 10.0


def protocol_from_env() -> Literal["http/protobuf", "grpc"]:
    """``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``grpc`` or ``http/protobuf``); default
    ``http/protobuf``."""
    value = os.environ.get(PROTOCOL_ENV, "http/protobuf").strip().lower()
    if value not in ("grpc", "http/protobuf"):
        raise ValueError(f"{PROTOCOL_ENV} must be grpc or http/protobuf, got {value!r}")
    return cast(Literal["http/protobuf", "grpc"], value)


def check_endpoint(url: str) -> str:
    """``url`` if it is an http:// or https:// URL with a host, else ``ValueError``."""
    try:
        endpoint = otlp.OtlpSettings(endpoint=url).endpoint
    except pydantic.ValidationError as exc:
        raise ValueError(f"--otlp-traces-endpoint: {exc.errors()[0]['msg']}") from None
    assert endpoint is not None
    return endpoint


class NodeTracing:
    """The node's tracer provider and its OTLP span export."""

    def __init__(
        self,
        endpoint: str,
        *,
        protocol: Literal["http/protobuf", "grpc"] = "http/protobuf",
        model: str,
        instance: str | None = None,
    ) -> None:
        base = endpoint.rstrip("/")
        if protocol == "http/protobuf":
            base = base.removesuffix("/v1/traces")  # vLLM's form; a base URL works too
        settings = otlp.OtlpSettings(
            endpoint=base, protocol=protocol, metrics=False, timeout_s=_EXPORT_TIMEOUT_S
        )
        instance = instance or f"{socket.gethostname()}-{os.getpid()}"
        self.provider = TracerProvider(
            resource=otlp.resource(settings, service="meridian-sim", instance=instance)
        )
        self.export = otlp.Export(settings, what="meridian-sim node")
        assert self.export.span_processor is not None
        self.provider.add_span_processor(self.export.span_processor)
        self.tracer = self.provider.get_tracer("meridian.sim")
        self.model = model

    def start(self, headers: Mapping[str, str], *, request_id: str, max_tokens: int) -> Span:
        """The request's ``llm_request`` span, a child of its ``traceparent`` if it has one."""
        return self.tracer.start_span(
            "llm_request",
            context=_W3C.extract(headers),
            kind=SpanKind.SERVER,
            start_time=time.time_ns(),
            attributes={
                "gen_ai.response.model": self.model,
                "gen_ai.request.id": request_id,
                "gen_ai.request.max_tokens": max_tokens,
                "gen_ai.request.n": 1,
            },
        )

    @staticmethod
    def finish(
        span: Span,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        time_in_queue_s: float | None = None,
        time_to_first_token_s: float | None = None,
        e2e_s: float | None = None,
        error: str | None = None,
    ) -> None:
        values = {
            "gen_ai.usage.prompt_tokens": prompt_tokens,
            "gen_ai.usage.completion_tokens": completion_tokens,
            "gen_ai.latency.time_in_queue": time_in_queue_s,
            "gen_ai.latency.time_to_first_token": time_to_first_token_s,
            "gen_ai.latency.e2e": e2e_s,
        }
        span.set_attributes({k: v for k, v in values.items() if v is not None})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def shutdown(self) -> None:
        """Flush and stop (blocking, for about the export timeout at most)."""
        self.export.shutdown(tracers=self.provider, meters=None)
