"""Faults injected into a simulated node at run time (``POST /admin/faults``).

=====================  =========================================================================
field                  effect
=====================  =========================================================================
latency_multiplier     every engine step takes this many times longer (> 0; 1 is normal)
error_rate             this fraction of new requests (0..1) is answered with ``error_status``
error_status           500, 503 or 429 (default 503)
hang                   the engine stops stepping: requests are accepted and never answered
drop_after_tokens      the connection is cut after this many tokens (0: before any byte);
                       ``null`` turns it off
fail_health            ``GET /health`` answers 503
exit                   the process exits (status 3) right after answering
=====================  =========================================================================

A POST sets the fields it names and keeps the others; ``DELETE /admin/faults`` clears all.  Which
requests the error rate hits is drawn from a generator seeded by ``--seed``, so a run repeats.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Final

_STATUSES: Final = (500, 503, 429)


class FaultError(ValueError):
    """A fault request with a bad field; the message names it."""


class Faults:
    def __init__(self, *, rng: random.Random) -> None:
        self._rng = rng
        self.clear()

    def clear(self) -> None:
        self.latency_multiplier = 1.0
        self.error_rate = 0.0
        self.error_status = 503
        self.hang = False
        self.drop_after_tokens: int | None = None
        self.fail_health = False
        self.exit = False

    def describe(self) -> dict[str, Any]:
        return {
            "latency_multiplier": self.latency_multiplier,
            "error_rate": self.error_rate,
            "error_status": self.error_status,
            "hang": self.hang,
            "drop_after_tokens": self.drop_after_tokens,
            "fail_health": self.fail_health,
            "exit": self.exit,
        }

    def update(self, body: Mapping[str, Any]) -> None:
        """Validate every field first, then apply them all (all or nothing)."""
        unknown = set(body) - set(self.describe())
        if unknown:
            known = ", ".join(self.describe())
            raise FaultError(f"unknown fault field(s) {sorted(unknown)}; known fields: {known}")
        new = self.describe()
        for key, value in body.items():
            new[key] = self._check(key, value)
        for key, value in new.items():
            setattr(self, key, value)

    @staticmethod
    def _check(key: str, value: object) -> object:
        if key in ("hang", "fail_health", "exit"):
            if not isinstance(value, bool):
                raise FaultError(f"{key} must be true or false, got {value!r}")
            return value
        if key == "latency_multiplier":
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise FaultError(f"latency_multiplier must be a number > 0, got {value!r}")
            return float(value)
        if key == "error_rate":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise FaultError(f"error_rate must be a number from 0 to 1, got {value!r}")
            return float(value)
        if key == "error_status":
            if value not in _STATUSES:
                raise FaultError(f"error_status must be one of {list(_STATUSES)}, got {value!r}")
            return value
        # drop_after_tokens
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FaultError(f"drop_after_tokens must be an integer >= 0 or null, got {value!r}")
        return value

    def injected_error(self) -> int | None:
        """The status to answer a new request with, or ``None`` to serve it."""
        if self.error_rate > 0 and self._rng.random() < self.error_rate:
            return self.error_status
        return None
