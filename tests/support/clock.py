"""A clock the test drives: ``now()`` is whatever the test last set ``t`` to."""

from __future__ import annotations


class ManualClock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t
