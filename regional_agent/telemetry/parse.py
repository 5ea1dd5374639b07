"""A node's Prometheus ``/metrics`` page → one :class:`Scrape`: pure, no I/O.

Both generations of vLLM's names are read; where a page carries both (vLLM 0.10 to 0.1x, or
``meridian-sim --legacy-metrics``) the current name wins::

    current (vLLM ≥ 0.10)                  older
    vllm:num_requests_running              (same)
    vllm:num_requests_waiting              (same)
    vllm:kv_cache_usage_perc               vllm:gpu_cache_usage_perc          fraction 0..1
    vllm:prefix_cache_queries_total        vllm:gpu_prefix_cache_queries_total   tokens
    vllm:prefix_cache_hits_total           vllm:gpu_prefix_cache_hits_total      tokens
    vllm:num_preemptions_total             (same)
    vllm:time_to_first_token_seconds       (same)                             histogram
    vllm:cache_config_info                 (same)          labels block_size, num_gpu_blocks

Samples are looked up by their own name, not their family's: ``prometheus_client`` names a
counter's family without ``_total`` (and an untyped one with it), but the sample always keeps
it.  ``*_created`` samples are skipped.  One server may run several engines (data parallel) or
models, each with its own label set: counts and counters are summed over label sets, the KV
usage fraction is averaged (every engine has its own cache of the same size) and
``num_gpu_blocks`` is summed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

RUNNING: Final = ("vllm:num_requests_running",)
WAITING: Final = ("vllm:num_requests_waiting",)
KV_UTIL: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES: Final = (
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
)
PREFIX_HITS: Final = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREEMPTIONS: Final = ("vllm:num_preemptions_total",)
TTFT_SUM: Final = ("vllm:time_to_first_token_seconds_sum",)
TTFT_COUNT: Final = ("vllm:time_to_first_token_seconds_count",)
CACHE_CONFIG: Final = "vllm:cache_config_info"


class TelemetryError(ValueError):
    """A ``/metrics`` page that is not Prometheus text, or lacks what routing needs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scrape:
    """One node's page, summed over its engines; counters are cumulative since node start."""

    running: float
    waiting: float
    kv_util: float  # 0..1, as the node reports it
    prefix_queries: float | None  # tokens; None: the page has no prefix-cache counters
    prefix_hits: float | None  # tokens
    preemptions: float | None
    block_size: int | None  # tokens per KV block
    num_gpu_blocks: int | None
    ttft_sum_s: float | None
    ttft_count: float | None


_WANTED: Final = tuple(
    sorted({*RUNNING, *WAITING, *KV_UTIL, *PREFIX_QUERIES, *PREFIX_HITS, *PREEMPTIONS,
            *TTFT_SUM, *TTFT_COUNT, CACHE_CONFIG})
)  # fmt: skip


def parse(text: str) -> Scrape:
    """Read a vLLM ``/metrics`` page; :class:`TelemetryError` says what was wrong with it.

    A real page has some 600 lines and routing needs about 15 of them: only the sample lines of
    the names above go through ``prometheus_client``'s parser, which cuts the cost of a scrape
    (8 a second for two nodes) by an order of magnitude.  When that finds too little, the whole
    page is parsed, so a page that is not Prometheus text is reported as such.
    """
    relevant = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    try:
        return _parse(relevant + "\n")
    except TelemetryError:
        return _parse(text)


def _parse(text: str) -> Scrape:
    sums: defaultdict[str, float] = defaultdict(float)
    counts: defaultdict[str, int] = defaultdict(int)
    block_sizes: list[int] = []
    gpu_blocks: list[int] = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                if sample.name == CACHE_CONFIG:
                    _append_int(block_sizes, sample.labels.get("block_size"))
                    _append_int(gpu_blocks, sample.labels.get("num_gpu_blocks"))
                    continue
                sums[sample.name] += sample.value
                counts[sample.name] += 1
    except ValueError as exc:
        raise TelemetryError(f"not a Prometheus text page: {exc}") from exc

    def first(names: tuple[str, ...]) -> str | None:
        return next((name for name in names if name in sums), None)

    def finite(name: str) -> float:
        value = sums[name]
        if not math.isfinite(value):
            raise TelemetryError(f"{name} is {value}, not a number")
        return value

    def optional(names: tuple[str, ...]) -> float | None:
        name = first(names)
        return None if name is None else finite(name)

    running, waiting, kv_util = first(RUNNING), first(WAITING), first(KV_UTIL)
    if running is None or waiting is None or kv_util is None:
        missing = [" or ".join(names) for names in (RUNNING, WAITING, KV_UTIL) if not first(names)]
        raise TelemetryError(f"metrics page lacks {', '.join(missing)}; is this a vLLM node?")
    return Scrape(
        running=finite(running),
        waiting=finite(waiting),
        kv_util=finite(kv_util) / counts[kv_util],
        prefix_queries=optional(PREFIX_QUERIES),
        prefix_hits=optional(PREFIX_HITS),
        preemptions=optional(PREEMPTIONS),
        block_size=block_sizes[0] if block_sizes else None,
        num_gpu_blocks=sum(gpu_blocks) if gpu_blocks else None,
        ttft_sum_s=optional(TTFT_SUM),
        ttft_count=optional(TTFT_COUNT),
    )


def _append_int(out: list[int], label: str | None) -> None:
    """vLLM writes ``"None"`` for a value it has not resolved yet; that, or junk, is skipped."""
    if label is not None and label.isdigit():
        out.append(int(label))
