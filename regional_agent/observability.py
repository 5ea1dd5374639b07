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
- ``meridian_agent_queue_depth{model}`` and ``meridian_agent_node_in_flight{node}``: gauges;
- ``meridian_agent_etcd_writes_total{kind}`` and ``meridian_agent_etcd_connected``: what the
  publisher wrote to etcd (``alive``, ``status``) and whether etcd answers now (1/0; absent
  when the agent does not publish).

:class:`RequestTotals` keeps plain running totals (requests finished and failed, time to first
token in fixed log-spaced buckets) that the publisher differences over its window to report the
region's load: two integer increments per request, nothing logged, nothing sent anywhere.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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

# Upper bounds of the buckets :class:`RequestTotals` counts time to first token in: 1 ms growing
# by 25 % a bucket up to about 9 minutes, then one overflow bucket.  A quantile read from them
# is within 25 % of the true one, whatever the scale.
TTFT_BOUNDS_S: tuple[float, ...] = tuple(0.001 * 1.25**k for k in range(60))


@dataclass(slots=True)
class RequestTotals:
    """Running totals since the agent started; readers difference two snapshots."""

    finished: int = 0  # requests answered (any status) or abandoned by the client
    failed: int = 0  # of those, the ones the client got a 5xx for
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BOUNDS_S) + 1))

    def copy(self) -> RequestTotals:
        return RequestTotals(finished=self.finished, failed=self.failed, ttft=list(self.ttft))


def quantile(counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram over :data:`TTFT_BOUNDS_S`, interpolated inside
    its bucket as Prometheus' ``histogram_quantile`` does; ``None`` without samples.  A quantile
    in the overflow bucket is reported as the last bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i >= len(TTFT_BOUNDS_S):
                return TTFT_BOUNDS_S[-1]
            lower = TTFT_BOUNDS_S[i - 1] if i > 0 else 0.0
            upper = TTFT_BOUNDS_S[i]
            return lower + (upper - lower) * max(0.0, rank - seen) / n
        seen += n
    return TTFT_BOUNDS_S[-1]


class Instruments:
    def __init__(
        self,
        *,
        console_spans: bool,
        queue_depths: Callable[[], Mapping[str, int]],
        in_flight: Callable[[], Mapping[str, int]],
        panic: Callable[[], bool] | None = None,
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
        # Per-request counts are kept in plain counters and reported through observable
        # instruments at scrape time: an SDK ``Counter.add`` on the request path costs more
        # than the rest of the agent's bookkeeping (measured with cProfile).
        self._requests: Counter[tuple[str, ...]] = Counter()
        self._decisions: Counter[tuple[str, ...]] = Counter()
        self._retries: Counter[tuple[str, ...]] = Counter()
        self._store_writes: Counter[tuple[str, ...]] = Counter()
        self._refusals: Counter[tuple[str, ...]] = Counter()
        self.totals = RequestTotals()
        self.etcd_connected: bool | None = None  # None: the agent does not publish

        def counts(
            table: Counter[tuple[str, ...]], keys: tuple[str, ...]
        ) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def cb(_: CallbackOptions) -> Iterable[Observation]:
                return [
                    Observation(v, dict(zip(keys, k, strict=True))) for k, v in list(table.items())
                ]

            return cb

        meter.create_observable_counter(
            "meridian_agent_requests",
            callbacks=[counts(self._requests, ("node", "status"))],
            description="Requests finished, by node and status.",
        )
        meter.create_observable_counter(
            "meridian_agent_routing_decisions",
            callbacks=[counts(self._decisions, ("policy", "reason"))],
            description="Routing decisions by policy and reason.",
        )
        meter.create_observable_counter(
            "meridian_agent_retries",
            callbacks=[counts(self._retries, ("cause",))],
            description="Attempts retried on another node, by cause.",
        )
        meter.create_observable_counter(
            "meridian_agent_etcd_writes",
            callbacks=[counts(self._store_writes, ("kind",))],
            description="Writes the publisher made to etcd, by kind (alive, status).",
        )

        meter.create_observable_counter(
            "meridian_agent_tenant_refusals",
            callbacks=[counts(self._refusals, ("tenant", "cause"))],
            description="Requests refused for their key or tenant, by tenant (none: no valid "
            "key) and cause (unauthenticated, model, requests, tokens).",
        )

        def connected_cb(_: CallbackOptions) -> Iterable[Observation]:
            up = self.etcd_connected
            return [] if up is None else [Observation(1 if up else 0)]

        meter.create_observable_gauge(
            "meridian_agent_etcd_connected",
            callbacks=[connected_cb],
            description="1 when etcd answered the publisher's last call, else 0.",
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
        if panic is not None:
            in_panic = panic

            def panic_cb(_: CallbackOptions) -> Iterable[Observation]:
                return [Observation(1 if in_panic() else 0)]

            meter.create_observable_gauge(
                "meridian_agent_health_panic",
                callbacks=[panic_cb],
                description="1 while fewer than health.panic_threshold of the active nodes are "
                "routable and the agent routes to all of them as if healthy, else 0.",
            )
        self._traces = TracerProvider(resource=resource)
        if console_spans:
            self._traces.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        self.tracer: Tracer = self._traces.get_tracer("meridian.agent")

    def count_request(self, *, node: str, status: int) -> None:
        self._requests[(node, str(status))] += 1
        totals = self.totals
        totals.finished += 1
        if status >= 500:
            totals.failed += 1

    def record_ttft(self, seconds: float) -> None:
        """Arrival at the agent to the first byte relayed (streams): the histogram on
        ``/metrics`` and the running totals the publisher reads."""
        self.ttft.record(seconds)
        self.totals.ttft[bisect.bisect_left(TTFT_BOUNDS_S, seconds)] += 1

    def count_store_write(self, *, kind: str) -> None:
        self._store_writes[(kind,)] += 1

    def count_decision(self, *, policy: str, reason: str) -> None:
        self._decisions[(policy, reason)] += 1

    def count_retry(self, *, cause: str) -> None:
        self._retries[(cause,)] += 1

    def count_refusal(self, *, tenant: str, cause: str) -> None:
        self._refusals[(tenant, cause)] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        self._meters.shutdown()
        self._traces.shutdown()
