"""OpenTelemetry for the agent: a span per request and metrics on the agent's ``/metrics``.

Each agent has its own meter and tracer providers and its own Prometheus registry, so several
agents (tests, the demo) can live in one process without mixing their numbers.

Metrics (Prometheus names):

- ``meridian_agent_requests_total{node, status}``: requests finished, by the node that served
  the last attempt (``none`` when none did) and the status the client got;
- ``meridian_agent_routing_decisions_total{policy, reason}``: routing decisions by the first
  word of the policy's reason (``prefix``, ``least-load``, ...);
- ``meridian_agent_retries_total{cause}``: attempts retried on another node;
- ``meridian_agent_spills_total{to,cause,outcome}``: requests forwarded to another region, and
  ``meridian_agent_spilled_in_total{from}`` those another region forwarded here;
- ``meridian_agent_time_to_first_token_seconds{region, model}``: from arrival at the agent to
  the first byte relayed to the client (streams only), the time the client sees;
- ``meridian_agent_request_duration_seconds{region, model}``: from arrival to the last byte;
- ``meridian_agent_prompt_tokens_total{region, model}`` and
  ``meridian_agent_generated_tokens_total{region, model}``: the node's usage when it reports
  it, else the agent's count (:class:`RequestMetrics`);
- ``meridian_agent_queue_wait_seconds{region, priority}``: time in the central queue, by
  priority class (``high``, ``normal``, ``low``);
- ``meridian_agent_node_state{node, state}`` (1 for the node's health state, 0 for the others)
  and ``meridian_agent_node_ejections_total{cause}``: nodes taken out of rotation (``errors``,
  ``probation``, ``latency``, ``probes``);
- ``meridian_agent_build_info{version, region}``: 1.

``region`` is ``region.id`` (absent when unset).  ``model`` is the model the request names when
a node of the pool serves it, else ``other``: a name a client makes up never becomes a series.
- ``meridian_agent_queue_depth{model}`` and ``meridian_agent_node_in_flight{node}``: gauges;
- ``meridian_agent_etcd_writes_total{kind}`` and ``meridian_agent_etcd_connected``: what the
  publisher wrote to etcd (``alive``, ``status``) and whether etcd answers now (1/0; absent
  when the agent does not publish);
- ``meridian_agent_nodes{source}``: nodes in the pool by who added them (``static``, ``admin``,
  ``autoscaler``, ``dns:<name>``);
- ``meridian_agent_prefix_relay_records_total{direction}`` and
  ``meridian_agent_prefix_relay_lost_records_total{cause}``: with ``--workers``, the prompts
  a worker told its siblings through its ring and was told through theirs (``sent``,
  ``received``), the prompt tails it wrote to the shared table instead (``shared``), and the
  siblings' records it lost (``overrun``, ``malformed``);
- ``meridian_agent_discovery_failures_total{source, cause}``: DNS discovery's resolutions that
  failed (``timeout``, ``servfail``, ``refused``, ``error``) or came back empty (``nxdomain``,
  ``nodata``); the nodes found last stay (regional_agent.discovery).

:class:`RequestTotals` keeps plain running totals (requests finished and failed, time to first
token in fixed log-spaced buckets) that the publisher differences over its window to report the
region's load: two integer increments per request, nothing logged, nothing sent anywhere.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NoOpTracer, Tracer
from prometheus_client import CollectorRegistry, generate_latest

from meridian_service import gc_tuning, otlp, version
from meridian_service.metrics import Histogram, labelled
from policies import admission, prompt
from policies.model import Health

_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip

# Upper bounds of the buckets :class:`RequestTotals` counts time to first token in: 1 ms growing
# by 25 % a bucket up to about 9 minutes, then one overflow bucket.  A quantile read from them
# is within 25 % of the true one, whatever the scale.
TTFT_BOUNDS_S: tuple[float, ...] = tuple(0.001 * 1.25**k for k in range(60))

_HISTOGRAMS = (  # OpenTelemetry name (Prometheus adds _seconds), its label, its description
    (
        "meridian_agent_time_to_first_token",
        "model",
        "Arrival at the agent to the first byte relayed to the client, by model.",
    ),
    (
        "meridian_agent_queue_wait",
        "priority",
        "Time spent in the central queue, by priority class.",
    ),
    (
        "meridian_agent_request_duration",
        "model",
        "Arrival at the agent to the last byte of the answer, by model.",
    ),
)

OTHER_MODEL = "other"  # the model label of a request for a model no node serves
_PRIORITY_NAMES = {v: k for k, v in admission.PRIORITIES.items()}
_HEALTH_STATES = tuple(h.value for h in Health)
# the causes policies.health gives an ejection, exported at 0 before the first one
EJECTION_CAUSES = ("errors", "probation", "latency", "probes")
_USAGE_TAIL_MAX = 64 * 1024  # bytes of a stream kept from the last chunk that names usage


class RequestMetrics:
    """One request's facts for the metrics: its ``model`` label and its tokens.

    Tokens come from the node's ``usage`` when it reports it (always for a non-streamed vLLM
    answer; in a stream's last chunk with ``stream_options.include_usage``, or in every chunk
    with vLLM's continuous usage stats).  Otherwise the prompt's are the agent's own count and
    a stream's generated ones are counted as one per choice event that is not the role
    announcement (vLLM sends one token per event unless ``--stream-interval`` batches them).
    The stream is scanned, not parsed: two byte counts a chunk, and only the tail from the last
    chunk that names ``usage`` is parsed, once, at the end."""

    __slots__ = ("_choices", "_stream", "_tail", "generated", "model", "prompt", "started")

    def __init__(self, *, model: str, prompt_tokens: int) -> None:
        self.model = model
        self.prompt = prompt_tokens
        self.generated = 0
        self.started = False  # a node's answer was relayed (its tokens count)
        self._choices = 0
        self._stream = False
        self._tail: bytes | None = None

    def body(self, answer: object) -> None:
        """A non-streamed answer, parsed."""
        self.started = True
        if self._usage(answer):
            return
        choices = answer.get("choices") if isinstance(answer, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            message = choice.get("message") if isinstance(choice, dict) else None
            text = message.get("content") if isinstance(message, dict) else None
            if text is None and isinstance(choice, dict):
                text = choice.get("text")
            if isinstance(text, str) and text:
                self.generated += prompt.count_tokens(text)

    def chunk(self, data: bytes) -> None:
        """A stream's bytes, as relayed."""
        self.started = self._stream = True
        self._choices += data.count(b'"finish_reason"') - data.count(b'"role"')
        if b'"usage"' in data:
            self._tail = data
        elif self._tail is not None and len(self._tail) < _USAGE_TAIL_MAX:
            self._tail += data

    def finish(self) -> None:
        """The request ended: a stream's tokens are its last usage, else the count."""
        if not self._stream:
            return
        self._stream = False
        if self._tail is not None:
            for line in reversed(self._tail.split(b"\n")):
                line = line.strip()
                if line.startswith(b"data:") and b'"usage"' in line:
                    try:
                        event = json.loads(line[5:])
                    except (ValueError, UnicodeDecodeError):
                        continue
                    if self._usage(event):
                        return
        self.generated = max(0, self._choices)

    def _usage(self, answer: object) -> bool:
        usage = usage_of(answer)
        if usage is None:
            return False
        prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
        generated = usage.get("completion_tokens", usage.get("output_tokens"))
        if generated is None and type(prompt_tokens) is int:
            generated = 0  # embeddings, scoring: a prompt and nothing generated
        if type(prompt_tokens) is not int or type(generated) is not int:
            return False  # null (a stream's chunks before the last), or not a count
        self.prompt, self.generated = max(0, prompt_tokens), max(0, generated)
        return True


