"""The region's request rate, error rate and p99 time to first token over a sliding window.

The proxy only bumps running totals (``observability.RequestTotals``: two integer increments a
request).  The publisher snapshots them once a tick; the window is the difference between the
newest snapshot and the newest one at least ``window_s`` old (the oldest one while the agent is
younger than the window).  Nothing here runs per request.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from regional_agent.observability import RequestTotals, quantile


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowLoad:
    requests_per_s: float
    error_rate: float  # 0..1: 5xx share of the requests finished in the window
    ttft_p99_s: float | None  # None: no streamed request in the window
    span_s: float  # how much time the window actually covers
    spilled_per_s: float = 0.0  # requests another region served for this one (spill-over)


class LoadWindow:
    def __init__(self, *, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._samples: collections.deque[tuple[float, RequestTotals]] = collections.deque()

    def sample(self, totals: RequestTotals, *, now: float) -> None:
        """Record the running totals as of ``now`` (monotonic seconds)."""
        self._samples.append((now, totals.copy()))
        horizon = now - self._window_s
        # keep one sample at or before the horizon: the window's baseline
        while len(self._samples) >= 2 and self._samples[1][0] <= horizon:
            self._samples.popleft()

    def load(self) -> WindowLoad:
        if len(self._samples) < 2:
            return WindowLoad(requests_per_s=0.0, error_rate=0.0, ttft_p99_s=None, span_s=0.0)
        t0, first = self._samples[0]
        t1, last = self._samples[-1]
        span_s = max(t1 - t0, 1e-9)
        finished = max(0, last.finished - first.finished)
        failed = max(0, last.failed - first.failed)
        spilled = max(0, last.spilled - first.spilled)
        ttft = [max(0, b - a) for a, b in zip(first.ttft, last.ttft, strict=True)]
        return WindowLoad(
            requests_per_s=finished / span_s,
            error_rate=min(1.0, failed / finished) if finished else 0.0,
            ttft_p99_s=quantile(ttft, 0.99),
            span_s=t1 - t0,
            spilled_per_s=spilled / span_s,
        )
