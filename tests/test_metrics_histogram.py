"""meridian_service.metrics.Histogram: what Prometheus reads is a histogram as the SDK wrote it
(cumulative ``le`` buckets, ``+Inf``, ``_sum``, ``_count``), and with an OTLP export the SDK's
histogram takes every sample instead."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meridian_service.metrics import Histogram


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_buckets_are_cumulative_with_le_as_prometheus_writes_it() -> None:
    registry = CollectorRegistry()
    h = Histogram("x_seconds", description="X.", bounds=(0.005, 0.25, 1.0), keys=("model",))
    registry.register(h)
    for value in (0.001, 0.005, 0.2, 3.0):  # 0.005 falls in le="0.005", as Prometheus counts
        h.record(value, ("m",))
    h.record(0.5, ("other",))
    got = _samples(registry)
    m = (("model", "m"),)
    assert [
        got[("x_seconds_bucket", (("le", le), *m))] for le in ("0.005", "0.25", "1.0", "+Inf")
    ] == [2, 3, 3, 4]
    assert got[("x_seconds_count", m)] == 4
    assert got[("x_seconds_sum", m)] == 0.001 + 0.005 + 0.2 + 3.0
    assert got[("x_seconds_count", (("model", "other"),))] == 1


def test_an_otlp_export_gets_every_sample_through_the_sdk_and_nothing_is_written_twice() -> None:
    registry = CollectorRegistry()
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    otel = meter.create_histogram("x", unit="s")
    h = Histogram("x_seconds", description="X.", bounds=(1.0,), keys=("region", "model"), otel=otel)
    registry.register(h)
    h.record(0.5, ("eu", "m"))
    h.record(2.0, ("eu", "m"))
    data = reader.get_metrics_data()
    assert data is not None
    (point,) = data.resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    assert point.count == 2 and point.sum == 2.5
    assert dict(point.attributes or {}) == {"region": "eu", "model": "m"}
    assert _samples(registry) == {}  # the SDK's Prometheus reader writes these series