def usage_of(answer: object) -> dict[str, Any] | None:
    """An answer's (or a stream event's) ``usage``: at the top (chat, completions, embeddings)
    or in its ``response`` (the Responses API's ``response.completed``) or ``message``
    (Anthropic's ``message_start``)."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    for inner in ("response", "message"):
        if usage is None and isinstance(answer.get(inner), dict):
            usage = answer[inner].get("usage")
    return usage if isinstance(usage, dict) else None


@dataclass(slots=True)
class RequestTotals:
    """Running totals since the agent started; readers difference two snapshots."""

    finished: int = 0  # requests answered (any status) or abandoned by the client
    failed: int = 0  # of those, the ones the client got a 5xx for
    spilled: int = 0  # of those, the ones another region served (spill-over)
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BOUNDS_S) + 1))

    def copy(self) -> RequestTotals:
        return RequestTotals(
            finished=self.finished, failed=self.failed, spilled=self.spilled, ttft=list(self.ttft)
        )


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
        nodes_by_source: Callable[[], Mapping[str, int]] | None = None,
        region: str | None = None,
        served_models: Callable[[], frozenset[str]] | None = None,
        node_states: Callable[[], Mapping[str, str]] | None = None,
        ejections: Mapping[str, int] | None = None,
        otel: otlp.OtlpSettings | None = None,
        instance: str | None = None,
    ) -> None:
        otel = otel or otlp.OtlpSettings()
        resource = otlp.resource(
            otel, service="meridian-agent", instance=instance or "meridian-agent", region=region
        )
        # OTLP export (docs/observability.md#otlp): a periodic metric reader beside the
        # Prometheus one and a batch span processor, each only when asked for
        self.export = otlp.Export(otel, what="meridian-agent") if otel.endpoint else None
        self.registry = CollectorRegistry()
        reader = PrometheusMetricReader(disable_target_info=True, registry=self.registry)
        views = [
            View(
                instrument_name=name,
                aggregation=ExplicitBucketHistogramAggregation(boundaries=_LATENCY_BUCKETS_S),
            )
            for name, _, _ in _HISTOGRAMS
        ]
        readers: list[MetricReader] = [reader]
        if self.export is not None and self.export.metric_reader is not None:
            readers.append(self.export.metric_reader)
        self._meters = MeterProvider(metric_readers=readers, resource=resource, views=views)
        meter = self._meters.get_meter("meridian.agent")
        # Per-request counts are kept in plain counters and reported through observable
        # instruments at scrape time: an SDK ``Counter.add`` on the request path costs more
        # than the rest of the agent's bookkeeping (measured with cProfile).
        self._requests: Counter[tuple[str, ...]] = Counter()
        self._decisions: Counter[tuple[str, ...]] = Counter()
        self._retries: Counter[tuple[str, ...]] = Counter()
        self._store_writes: Counter[tuple[str, ...]] = Counter()
        self._refusals: Counter[tuple[str, ...]] = Counter()
        self._spills: Counter[tuple[str, ...]] = Counter()
        self._spilled_in: Counter[tuple[str, ...]] = Counter()
        self._discovery_failures: Counter[tuple[str, ...]] = Counter()
        self._prompt_tokens: Counter[tuple[str, ...]] = Counter()
        self._generated_tokens: Counter[tuple[str, ...]] = Counter()
        self._region: dict[str, str] = {} if region is None else {"region": region}
        self._served_models = served_models or frozenset
        self.totals = RequestTotals()
        self.etcd_connected: bool | None = None  # None: the agent does not publish

        meter.create_observable_counter(
            "meridian_agent_requests",
            callbacks=[labelled(self._requests, ("node", "status"))],
            description="Requests finished, by node and status.",
        )
        meter.create_observable_counter(
            "meridian_agent_routing_decisions",
            callbacks=[labelled(self._decisions, ("policy", "reason"))],
            description="Routing decisions by policy and reason.",
        )
        meter.create_observable_counter(
            "meridian_agent_retries",
            callbacks=[labelled(self._retries, ("cause",))],
            description="Attempts retried on another node, by cause.",
        )
        meter.create_observable_counter(
            "meridian_agent_etcd_writes",
            callbacks=[labelled(self._store_writes, ("kind",))],
            description="Writes the publisher made to etcd, by kind (alive, status).",
        )

        meter.create_observable_counter(
            "meridian_agent_tenant_refusals",
            callbacks=[labelled(self._refusals, ("tenant", "cause"))],
            description="Requests refused for their key or tenant, by tenant (none: no valid "
            "key) and cause (unauthenticated, model, requests, tokens).",
        )

        meter.create_observable_counter(
            "meridian_agent_spills",
            callbacks=[labelled(self._spills, ("to", "cause", "outcome"))],
            description="Requests forwarded to another region (spill-over), by target region "
            "(none: no region would do), cause (queue, full, model, unavailable) and outcome "
            "(served, failed, none).",
        )
        meter.create_observable_counter(
            "meridian_agent_spilled_in",
            callbacks=[labelled(self._spilled_in, ("from",))],
            description="Requests another region's agent forwarded here, by that region.",
        )

        meter.create_observable_counter(
            "meridian_agent_discovery_failures",
            callbacks=[labelled(self._discovery_failures, ("source", "cause"))],
            description="DNS discovery resolutions that failed or came back empty and so "
            "changed nothing, by source (dns:<name>) and cause.",
        )

        # the cyclic garbage collector's pauses (meridian_service.gc_tuning), per process
        gc_tuning.PAUSES.install()

        def by_generation(values: list[int] | list[float]) -> Callable[..., list[Observation]]:
            return lambda _: [
                Observation(values[g], {"generation": str(g), **self._region})
                for g in gc_tuning.GENERATIONS
            ]

        meter.create_observable_counter(
            "meridian_agent_gc_collections",
            callbacks=[by_generation(gc_tuning.PAUSES.collections)],
            description="Collections of the cyclic garbage collector, by generation (2: full).",
        )
        meter.create_observable_counter(
            "meridian_agent_gc_pause_seconds",
            callbacks=[by_generation(gc_tuning.PAUSES.seconds)],
            description="Seconds the process stood still in the cyclic garbage collector, by "
            "generation (2: full).",
        )

        def connected_cb(_: CallbackOptions) -> Iterable[Observation]:
            up = self.etcd_connected
            return [] if up is None else [Observation(1 if up else 0)]

        meter.create_observable_gauge(
            "meridian_agent_etcd_connected",
            callbacks=[connected_cb],
            description="1 when etcd answered the publisher's last call, else 0.",
        )
        # the request path's histograms: plain counts written at scrape time, or with an OTLP
        # export the SDK's histograms, which both readers read (meridian_service.metrics)
        exports_metrics = self.export is not None and self.export.metric_reader is not None
        keys = tuple(self._region)
        self.ttft, self.queue_wait, self.duration = (
            Histogram(
                f"{name}_seconds",
                description=description,
                bounds=_LATENCY_BUCKETS_S,
                keys=(*keys, label),
                otel=(
                    meter.create_histogram(name, unit="s", description=description)
                    if exports_metrics
                    else None
                ),
            )
            for name, label, description in _HISTOGRAMS
        )
        for histogram in (self.ttft, self.queue_wait, self.duration):
            self.registry.register(histogram)
        meter.create_observable_counter(
            "meridian_agent_prompt_tokens",
            callbacks=[labelled(self._prompt_tokens, (*self._region, "model"))],
            description="Prompt tokens of the requests nodes answered, by model (the node's "
            "usage, else the agent's count).",
        )
        meter.create_observable_counter(
            "meridian_agent_generated_tokens",
            callbacks=[labelled(self._generated_tokens, (*self._region, "model"))],
            description="Tokens generated for the requests nodes answered, by model (the "
            "node's usage, else counted from the stream).",
        )
        labels = {"version": version.version(), **self._region}
        meter.create_observable_gauge(
            "meridian_agent_build_info",
            callbacks=[lambda _: [Observation(1, labels)]],
            description="1, labelled with the installed Meridian version and the region.",
        )
        if node_states is not None:
            states_of = node_states

            def node_state_cb(_: CallbackOptions) -> Iterable[Observation]:
                return [
                    Observation(1 if state == s else 0, {"node": node, "state": s})
                    for node, state in states_of().items()
                    for s in _HEALTH_STATES
                ]

            meter.create_observable_gauge(
                "meridian_agent_node_state",
                callbacks=[node_state_cb],
                description="1 for the node's health state (healthy, probation, ejected, "
                "unhealthy), 0 for the others.",
            )
        if ejections is not None:
            ejected = ejections

            zeros = dict.fromkeys(EJECTION_CAUSES, 0)  # increase() sees the first one

            def ejections_cb(_: CallbackOptions) -> Iterable[Observation]:
                return [Observation(v, {"cause": k}) for k, v in (zeros | dict(ejected)).items()]

            meter.create_observable_counter(
                "meridian_agent_node_ejections",
                callbacks=[ejections_cb],
                description="Nodes taken out of rotation, by cause (errors, probation, "
                "latency, probes).",
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
        if nodes_by_source is not None:
            by_source = nodes_by_source

            def nodes_cb(_: CallbackOptions) -> Iterable[Observation]:
                return [Observation(v, {"source": k}) for k, v in by_source().items()]

            meter.create_observable_gauge(
                "meridian_agent_nodes",
                callbacks=[nodes_cb],
                description="Nodes in the pool, by who added them (static, admin, autoscaler, "
                "dns:<name>).",
            )
        # whether the agent's spans go anywhere: then it sends the nodes its own span as their
        # parent (traceparent), else it forwards the client's as it came.  Spans that go nowhere
        # are not made at all (a no-op tracer): an SDK span per request cost 14 % of the
        # agent's CPU when nothing exported it (docs/benchmarks.md, "Router CPU per request").
        self.tracing = console_spans or (self.export is not None and self.export.traces)
        self._traces: TracerProvider | None = None
        self.tracer: Tracer = NoOpTracer()
        if self.tracing:
            sampler = ParentBased(TraceIdRatioBased(otel.trace_sample_ratio))
            self._traces = TracerProvider(resource=resource, sampler=sampler)
            if console_spans:
                self._traces.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
            if self.export is not None and self.export.span_processor is not None:
                self._traces.add_span_processor(self.export.span_processor)
            self.tracer = self._traces.get_tracer("meridian.agent")

    def watch_prefix_relay(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """With several workers, the prefix relay's (``workers.siblings.PrefixRelay.counts``):
        records sent and received, siblings' records lost."""
        meter = self._meters.get_meter("meridian.agent.workers")

        def records_cb(_: CallbackOptions) -> Iterable[Observation]:
            now = counts()
            return [Observation(now[d], {"direction": d}) for d in ("sent", "shared", "received")]

        def lost_cb(_: CallbackOptions) -> Iterable[Observation]:
            now = counts()
            return [Observation(now[c], {"cause": c}) for c in ("overrun", "malformed")]

        meter.create_observable_counter(
            "meridian_agent_prefix_relay_records",
            callbacks=[records_cb],
            description="Prefix records this worker sent its siblings through its ring (each "
            "to every one), prompt tails it wrote to the shared table instead (shared), and "
            "records it received from their rings (--workers).",
        )
        meter.create_observable_counter(
            "meridian_agent_prefix_relay_lost_records",
            callbacks=[lost_cb],
            description="Siblings' prefix records this worker lost: overrun (it read a "
            "sibling's ring too late, the records written over), malformed (read, not decoded).",
        )

    def watch_kv_events(
        self,
        counts: Mapping[tuple[str, str], int],
        *,
        event_kinds: Sequence[str],
        nodes: Callable[[], Mapping[str, tuple[bool, int]]],
    ) -> None:
        """The KV-event subscriptions' metrics: ``counts`` by (node, kind), event kinds (in
        ``event_kinds``) in one counter and the rest (errors) in another; ``nodes`` gives each
        subscribed node's (in sync, blocks held)."""
        meter = self._meters.get_meter("meridian.agent.kv_events")
        events = frozenset(event_kinds)

        def events_cb(_: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(v, {"node": node, "kind": kind})
                for (node, kind), v in list(counts.items())
                if kind in events
            ]

        def errors_cb(_: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(v, {"node": node, "kind": kind})
                for (node, kind), v in list(counts.items())
                if kind not in events
            ]

        meter.create_observable_counter(
            "meridian_agent_kv_events",
            callbacks=[events_cb],
            description="KV-cache events applied to the precise prefix index, by node and kind "
            "(stored, removed, cleared; ignored: another medium, KV group or a LoRA adapter).",
        )
        meter.create_observable_counter(
            "meridian_agent_kv_event_errors",
            callbacks=[errors_cb],
            description="KV-event trouble by node and kind: malformed (skipped), refused (a "
            "block size other than routing.prefix_block_tokens), unkeyed (blocks whose parent "
            "was never seen), gap (lost batches), resync_cleared (a node's blocks dropped on a "
            "restart or an unrecoverable gap), replay_timeout.",
        )

        def precise_cb(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(1 if p else 0, {"node": n}) for n, (p, _b) in nodes().items()]

        def blocks_cb(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(b, {"node": n}) for n, (_p, b) in nodes().items()]

        meter.create_observable_gauge(
            "meridian_agent_kv_events_in_sync",
            callbacks=[precise_cb],
            description="1 while the node's KV events are in sync and route it by the precise "
            "index, 0 while it is routed by the approximate one.",
        )
        meter.create_observable_gauge(
            "meridian_agent_kv_index_blocks",
            callbacks=[blocks_cb],
            description="Blocks the node's engine holds according to its KV events.",
        )

    def count_request(self, *, node: str, status: int) -> None:
        self._requests[(node, str(status))] += 1
        totals = self.totals
        totals.finished += 1
        if status >= 500:
            totals.failed += 1

    def model_label(self, model: str) -> str:
        """``model`` when a node of the pool serves it, else ``other``."""
        return model if model in self._served_models() else OTHER_MODEL

    def record_ttft(self, seconds: float, *, model: str = OTHER_MODEL) -> None:
        """Arrival at the agent to the first byte relayed (streams): the histogram on
        ``/metrics`` and the running totals the publisher reads.  ``model``: a label from
        :meth:`model_label`."""
        self.ttft.record(seconds, (*self._region.values(), model))
        self.totals.ttft[bisect.bisect_left(TTFT_BOUNDS_S, seconds)] += 1

    def record_queue_wait(self, seconds: float, *, priority: int) -> None:
        name = _PRIORITY_NAMES.get(priority, str(priority))
        self.queue_wait.record(seconds, (*self._region.values(), name))

    def record_request(self, seconds: float, request: RequestMetrics) -> None:
        """A request ended ``seconds`` after it arrived: its duration and, when a node's
        answer was relayed, its tokens."""
        self.duration.record(seconds, (*self._region.values(), request.model))
        request.finish()
        if request.started:
            key = (*self._region.values(), request.model)
            self._prompt_tokens[key] += request.prompt
            self._generated_tokens[key] += request.generated

    def count_store_write(self, *, kind: str) -> None:
        self._store_writes[(kind,)] += 1

    def count_decision(self, *, policy: str, reason: str) -> None:
        self._decisions[(policy, reason)] += 1

    def count_retry(self, *, cause: str) -> None:
        self._retries[(cause,)] += 1

    def count_refusal(self, *, tenant: str, cause: str) -> None:
        self._refusals[(tenant, cause)] += 1

    def count_spill(self, *, to: str, cause: str, outcome: str) -> None:
        self._spills[(to, cause, outcome)] += 1
        if outcome == "served":
            self.totals.spilled += 1

    def count_spilled_in(self, *, origin: str) -> None:
        self._spilled_in[(origin,)] += 1

    def count_discovery_failure(self, *, source: str, cause: str) -> None:
        self._discovery_failures[(source, cause)] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Stop the providers; with OTLP export, flush it first, for ``otel.timeout_s`` at
        most.  Blocking (an export in flight): the app calls it on a thread."""
        if self.export is not None:
            self.export.shutdown(tracers=self._traces, meters=self._meters)
            return
        self._meters.shutdown()
        if self._traces is not None:
            self._traces.shutdown()
