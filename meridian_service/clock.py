"""The clocks Meridian's shells inject, so that tests can drive time.

``Clock`` is what a component takes: anything with ``now() -> float`` seconds.  The agent runs on
:class:`MonotonicClock` (it only measures intervals on one host); the controller runs on
:class:`WallClock` (unix seconds), because replicas and agents compare the timestamps they write
into etcd.  Tests pass a clock they set by hand.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """Seconds from ``time.monotonic()``: never steps back, meaningless across hosts."""

    def now(self) -> float:
        return time.monotonic()


class WallClock:
    """Unix seconds from ``time.time()``: comparable across hosts, can step."""

    def now(self) -> float:
        return time.time()
