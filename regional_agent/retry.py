"""Retry pacing for the agent's background loops: exponential backoff with jitter, and a
supervisor that restarts a loop an unexpected error stopped.

A fleet of agents that lost etcd together must not come back together: each wait is drawn
uniformly from the upper half of the current step (``base_s``, doubling up to ``max_s``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Backoff:
    """``delay_s = backoff.next_s()`` after each failure; ``backoff.reset()`` after a success."""

    def __init__(self, *, base_s: float, max_s: float, rng: random.Random) -> None:
        if base_s <= 0 or max_s < base_s:
            raise ValueError(f"need 0 < base_s <= max_s, got base_s={base_s} max_s={max_s}")
        self._base_s = base_s
        self._max_s = max_s
        self._rng = rng
        self._failures = 0

    @property
    def failures(self) -> int:
        """Failures since the last success."""
        return self._failures

    def next_s(self) -> float:
        step_s = min(self._max_s, self._base_s * 2 ** min(self._failures, 30))
        self._failures += 1
        return self._rng.uniform(step_s / 2, step_s)

    def reset(self) -> None:
        self._failures = 0


async def supervise(
    name: str, loop: Callable[[], Coroutine[Any, Any, None]], *, backoff: Backoff
) -> None:
    """Run ``loop()``; if it stops with an unexpected error, log it with its traceback and run
    it again after a backoff.  Loops handle the errors they expect themselves; this is the last
    line that keeps a bug in one loop from silently ending a duty of the agent."""
    while True:
        try:
            await loop()
            return
        except Exception:
            delay_s = backoff.next_s()
            log.exception("background loop failed loop=%s restart_in_s=%.1f", name, delay_s)
        await asyncio.sleep(delay_s)
