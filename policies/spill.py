"""Spill-over between regions: where a request the home region cannot serve well may go.

Pure: the agent's ``regional_agent.spill`` turns the controller's plan (``controller/plan``:
every region's last status, the DNS shares, what the probes could not reach, the measured
round trips) into :class:`Region` values and asks :func:`rank` for targets; the proxy forwards
to the first that answers.  Nothing here reads a clock or the network.

A region is a target for a request of model ``m`` that needs residency tags ``N`` when it

* is not the home region, nor one the caller excludes (already tried, or ejected by the
  agent's own outlier detection after failed forwards);
* serves ``m`` with capacity above 0 (a region that publishes no models serves none, as far as
  spill-over knows: a request is never sent where its model may be missing);
* meets every tag of ``N`` (its residency tags include them all): the home region's own tags
  and whatever the request adds.  Spill-over never loosens residency;
* is in service: it has a share of some geography's traffic in the plan (a failed or drained
  region has none), the probes reach it, its admin state is ``active``, it has a healthy node,
  an endpoint, and its status is no older than ``max_age_s``;
* is within the latency budget: its round trip from home (configured, else measured by the
  controller's probes, else unknown, which counts as the budget itself) is at most
  ``budget_ms``;
* is expected to start the request sooner than home would: the round trip plus its
  estimated queue wait (``queue_depth / requests_per_s``) is below ``home_wait_ms`` (infinite
  when home cannot take the request at all).

Targets come back best first, by round trip plus estimated wait (ties by name), each with the
reasons the others were ruled out, for the log and the response's headers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

UNKNOWN_WAIT_MS = 1_000.0  # a queue with requests but no measured rate: one second per request


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """What spill-over knows about one region, from the controller's plan."""

    name: str
    residency: frozenset[str]
    endpoints: tuple[str, ...]
    models: Mapping[str, float] | None  # model -> serving capacity; None: published none
    in_service: bool  # has a share of some geography's traffic in the plan
    reachable: bool = True  # not judged unreachable by the controller's probes
    admin: str = "active"
    nodes_healthy: int = 1
    queue_depth: int = 0
    requests_per_s: float = 0.0
    age_s: float = 0.0  # how old its status is

    def wait_ms(self) -> float:
        """The estimated wait in its queue before a new request starts, in ms."""
        if self.queue_depth <= 0:
            return 0.0
        if self.requests_per_s <= 0:
            return self.queue_depth * UNKNOWN_WAIT_MS
        return 1000.0 * self.queue_depth / self.requests_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    region: str
    endpoint: str
    latency_ms: float | None  # None: unknown (counted as the budget)
    score_ms: float  # round trip plus estimated wait: lower is better


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    targets: tuple[Target, ...]
    ruled_out: tuple[str, ...]  # "eu-central: lacks residency eu", one per region not chosen

    def why_none(self) -> str:
        return "; ".join(self.ruled_out) or "no other region is known"


def needs(home: Iterable[str], request: Iterable[str] = ()) -> frozenset[str]:
    """The residency tags a request needs: its home region's, and those the request adds."""
    return frozenset(home) | frozenset(request)


def rank(
    regions: Iterable[Region],
    *,
    home: str,
    model: str,
    needs: frozenset[str],
    latency_ms: Mapping[str, float],
    budget_ms: float,
    max_age_s: float,
    home_wait_ms: float = math.inf,
    exclude: frozenset[str] = frozenset(),
) -> Choice:
    """The regions a request may spill to, best first (see the module docstring)."""
    chosen: list[Target] = []
    ruled_out: list[str] = []
    for region in sorted(regions, key=lambda r: r.name):
        if region.name == home:
            continue
        why = _unfit(region, model=model, needs=needs, max_age_s=max_age_s, exclude=exclude)
        rtt = latency_ms.get(region.name)
        if why is None and (rtt if rtt is not None else budget_ms) > budget_ms:
            why = f"round trip {rtt:g} ms over the budget of {budget_ms:g} ms"
        wait = region.wait_ms()
        score = (rtt if rtt is not None else budget_ms) + wait
        if why is None and score >= home_wait_ms:
            why = (
                f"its queue ({region.queue_depth} waiting, ~{wait:.0f} ms) and the round trip "
                f"start it no sooner than here (~{home_wait_ms:.0f} ms)"
            )
        if why is not None:
            ruled_out.append(f"{region.name}: {why}")
            continue
        chosen.append(
            Target(region=region.name, endpoint=region.endpoints[0], latency_ms=rtt, score_ms=score)
        )
    chosen.sort(key=lambda t: (t.score_ms, t.region))
    return Choice(targets=tuple(chosen), ruled_out=tuple(ruled_out))


def _unfit(
    region: Region, *, model: str, needs: frozenset[str], max_age_s: float, exclude: frozenset[str]
) -> str | None:
    """Why ``region`` cannot take the request at all, or None."""
    if region.name in exclude:
        return "failed recently (ejected) or already tried"
    missing = needs - region.residency
    if missing:
        return f"lacks residency {', '.join(sorted(missing))}"
    if region.models is None:
        return "publishes no models"
    if region.models.get(model, 0.0) <= 0:
        return f"does not serve {model}"
    if not region.in_service:
        return "has no share of traffic (failed, drained or not yet serving)"
    if not region.reachable:
        return "the controller's probes cannot reach it"
    if region.admin != "active":
        return f"is {region.admin}"
    if region.nodes_healthy <= 0:
        return "has no healthy node"
    if not region.endpoints:
        return "publishes no endpoint"
    if region.age_s > max_age_s:
        return f"its status is {region.age_s:.0f} s old (over {max_age_s:g} s)"
    return None


__all__ = ["UNKNOWN_WAIT_MS", "Choice", "Region", "Target", "needs", "rank"]
