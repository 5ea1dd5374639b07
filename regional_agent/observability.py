"""OpenTelemetry for the agent: a span per request and metrics on the agent's ``/metrics``.

Each agent has its own meter and tracer providers and its own Prometheus registry, so several
agents (tests, the demo) can live in one process without mixing their numbers.

Metrics (Prometheus names):

- ``meridian_agent_requests_total{node, status}``: requests finished, by the node that served
  the last attempt (``none`` when none did) and the status the client got;
- ``meridian_agent_routing_decisions_total{policy, reason}``: routing decisions by the first
  word of the policy's reason (``prefix``, ``least-load``, ...);
- ``meridian_agent_retries_total{cause}``: attempts retried on another node;
- ``meridian_agent_time_to_first_token_seconds``: from arrival at the agent to the first byte
  relayed to the client (streams only), the time the client sees;
- ``meridian_agent_queue_wait_seconds``: time in the central queue;
- ``meridian_agent_queue_depth{model}`` and ``meridian_agent_node_in_flight{node}``: gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, generate_latest

_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class Instruments:
    def __init__(
        self,
        *,
        console_spans: bool,
        queue_depths: Callable[[], Mapping[str, int]],
        in_flight: Callable[[], Mapping[str, int]],
    ) -> None:
        resource = Resource.create({"service.name": "meridian-agent"})
        self.registry = CollectorRegistry()
        reader = PrometheusMetricReader(disable_target_info=True, registry=self.registry)
        views = [
            View(
                instrument_name=name,
                aggregation=ExplicitBucketHistogramAggregation(boundaries=_LATENCY_BUCKETS_S),
            )
            for name in ("meridian_agent_time_to_first_token", "meridian_agent_queue_wait")
        ]
        self._meters = MeterProvider(metric_readers=[reader], resource=resource, views=views)
        meter = self._meters.get_meter("meridian.agent")
        self.requests = meter.create_counter(
            "meridian_agent_requests", description="Requests finished, by node and status."
        )
        self.decisions = meter.create_counter(
            "meridian_agent_routing_decisions",
            description="Routing decisions by policy and reason.",
        )
        self.retries = meter.create_counter(
            "meridian_agent_retries", description="Attempts retried on another node, by cause."
        )
        self.ttft = meter.create_histogram(
            "meridian_agent_time_to_first_token",
            unit="s",
            description="Arrival at the agent to the first byte relayed to the client.",
        )
        self.queue_wait = meter.create_histogram(
            "meridian_agent_queue_wait", unit="s", description="Time spent in the central queue."
        )

        def depth_cb(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {"model": k}) for k, v in queue_depths().items()]

        def in_flight_cb(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {"node": k}) for k, v in in_flight().items()]

        meter.create_observable_gauge(
            "meridian_agent_queue_depth", callbacks=[depth_cb], description="Requests waiting."
        )
        meter.create_observable_gauge(
            "meridian_agent_node_in_flight",
            callbacks=[in_flight_cb],
            description="Requests the agent has in flight on each node.",
        )
        self._traces = TracerProvider(resource=resource)
        if console_spans:
            self._traces.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        self.tracer: Tracer = self._traces.get_tracer("meridian.agent")

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        self._meters.shutdown()
        self._traces.shutdown()
