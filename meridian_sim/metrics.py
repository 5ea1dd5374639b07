"""The node's Prometheus ``/metrics`` page, with vLLM 0.32's metric names, labels and buckets.

Gauges and counters are read from the engine at scrape time; histograms are observed as steps
and requests finish.  Every series carries the labels vLLM gives it (``engine="0"``,
``model_name``).  Times are in the simulation's seconds: with ``--time-scale 10`` a request that
took 0.1 s of wall-clock time reports 1 s, as the profiled GPU would have taken.

With ``legacy=True`` the page also carries the names older vLLM releases used and that other
routers still read: ``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_queries_total`` and
``vllm:gpu_prefix_cache_hits_total``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from meridian_sim.engine import FINISH_REASONS, Engine, RequestRecord, StepResult
from meridian_sim.profile import Profile

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Buckets copied from vLLM 0.32's /metrics page (tests/fixtures/vllm).
_TTFT_BUCKETS: Final = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS: Final = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_TIME_BUCKETS: Final = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_ITERATION_TOKEN_BUCKETS: Final = (
    1.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
    256.0,
    512.0,
    1024.0,
    2048.0,
    4096.0,
    8192.0,
    16384.0,
)
_PREEMPTION_BUCKETS: Final = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
_LABELS: Final = ("engine", "model_name")


def _one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class _EngineCollector(Collector):
    def __init__(self, *, engine: Engine, model_name: str, legacy: bool, created_s: float) -> None:
        self._engine = engine
        self._model = model_name
        self._legacy = legacy
        self._created = created_s

    def collect(self) -> Iterator[Metric]:
        e, s, lv = self._engine, self._engine.stats, ["0", self._model]
        profile = e.profile

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=_LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=_LABELS)
            c.add_metric(lv, value, created=self._created)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            e.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            e.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=("engine", "finished_reason", "model_name"),
        )
        for reason in FINISH_REASONS:
            success.add_metric(
                ["0", reason, self._model], s.request_success[reason], created=self._created
            )
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=(
                "block_size",
                "enable_prefix_caching",
                "engine",
                "num_gpu_blocks",
                "kv_cache_size_tokens",
                "max_model_len",
                "simulator_profile",
            ),
        )
        info.add_metric(
            [
                str(profile.block_size),
                "True",
                "0",
                str(profile.num_gpu_blocks),
                str(profile.kv_cache_tokens),
                str(profile.max_model_len),
                profile.name,
            ],
            1.0,
        )
        yield info
        if self._legacy:
            yield gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage (deprecated name).",
                e.kv_usage,
            )
            yield counter(
                "vllm:gpu_prefix_cache_queries",
                "GPU prefix cache queries, in terms of number of queried tokens (deprecated name).",
                s.prefix_cache_queries,
            )
            yield counter(
                "vllm:gpu_prefix_cache_hits",
                "GPU prefix cache hits, in terms of number of cached tokens (deprecated name).",
                s.prefix_cache_hits,
            )


class NodeMetrics:
    """A registry of its own per node, so several nodes can live in one process."""

    def __init__(
        self, *, engine: Engine, profile: Profile, model_name: str, legacy: bool, created_s: float
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(
            _EngineCollector(
                engine=engine, model_name=model_name, legacy=legacy, created_s=created_s
            )
        )
        self._labels = ("0", model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, labelnames=_LABELS, buckets=buckets, registry=self.registry)
            return h

        token_buckets = _one_two_five(profile.max_model_len)
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_TIME_BUCKETS,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.prompt_tokens = hist(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            token_buckets,
        )
        self.generation_tokens = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS,
        )
        self.preemptions = hist(
            "vllm:request_num_preemptions",
            "Number of preemptions for the request.",
            _PREEMPTION_BUCKETS,
        )

    def observe_step(self, result: StepResult) -> None:
        lv = self._labels
        if result.num_scheduled_tokens:
            self.iteration_tokens.labels(*lv).observe(result.num_scheduled_tokens)
        for event in result.tokens:
            if event.itl_s is not None:
                self.itl.labels(*lv).observe(event.itl_s)

    def observe_finished(self, record: RequestRecord) -> None:
        """Histograms of a finished request; aborted ones only count in request_success."""
        if record.finish_reason == "abort" or record.first_token_s is None:
            return
        lv = self._labels
        scheduled = (
            record.first_scheduled_s if record.first_scheduled_s is not None else record.queued_s
        )
        self.ttft.labels(*lv).observe(record.first_token_s - record.arrival_s)
        self.e2e.labels(*lv).observe(record.finished_s - record.arrival_s)
        self.queue.labels(*lv).observe(scheduled - record.queued_s)
        self.inference.labels(*lv).observe(record.finished_s - scheduled)
        self.prefill.labels(*lv).observe(record.first_token_s - scheduled)
        self.decode.labels(*lv).observe(record.finished_s - record.first_token_s)
        self.prompt_tokens.labels(*lv).observe(record.prompt_tokens)
        self.generation_tokens.labels(*lv).observe(record.generation_tokens)
        self.max_tokens.labels(*lv).observe(record.max_tokens)
        self.preemptions.labels(*lv).observe(record.num_preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
