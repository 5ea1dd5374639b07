"""Admission to the region's central queue: priority classes, anti-starvation, a retry budget.

- **Priority classes**: ``high`` (0), ``normal`` (1, the default) and ``low`` (2), from the
  ``X-Priority`` header or the tenant's class.
- **Order**: waiting requests are served by effective priority, then first come first served.
  A request is promoted one class for every ``max_wait_low_s`` it has waited, so a low-priority
  request waits at most about ``2 * max_wait_low_s`` behind a steady stream of high-priority ones
  before it competes with them as an equal: nothing starves.
- **Depth**: past ``max_depth`` waiting requests for a model, a new request is refused (429)
  unless it outranks someone waiting: then the newest waiting request of the lowest class
  below it is shed (answered 429) and the newcomer takes its place (:func:`make_room`).  Under
  pressure the lowest class goes first; a burst of low-priority requests cannot push a
  high-priority one into 429.
- **Retry budget** (as in Finagle and gRPC): each request deposits ``ratio`` of a retry, each
  retry spends one, and ``min_per_s`` retries per second are always allowed, so retries cannot
  multiply the load of a region that is already failing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

PRIORITIES: Final = {"high": 0, "normal": 1, "low": 2}
DEFAULT_PRIORITY: Final = PRIORITIES["normal"]


class PriorityError(ValueError):
    """An ``X-Priority`` value or tenant class we do not know."""


def parse_priority(
    header: str | None, *, tenant: str | None = None, tenant_classes: Mapping[str, str]
) -> int:
    """The priority of a request: the header wins, then the tenant's class, then ``normal``."""
    if header is not None and header.strip():
        value = header.strip().lower()
        if value in PRIORITIES:
            return PRIORITIES[value]
        if value.isdigit() and int(value) in PRIORITIES.values():
            return int(value)
        known = ", ".join(f"{k} ({v})" for k, v in PRIORITIES.items())
        raise PriorityError(f"X-Priority must be one of {known}; got {header!r}")
    if tenant is not None and tenant in tenant_classes:
        cls = tenant_classes[tenant]
        if cls not in PRIORITIES:
            raise PriorityError(f"tenant {tenant!r} has unknown priority class {cls!r}")
        return PRIORITIES[cls]
    return DEFAULT_PRIORITY


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """A request in the queue, as ordering sees it."""

    seq: int  # arrival order, unique
    priority: int
    enqueued_s: float


def effective_priority(item: Waiting, *, now: float, max_wait_low_s: float) -> int:
    promoted = int(max(0.0, now - item.enqueued_s) // max_wait_low_s)
    return max(0, item.priority - promoted)


def order(waiting: Sequence[Waiting], *, now: float, max_wait_low_s: float) -> list[Waiting]:
    """Serving order: effective priority, then arrival."""
    return sorted(
        waiting,
        key=lambda w: (effective_priority(w, now=now, max_wait_low_s=max_wait_low_s), w.seq),
    )


def admit(depth: int, *, max_depth: int) -> bool:
    """May one more request wait behind ``depth`` others?"""
    return depth < max_depth


def make_room(
    waiting: Sequence[Waiting], *, priority: int, now: float, max_wait_low_s: float
) -> Waiting | None:
    """The request to shed so that a newcomer of ``priority`` may wait in a full queue: the
    newest of the lowest class strictly below the newcomer's, or ``None`` (refuse the
    newcomer) when nobody waiting ranks below it.

    Classes are compared as the queue orders them (:func:`effective_priority`): a low request
    promoted by its wait competes as an equal and is not shed for a newcomer it now equals."""
    victim: Waiting | None = None
    victim_key: tuple[int, int] | None = None
    for item in waiting:
        rank = effective_priority(item, now=now, max_wait_low_s=max_wait_low_s)
        if rank <= priority:
            continue
        key = (rank, item.seq)
        if victim_key is None or key > victim_key:
            victim, victim_key = item, key
    return victim


class RetryBudget:
    """Retries allowed: ``ratio`` per request plus ``min_per_s`` per second, capped."""

    def __init__(self, *, ratio: float, min_per_s: float, cap: float = 100.0) -> None:
        self._ratio = ratio
        self._min_per_s = min_per_s
        self._cap = cap
        self._tokens = min(cap, min_per_s)  # one second's worth from the start
        self._last_s: float | None = None

    def _refill(self, now: float) -> None:
        if self._last_s is not None and now > self._last_s:
            self._tokens = min(self._cap, self._tokens + (now - self._last_s) * self._min_per_s)
        if self._last_s is None or now > self._last_s:
            self._last_s = now

    def on_request(self, *, now: float) -> None:
        self._refill(now)
        self._tokens = min(self._cap, self._tokens + self._ratio)

    def try_spend(self, *, now: float) -> bool:
        self._refill(now)
        if self._tokens >= 1.0 - 1e-9:  # ten deposits of 0.1 make one retry
            self._tokens = max(0.0, self._tokens - 1.0)
            return True
        return False

    @property
    def available(self) -> float:
        return self._tokens
