"""Probing from outside: whether clients can reach a region, by the controller replicas' votes.

Agents say how their region is; they cannot say whether clients reach it.  A broken load
balancer, a firewall rule or a dead public address leaves every agent healthy and every client
failing.  So every controller replica probes each region's published endpoints (the shell,
``controlplane.probing``, makes a cheap OpenAI call to each) and stores its last round; the
leader tallies the rounds here:

* a replica *votes* on a region when it has a fresh round (at most ``max_age_s`` old) that
  probed at least one of the endpoints the region publishes now;
* it *reached* the region when any of those endpoints answered;
* the region is **unreachable** when more than half of the replicas that voted could not reach
  it.  No vote (probing off, no endpoints, every replica's round stale) judges nothing.

A majority of voters, not of all replicas, so one replica cut off from the world cannot fail a
region on its own when others can see it, and a replica that cannot probe does not count
against it.  With one replica its vote decides; place replicas in different regions so that
each looks from a different network (docs/controller.md, "Probing from outside").
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """One probe of one endpoint by one replica."""

    endpoint: str
    ok: bool
    error: str = ""  # why not ok, e.g. "timed out after 2 s"
    latency_ms: float | None = None  # connect + one request, on a fresh connection


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    """One replica's last probe round of one region."""

    replica: str
    at: float  # unix time the round ended (the replica's clock)
    probes: tuple[Probe, ...]
    vantage: str | None = None  # the region the replica runs in, when configured


@dataclass(frozen=True, slots=True, kw_only=True)
class Reach:
    """The replicas' votes on one region."""

    region: str
    reached: tuple[str, ...]  # replicas that reached at least one endpoint
    failed: tuple[str, ...]  # replicas that reached none
    errors: tuple[str, ...] = ()  # "<replica>: <endpoint> <error>" for each failed probe

    @property
    def voters(self) -> int:
        return len(self.reached) + len(self.failed)

    @property
    def unreachable(self) -> bool:
        """More than half of the replicas that voted could not reach the region."""
        return 2 * len(self.failed) > self.voters

    @property
    def reason(self) -> str:
        if not self.unreachable:
            return f"reached by {len(self.reached)} of {self.voters} controller replicas"
        shown = "; ".join(self.errors[:3]) + ("; ..." if len(self.errors) > 3 else "")
        return f"unreachable from {len(self.failed)} of {self.voters} controller replicas ({shown})"


def tally(
    region: str,
    rounds: Iterable[Round],
    *,
    endpoints: Collection[str],
    now: float,
    max_age_s: float,
) -> Reach | None:
    """The votes of ``rounds`` on ``region``, which publishes ``endpoints`` now; ``None`` when
    no replica votes.  A round older than ``max_age_s`` (or more than ``max_age_s`` in the
    future: a replica's clock ahead) does not vote, nor do its probes of endpoints the region
    no longer publishes."""
    if max_age_s <= 0:
        raise ValueError(f"max_age_s must be positive; got {max_age_s}")
    reached: list[str] = []
    failed: list[str] = []
    errors: list[str] = []
    for r in sorted(rounds, key=lambda r: r.replica):
        if abs(now - r.at) > max_age_s:
            continue
        current = [p for p in r.probes if p.endpoint in endpoints]
        if not current:
            continue
        if any(p.ok for p in current):
            reached.append(r.replica)
        else:
            failed.append(r.replica)
            errors.extend(f"{r.replica}: {p.endpoint} {p.error or 'failed'}" for p in current)
    if not reached and not failed:
        return None
    return Reach(region=region, reached=tuple(reached), failed=tuple(failed), errors=tuple(errors))


def round_trips(endpoint: str) -> int:
    """Round trips in a probe on a fresh connection: TCP's handshake and the request, plus
    TLS 1.3's handshake for https (a bare ``host:port`` is probed over https)."""
    return 2 if endpoint.strip().lower().startswith("http://") else 3


def measured_rtt_ms(
    rounds: Mapping[str, Iterable[Round]], *, now: float, max_age_s: float
) -> dict[tuple[str, str], float]:
    """The round trip between regions as the probes measured it: ``rounds`` per target region;
    for each (vantage, target), the median over the vantage's replicas of the fastest answered
    probe of the target's endpoints, divided by its round trips.  Only fresh rounds of replicas
    with a vantage count; a replica in the target region itself measures nothing useful (its
    own network) and is left out."""
    seen: dict[tuple[str, str], list[float]] = {}
    for target, target_rounds in rounds.items():
        for r in target_rounds:
            if r.vantage is None or r.vantage == target or abs(now - r.at) > max_age_s:
                continue
            times = [
                p.latency_ms / round_trips(p.endpoint)
                for p in r.probes
                if p.ok and p.latency_ms is not None
            ]
            if times:
                seen.setdefault((r.vantage, target), []).append(min(times))
    return {pair: round(statistics.median(ms), 3) for pair, ms in sorted(seen.items())}
