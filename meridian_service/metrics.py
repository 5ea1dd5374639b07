"""What the agent's and the controller's metrics share: callbacks for OpenTelemetry's observable
instruments (a table of counts read when scraped, one observation per row) and
:class:`Histogram`, a histogram cheap enough for the request path."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.metrics import Histogram as OtelHistogram
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

Callback = Callable[[CallbackOptions], Iterable[Observation]]


def labelled(table: Mapping[tuple[str, ...], int], keys: tuple[str, ...]) -> Callback:
    """One observation per row of ``table``, its key tuple labelled ``keys`` in order."""

    def cb(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, dict(zip(keys, k, strict=True))) for k, v in list(table.items())]

    return cb


def by_label(table: Mapping[str, int], known: Iterable[str] = (), key: str = "kind") -> Callback:
    """One observation per row of ``table`` labelled ``key``; every value in ``known`` is
    observed at 0 until it has a row, so that ``increase()`` sees its first event."""
    zeros = dict.fromkeys(known, 0)

    def cb(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, {key: k}) for k, v in (zeros | dict(table)).items()]

    return cb


class Histogram:
    """A Prometheus histogram kept as plain counts, for the request path.

    ``record`` is a bisect and three additions (an OpenTelemetry SDK ``Histogram.record`` cost
    about 25 µs a sample in the agent's saturated benchmark; docs/benchmarks.md); the series are
    written at scrape time by :meth:`collect`, as a ``prometheus_client`` collector registered on
    the process's registry, under the name and labels the SDK's exporter gave them
    (``<name>_seconds_bucket``, ``_sum``, ``_count``).

    ``otel``: an SDK histogram that takes the samples instead, for a process that exports its
    metrics over OTLP: both its readers (OTLP's and Prometheus') then read the SDK's histogram,
    and only then is the SDK's cost paid; :meth:`collect` writes nothing."""

    __slots__ = ("_bounds", "_description", "_keys", "_name", "_otel", "_series")

    def __init__(
        self,
        name: str,
        *,
        description: str,
        bounds: Sequence[float],
        keys: tuple[str, ...],
        otel: OtelHistogram | None = None,
    ) -> None:
        self._name = name
        self._description = description
        self._bounds = tuple(bounds)
        self._keys = keys
        self._otel = otel
        self._series: dict[tuple[str, ...], _Series] = {}

    def record(self, value: float, key: tuple[str, ...]) -> None:
        """One sample of the series whose label values are ``key`` (in ``keys`` order)."""
        if self._otel is not None:
            self._otel.record(value, dict(zip(self._keys, key, strict=True)))
            return
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(len(self._bounds) + 1)
        series.counts[bisect.bisect_left(self._bounds, value)] += 1
        series.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        if self._otel is not None:
            return
        family = HistogramMetricFamily(self._name, self._description, labels=self._keys)
        edges = [*map(floatToGoString, self._bounds), "+Inf"]
        for key, series in list(self._series.items()):
            cumulative = list(itertools.accumulate(series.counts))
            family.add_metric(
                list(key), list(zip(edges, cumulative, strict=True)), sum_value=series.sum
            )
        yield family


class _Series:
    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets  # per bucket, not cumulative; the last one is +Inf
        self.sum = 0.0
