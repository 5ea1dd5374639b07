"""Rate limits per tenant: requests and tokens per minute over a sliding window.

- **The window.** :class:`Window` keeps what was taken in the last ``window_s`` (60 s) in
  buckets of ``bucket_s`` (1 s): at most ``window_s / bucket_s + 1`` integers per limit,
  whatever the rate.  A bucket counts as long as any part of it is inside the window, so the
  window seen is up to one bucket longer than ``window_s``: the check errs on the side of
  refusing (at most 1/60 early), never of admitting too much.
- **Admission.** An amount is taken only when it fits: ``used + amount <= limit``.  Every
  window of ``window_s`` contains only amounts that were checked against a window containing
  all of them, so **no window ever holds more than the limit** (Hypothesis-tested).  A refused
  request takes nothing.
- **Corrections.** Tokens are reserved at admission (``prompt_tokens + max_tokens``) and
  settled at the end with the real usage.  Less than reserved gives the difference back to the
  bucket it was taken from (nothing, if that bucket has left the window); more is charged now,
  but only up to the room left: a correction never takes the window past its limit, so the
  remaining count is always between 0 and the limit.
- **Replica shares.** :func:`share` splits a region's limit among its live agent replicas so
  that the shares sum to exactly the limit (never more).
- **Durations** for the ``x-ratelimit-reset-*`` headers in OpenAI's (Go's) format:
  :func:`duration` (``6s``, ``1m0s``, ``250ms``).

Pure: no clock is read; every call takes ``now`` (seconds of a monotonic clock).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

WINDOW_S: Final = 60.0  # "per minute"
BUCKET_S: Final = 1.0

Kind = Literal["requests", "tokens"]


class Window:
    """Amounts taken in the last ``window_s`` seconds, in buckets of ``bucket_s``.

    ``now`` never goes back: an earlier ``now`` than one already seen counts as that one."""

    def __init__(self, *, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S) -> None:
        if not (window_s > 0 and bucket_s > 0 and bucket_s <= window_s):
            raise ValueError("need window_s > 0 and 0 < bucket_s <= window_s")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[list[int]] = deque()  # [index, amount], ascending index
        self._total = 0
        self._now = -math.inf

    # -- reading ---------------------------------------------------------------------------

    def used(self, *, now: float) -> int:
        """What the window holds at ``now``."""
        self._advance(now)
        return self._total

    def remaining(self, *, limit: int, now: float) -> int:
        """Room left under ``limit``: from 0 to ``limit``."""
        return max(0, min(limit, limit - self.used(now=now)))

    def fits(self, amount: int, *, limit: int, now: float) -> bool:
        return self.used(now=now) + amount <= limit

    def free_in(self, amount: int, *, limit: int, now: float) -> float:
        """Seconds until ``amount`` fits under ``limit`` (0: now; ``inf``: never, it is more
        than the limit)."""
        if amount > limit:
            return math.inf
        used = self.used(now=now)
        if used + amount <= limit:
            return 0.0
        for index, taken in self._buckets:  # oldest first: they leave the window first
            used -= taken
            if used + amount <= limit:
                return max(0.0, self._expiry(index) - self._now)
        return max(0.0, self.empty_in(now=now))  # not reached: an empty window fits amount

    def empty_in(self, *, now: float) -> float:
        """Seconds until the window holds nothing (OpenAI's "resets to its initial state")."""
        self._advance(now)
        if not self._buckets:
            return 0.0
        return max(0.0, self._expiry(self._buckets[-1][0]) - self._now)

    # -- changing --------------------------------------------------------------------------

    def take(self, amount: int, *, now: float) -> int:
        """Count ``amount`` now (the caller checked :meth:`fits`); returns its bucket."""
        if amount < 0:
            raise ValueError("amount must be >= 0")
        self._advance(now)
        index = math.floor(self._now / self.bucket_s)
        if self._buckets and self._buckets[-1][0] == index:
            self._buckets[-1][1] += amount
        else:
            self._buckets.append([index, amount])
        self._total += amount
        return index

    def give_back(self, bucket: int, amount: int, *, now: float) -> int:
        """Take back up to ``amount`` of what was counted in ``bucket``; returns how much (0
        when the bucket has left the window)."""
        self._advance(now)
        for entry in reversed(self._buckets):  # newest first: settlements come soon after
            if entry[0] == bucket:
                back = max(0, min(amount, entry[1]))
                entry[1] -= back
                self._total -= back
                return back
        return 0

    def add(self, amount: int, *, limit: int, now: float) -> int:
        """Count up to ``amount`` more now, never past ``limit``; returns how much."""
        extra = max(0, min(amount, self.remaining(limit=limit, now=now)))
        if extra:
            self.take(extra, now=now)
        return extra

    # -- internals -------------------------------------------------------------------------

    def _expiry(self, index: int) -> float:
        """When bucket ``index`` leaves the window: its end plus the window."""
        return (index + 1) * self.bucket_s + self.window_s

    def _advance(self, now: float) -> None:
        self._now = max(self._now, now)
        while self._buckets and self._expiry(self._buckets[0][0]) <= self._now:
            _, taken = self._buckets.popleft()
            self._total -= taken


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """A tenant's limits per window (``None``: no limit of that kind)."""

    requests: int | None = None  # RPM
    tokens: int | None = None  # TPM

    def __post_init__(self) -> None:
        for name in ("requests", "tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} limit must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class State:
    """One limit as the ``x-ratelimit-*`` headers show it."""

    limit: int
    remaining: int  # 0..limit
    reset_s: float  # until the window holds nothing


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """What an admitted request reserved, to settle at its end."""

    tokens: int
    bucket: int | None  # the tokens window's bucket; None without a token limit


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    ticket: Ticket | None  # None: refused
    requests: State | None  # None: no request limit
    tokens: State | None  # None: no token limit
    exceeded: Kind | None = None  # the limit that refused (requests first)
    retry_after_s: float = 0.0  # until the refused request would fit (inf: never)
    needed: int = 0  # what the refused limit was asked for (1 request, or the tokens)

    @property
    def admitted(self) -> bool:
        return self.ticket is not None


class Limiter:
    """Requests and tokens of one tenant, each in its own :class:`Window`."""

    def __init__(self, *, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S) -> None:
        self.requests = Window(window_s=window_s, bucket_s=bucket_s)
        self.tokens = Window(window_s=window_s, bucket_s=bucket_s)

    def admit(self, *, tokens: int, limits: Limits, now: float) -> Verdict:
        """Take one request and ``tokens`` when both fit; else take nothing and say which
        limit refused and when the request would fit."""
        tokens = max(0, tokens)
        rpm, tpm = limits.requests, limits.tokens
        exceeded: Kind | None = None
        wait_s, needed = 0.0, 0
        if rpm is not None and not self.requests.fits(1, limit=rpm, now=now):
            exceeded, needed = "requests", 1
            wait_s = self.requests.free_in(1, limit=rpm, now=now)
        if tpm is not None and not self.tokens.fits(tokens, limit=tpm, now=now):
            token_wait = self.tokens.free_in(tokens, limit=tpm, now=now)
            if exceeded is None:
                exceeded, needed = "tokens", tokens
            wait_s = max(wait_s, token_wait)
        if exceeded is not None:
            return Verdict(
                ticket=None,
                requests=self._state(self.requests, rpm, now),
                tokens=self._state(self.tokens, tpm, now),
                exceeded=exceeded,
                retry_after_s=wait_s,
                needed=needed,
            )
        if rpm is not None:
            self.requests.take(1, now=now)
        bucket = self.tokens.take(tokens, now=now) if tpm is not None else None
        return Verdict(
            ticket=Ticket(tokens=tokens if tpm is not None else 0, bucket=bucket),
            requests=self._state(self.requests, rpm, now),
            tokens=self._state(self.tokens, tpm, now),
        )

    def settle(self, ticket: Ticket, *, used: int, limit: int | None, now: float) -> int:
        """Correct a reservation with the real usage; returns the tokens now counted for it."""
        if ticket.bucket is None:
            return 0
        used = max(0, used)
        if used <= ticket.tokens:
            back = self.tokens.give_back(ticket.bucket, ticket.tokens - used, now=now)
            return ticket.tokens - back
        if limit is None:  # the token limit went away meanwhile: nothing to guard
            return ticket.tokens
        return ticket.tokens + self.tokens.add(used - ticket.tokens, limit=limit, now=now)

    @staticmethod
    def _state(window: Window, limit: int | None, now: float) -> State | None:
        if limit is None:
            return None
        return State(
            limit=limit,
            remaining=window.remaining(limit=limit, now=now),
            reset_s=window.empty_in(now=now),
        )


def share(limit: int, *, replicas: int, rank: int) -> int:
    """Replica ``rank``'s (0-based, of ``replicas``) share of a region's ``limit``: the limit
    split evenly, the remainder one each to the first ranks, so the shares sum to ``limit``."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if not 0 <= rank < replicas:
        raise ValueError("rank must be in [0, replicas)")
    base, extra = divmod(max(0, limit), replicas)
    return base + (1 if rank < extra else 0)


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI's ``x-ratelimit-reset-*`` headers write it (Go's
    ``time.Duration``): ``0s``, ``250ms``, ``6s``, ``1.5s``, ``1m0s``, ``1h2m3s``."""
    if not math.isfinite(seconds) or seconds <= 0:
        return "0s"
    ms = math.ceil(seconds * 1000 - 1e-6)  # never promise a reset earlier than it is
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest // 1000}" + (f".{rest % 1000:03d}".rstrip("0") if rest % 1000 else "")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
