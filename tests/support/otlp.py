"""A real OTLP receiver for tests: what a collector is to the agent, the controller and the node.

:class:`OtlpReceiver` serves OTLP/HTTP on loopback (``POST /v1/traces``, ``POST /v1/metrics``,
protobuf bodies, gzip or not) and, with :meth:`OtlpReceiver.start_grpc`, OTLP/gRPC
(``TraceService/Export``, ``MetricsService/Export``).  It decodes every request with
``opentelemetry-proto``'s ``ExportTraceServiceRequest`` and ``ExportMetricsServiceRequest``
and keeps the spans and the metric points it got, each with its resource's attributes, and the
headers the export came with.
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from tests.support.ports import free_port

KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    return None if which is None else getattr(v, which)


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


@dataclass(frozen=True)
class Span:
    service: str
    resource: Mapping[str, Any]
    name: str
    kind: int
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: Mapping[str, Any]
    status_code: int


@dataclass(frozen=True)
class Point:
    service: str
    resource: Mapping[str, Any]
    metric: str
    attributes: Mapping[str, Any]
    value: float  # a sum's or a gauge's value; a histogram's count


@dataclass
class OtlpReceiver:
    spans: list[Span] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # path, headers
    _runner: web.AppRunner | None = None
    _grpc: grpc.aio.Server | None = None

    # -- decoding --------------------------------------------------------------------------

    def add_traces(self, message: trace_service_pb2.ExportTraceServiceRequest) -> None:
        for rs in message.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        Span(
                            service=str(resource.get("service.name")),
                            resource=resource,
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes=_attributes(s.attributes),
                            status_code=s.status.code,
                        )
                    )

    def add_metrics(self, message: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        for rm in message.resource_metrics:
            resource = _attributes(rm.resource.attributes)
            service = str(resource.get("service.name"))
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind in ("sum", "gauge"):
                        for p in getattr(m, kind).data_points:
                            number = (
                                p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            )
                            self.points.append(
                                Point(service, resource, m.name, _attributes(p.attributes), number)
                            )
                    elif kind == "histogram":
                        for h in m.histogram.data_points:
                            self.points.append(
                                Point(service, resource, m.name, _attributes(h.attributes), h.count)
                            )

    # -- OTLP/HTTP -------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> bytes:
        self.requests.append((request.path, dict(request.headers)))
        raw = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            raw = gzip.decompress(raw)
        return raw

    async def _traces(self, request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest.FromString(await self._body(request))
        self.add_traces(message)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    async def _metrics(self, request: web.Request) -> web.Response:
        raw = await self._body(request)
        self.add_metrics(metrics_service_pb2.ExportMetricsServiceRequest.FromString(raw))
        reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    async def start(self) -> str:
        """Serve OTLP/HTTP; returns the base URL (``http://127.0.0.1:<port>``)."""
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    # -- OTLP/gRPC -------------------------------------------------------------------------

    async def start_grpc(self) -> str:
        """Serve OTLP/gRPC; returns ``http://127.0.0.1:<port>`` (plaintext)."""
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            async def Export(self, request: Any, context: Any) -> Any:
                receiver.requests.append(("grpc:traces", dict(context.invocation_metadata())))
                receiver.add_traces(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            async def Export(self, request: Any, context: Any) -> Any:
                receiver.requests.append(("grpc:metrics", dict(context.invocation_metadata())))
                receiver.add_metrics(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)  # type: ignore[no-untyped-call]
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)  # type: ignore[no-untyped-call]
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        self._grpc = server
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._grpc is not None:
            await self._grpc.stop(grace=None)

    # -- reading ---------------------------------------------------------------------------

    def spans_of(self, service: str, *, trace_id: str | None = None) -> list[Span]:
        return [
            s
            for s in self.spans
            if s.service == service and (trace_id is None or s.trace_id == trace_id)
        ]

    def values(self, service: str, metric: str, **attributes: Any) -> list[float]:
        return [
            p.value
            for p in self.points
            if p.service == service
            and p.metric == metric
            and all(p.attributes.get(k) == v for k, v in attributes.items())
        ]
