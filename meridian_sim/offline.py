"""Drive one engine through a list of arrivals in virtual time: no sockets, no sleeping.

This is how load curves of a single node are measured (``benchmarks/node_load_curve.py``) and
how tests check that the engine behaves as its profile predicts.  Arrivals are processed in
time order; between arrivals the engine steps, each step starting where the last one ended, and
an idle engine jumps to the next arrival.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from meridian_sim.engine import Engine, RequestRecord
from meridian_sim.profile import Profile


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    time_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Replay:
    records: tuple[RequestRecord, ...]
    num_steps: int
    num_preemptions: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    peak_kv_usage: float
    peak_waiting: int
    end_s: float


def replay(
    profile: Profile, arrivals: Sequence[Arrival], *, seed: int = 0, max_steps: int = 5_000_000
) -> Replay:
    engine = Engine(profile, rng=random.Random(seed))
    pending = sorted(arrivals, key=lambda a: a.time_s)
    records: list[RequestRecord] = []
    now = 0.0
    i = 0
    steps = 0
    peak_kv = 0.0
    peak_waiting = 0
    overhead_s = profile.timing.request_overhead_ms / 1000.0  # arrival -> engine queue
    while i < len(pending) or engine.has_unfinished:
        while i < len(pending) and pending[i].time_s + overhead_s <= now:
            a = pending[i]
            engine.add(
                f"r{i}",
                a.prompt_token_ids,
                max_tokens=a.max_tokens,
                ignore_eos=a.ignore_eos,
                now=a.time_s + overhead_s,
                arrival_s=a.time_s,
            )
            i += 1
        if not engine.has_unfinished:
            now = pending[i].time_s + overhead_s
            continue
        result = engine.step(now=now)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"replay did not finish within {max_steps} steps")
        now += result.duration_s
        records.extend(result.finished)
        peak_kv = max(peak_kv, engine.kv_usage)
        peak_waiting = max(peak_waiting, engine.num_waiting)
    return Replay(
        records=tuple(records),
        num_steps=steps,
        num_preemptions=engine.stats.num_preemptions,
        prefix_cache_hits=engine.stats.prefix_cache_hits,
        prefix_cache_queries=engine.stats.prefix_cache_queries,
        peak_kv_usage=peak_kv,
        peak_waiting=peak_waiting,
        end_s=now,
    )


def poisson_arrivals(
    *,
    rate_per_s: float,
    duration_s: float,
    prompt_tokens: int,
    output_tokens: int,
    rng: random.Random,
    shared_prefix_tokens: int = 0,
) -> list[Arrival]:
    """Poisson arrivals of fixed-length requests; the first ``shared_prefix_tokens`` are equal."""
    out: list[Arrival] = []
    t = rng.expovariate(rate_per_s)
    prefix = tuple(range(1, shared_prefix_tokens + 1))
    n = 0
    while t < duration_s:
        unique = tuple(
            1_000_000 + n * prompt_tokens + j for j in range(prompt_tokens - len(prefix))
        )
        out.append(Arrival(time_s=t, prompt_token_ids=prefix + unique, max_tokens=output_tokens))
        n += 1
        t += rng.expovariate(rate_per_s)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; ``nan`` for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
