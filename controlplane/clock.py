"""The controller's clock: wall-clock (unix) seconds, injected so tests can drive time.

Unix time, not monotonic: replicas and agents compare timestamps they wrote into etcd.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    def now(self) -> float:
        return time.time()
