"""How many nodes a region should have: the reactive and predictive policies and their
combination with the controller's floor (docs/autoscaling.md).  Pure: the caller passes the
signals, ``now`` and the previous :class:`State`, and gets a :class:`Decision` and the next state.

* **Reactive** (the seed's production policy; asymmetric so that it cannot oscillate): scale up
  by ``scale_up_step`` of the serving nodes when KV-cache utilisation has stayed above
  ``scale_up_kv_util`` for ``scale_up_kv_for_s`` or the queue above ``scale_up_queue`` for
  ``scale_up_queue_for_s``; scale down by ``scale_down_step`` nodes only when utilisation has
  stayed below ``scale_down_kv_util`` *and* the queue below ``scale_down_queue`` for
  ``scale_down_for_s``, and then wait that long again before the next step.  While nodes it
  ordered are still provisioning it orders no more on utilisation (they are what utilisation
  asks for), only on a queue still above its threshold, and at most once per
  ``scale_up_cooldown_s``.  With nothing serving, any request waiting or arriving asks for one.
* **Predictive**: Holt's linear exponential smoothing of the arrival rate (a level and a trend,
  updated every sample), forecast ``horizon_s`` ahead (the provisioning delay plus one interval:
  what is ordered now serves then), sized with a node's measured capacity at
  ``target_utilisation``: ``ceil(max(level, forecast) / (capacity * target_utilisation))``.
* **Combined**: the larger of the floor, the reactive and the predictive demand, never above
  ``max_nodes``; down only when the reactive rule allows a step and neither the floor nor the
  forecast needs the node.

Nodes are counted, not weighted: ``serving`` are ready and routable, ``pending`` ordered and not
yet ready; the target is what serving plus pending should become.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Final, Literal

Mode = Literal["reactive", "predictive", "combined"]
MODES: Final[tuple[Mode, ...]] = ("reactive", "predictive", "combined")
Kind = Literal["up", "down", "hold"]

_MIN_SAMPLES: Final = 3  # a forecast needs a level and a trend that has moved at least once


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The policy's settings; the defaults are the seed's."""

    mode: Mode = "combined"
    min_nodes: int = 1
    max_nodes: int = 64
    scale_up_kv_util: float = 0.75
    scale_up_kv_for_s: float = 30.0
    scale_up_queue: int = 100
    scale_up_queue_for_s: float = 10.0
    scale_up_step: float = 0.25  # of the serving nodes, at least one node
    scale_up_cooldown_s: float = 60.0
    scale_down_kv_util: float = 0.40
    scale_down_queue: int = 10
    scale_down_for_s: float = 300.0
    scale_down_step: int = 1
    level_smoothing: float = 0.5  # Holt's alpha
    trend_smoothing: float = 0.3  # Holt's beta
    target_utilisation: float = 0.8  # of a node's measured capacity, for the forecast's demand

    def __post_init__(self) -> None:
        problems = config_problems(self)
        if problems:
            raise ValueError("; ".join(problems))


def config_problems(c: Config) -> list[str]:
    """What is wrong with ``c``, naming the fields (empty: nothing)."""
    out = []
    if c.mode not in MODES:
        out.append(f"mode must be one of {', '.join(MODES)}, got {c.mode!r}")
    if c.min_nodes < 0:
        out.append(f"min_nodes must be >= 0, got {c.min_nodes}")
    if c.max_nodes < max(1, c.min_nodes):
        out.append(f"max_nodes ({c.max_nodes}) must be >= 1 and >= min_nodes ({c.min_nodes})")
    if not c.scale_down_kv_util < c.scale_up_kv_util:
        out.append(
            f"scale_down_kv_util ({c.scale_down_kv_util:g}) must be below scale_up_kv_util "
            f"({c.scale_up_kv_util:g}), or load between them would scale both ways"
        )
    if not c.scale_down_queue < c.scale_up_queue:
        out.append(
            f"scale_down_queue ({c.scale_down_queue}) must be below scale_up_queue "
            f"({c.scale_up_queue}), or a queue between them would scale both ways"
        )
    for name in ("scale_up_kv_util", "scale_down_kv_util"):
        if not 0.0 <= getattr(c, name) <= 1.0:
            out.append(f"{name} must be within 0..1, got {getattr(c, name):g}")
    for name in ("scale_up_kv_for_s", "scale_up_queue_for_s", "scale_up_cooldown_s",
                 "scale_down_for_s"):  # fmt: skip
        if getattr(c, name) < 0:
            out.append(f"{name} must be >= 0, got {getattr(c, name):g}")
    if c.scale_up_step <= 0:
        out.append(f"scale_up_step must be > 0, got {c.scale_up_step:g}")
    if c.scale_down_step < 1:
        out.append(f"scale_down_step must be >= 1, got {c.scale_down_step}")
    for name in ("level_smoothing", "trend_smoothing", "target_utilisation"):
        if not 0.0 < getattr(c, name) <= 1.0:
            out.append(f"{name} must be within (0, 1], got {getattr(c, name):g}")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Signals:
    """The region now, as the autoscaler measured it."""

    now: float
    serving: int  # ready, routable nodes
    pending: int  # ordered, not yet ready
    kv_util: float | None  # mean KV-cache utilisation over the serving nodes (None: unknown)
    queue: int  # requests waiting: the agents' queues and the engines' waiting requests
    arrival_rps: float | None  # arrivals per second since the last sample (None: unknown)
    node_capacity_rps: float | None = None  # one node's measured capacity (None: unknown)
    floor_nodes: int = 0  # the controller's pre-warm floor, in nodes
    horizon_s: float = 0.0  # how far ahead an order made now serves: provisioning delay + tick


@dataclass(frozen=True, slots=True, kw_only=True)
class Forecast:
    """Holt's level (requests/s) and trend (requests/s per second)."""

    level: float
    trend: float
    at: float
    samples: int

    def ahead(self, horizon_s: float) -> float:
        return max(0.0, self.level + self.trend * horizon_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class State:
    """What the policy remembers between decisions (start with ``State()``)."""

    kv_high_since: float | None = None
    queue_high_since: float | None = None
    low_since: float | None = None
    last_up: float | None = None
    last_down: float | None = None
    forecast: Forecast | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    target: int  # what serving + pending should become
    kind: Kind
    reason: str
    reactive: int | None  # the reactive policy's demand, when it has one
    predictive: int | None  # the forecast's demand, when it has one


def update_forecast(
    forecast: Forecast | None, *, rate: float, now: float, alpha: float, beta: float
) -> Forecast:
    """Holt's linear smoothing, one sample of the arrival rate at ``now``."""
    if forecast is None:
        return Forecast(level=rate, trend=0.0, at=now, samples=1)
    dt = now - forecast.at
    if dt <= 0:
        return forecast
    predicted = forecast.level + forecast.trend * dt
    level = alpha * rate + (1 - alpha) * predicted
    trend = beta * (level - forecast.level) / dt + (1 - beta) * forecast.trend
    return Forecast(level=level, trend=trend, at=now, samples=forecast.samples + 1)


def _since(condition: bool, since: float | None, now: float) -> float | None:
    if not condition:
        return None
    return now if since is None else since


def decide(config: Config, state: State, signals: Signals) -> tuple[Decision, State]:
    """The target node count now, and the state to pass next time."""
    c, s, now = config, signals, signals.now
    supply = s.serving + s.pending
    kv = s.kv_util
    kv_high_since = _since(kv is not None and kv > c.scale_up_kv_util, state.kv_high_since, now)
    queue_high_since = _since(s.queue > c.scale_up_queue, state.queue_high_since, now)
    forecast = state.forecast
    if s.arrival_rps is not None:
        forecast = update_forecast(
            forecast, rate=s.arrival_rps, now=now, alpha=c.level_smoothing, beta=c.trend_smoothing
        )

    # the predictive demand: the forecast at the horizon, at the target utilisation
    predictive: int | None = None
    expected = 0.0
    if (
        c.mode != "reactive"
        and forecast is not None
        and forecast.samples >= _MIN_SAMPLES
        and s.node_capacity_rps is not None
        and s.node_capacity_rps > 0
    ):
        expected = max(forecast.level, forecast.ahead(s.horizon_s))
        predictive = math.ceil(expected / (s.node_capacity_rps * c.target_utilisation) - 1e-9)

    # low: what a step down waits for, held for scale_down_for_s
    if c.mode == "predictive":
        low = predictive is not None and predictive < supply
    else:
        # no measure of the serving nodes' cache (scrapes failing) is not a quiet region
        known = kv is not None or s.serving == 0
        low = known and (kv is None or kv < c.scale_down_kv_util) and s.queue < c.scale_down_queue
    low_since = _since(low, state.low_since, now)
    state = State(
        kv_high_since=kv_high_since,
        queue_high_since=queue_high_since,
        low_since=low_since,
        last_up=state.last_up,
        last_down=state.last_down,
        forecast=forecast,
    )

    # the reactive demand: a step above what there is, when a rule has held long enough
    reactive: int | None = None
    reactive_why = ""
    if c.mode != "predictive":
        kv_rule = kv_high_since is not None and now - kv_high_since >= c.scale_up_kv_for_s
        queue_rule = (
            queue_high_since is not None and now - queue_high_since >= c.scale_up_queue_for_s
        )
        cooled = state.last_up is None or now - state.last_up >= c.scale_up_cooldown_s
        # what is on its way is what utilisation asked for; only a queue still over its
        # threshold after the cooldown orders more before it lands
        if supply == 0 and (s.queue > 0 or (s.arrival_rps or 0.0) > 0):
            # nothing serves and requests come: no utilisation to wait for
            reactive = 1
            reactive_why = f"no node, and {s.queue} waiting"
        elif cooled and ((kv_rule and s.pending == 0) or queue_rule):
            step = max(1, math.ceil(c.scale_up_step * s.serving))
            reactive = supply + step
            if queue_rule and queue_high_since is not None:
                reactive_why = (
                    f"queue {s.queue} above {c.scale_up_queue} for {now - queue_high_since:.0f} s"
                )
            elif kv is not None and kv_high_since is not None:
                reactive_why = (
                    f"KV utilisation {kv:.0%} above {c.scale_up_kv_util:.0%} for "
                    f"{now - kv_high_since:.0f} s"
                )

    lowest = min(c.max_nodes, max(c.min_nodes, s.floor_nodes))
    want = max(lowest, reactive or 0, predictive or 0)
    want = min(want, c.max_nodes)

    if supply > c.max_nodes:
        return _down(c.max_nodes, f"{supply} nodes above the maximum {c.max_nodes}",
                     state, now, reactive, predictive)  # fmt: skip
    if want > supply:
        parts = []
        if s.floor_nodes > supply and want == lowest:
            parts.append(f"floor {s.floor_nodes} node(s)")
        if reactive is not None and reactive >= want:
            parts.append(reactive_why)
        if predictive is not None and predictive >= want:
            parts.append(
                f"forecast {expected:.1f} req/s in {s.horizon_s:.0f} s needs {predictive} node(s)"
            )
        if lowest >= want and not parts:
            parts.append(f"minimum {c.min_nodes} node(s)")
        return (
            Decision(
                target=want,
                kind="up",
                reason=f"{supply} -> {want} node(s): " + "; ".join(parts),
                reactive=reactive,
                predictive=predictive,
            ),
            dataclasses.replace(state, last_up=now, kv_high_since=None, queue_high_since=None),
        )

    # down: never faster than scale_down_for_s, never below what the floor or the forecast
    # need, and never to where what is left would scale straight back up
    keep = max(lowest, predictive or 0)
    since_down = now - state.last_down if state.last_down is not None else math.inf
    if (
        low_since is not None
        and now - low_since >= c.scale_down_for_s
        and since_down >= c.scale_down_for_s
        and supply > keep
    ):
        target = max(keep, supply - c.scale_down_step)
        left = s.serving - (supply - target - min(s.pending, supply - target))
        if c.mode == "predictive":
            why = f"forecast {expected:.1f} req/s needs {predictive} node(s)"
            return _down(target, why, state, now, reactive, predictive)
        if left <= 0:  # the last serving node: only when nothing at all is asked of it
            allowed = s.serving == 0 or (kv == 0 and s.queue == 0)
        else:
            allowed = kv is None or kv * s.serving / left < c.scale_up_kv_util
        if allowed:
            why = (
                f"KV utilisation below {c.scale_down_kv_util:.0%} and queue below "
                f"{c.scale_down_queue} for {now - low_since:.0f} s"
            )
            return _down(target, why, state, now, reactive, predictive)
    return (
        Decision(
            target=supply,
            kind="hold",
            reason=f"{supply} node(s) meet the demand",
            reactive=reactive,
            predictive=predictive,
        ),
        state,
    )


def _down(
    target: int,
    why: str,
    state: State,
    now: float,
    reactive: int | None,
    predictive: int | None,
) -> tuple[Decision, State]:
    return (
        Decision(
            target=target,
            kind="down",
            reason=f"-> {target} node(s): {why}",
            reactive=reactive,
            predictive=predictive,
        ),
        # the next step down waits a whole delay again
        dataclasses.replace(state, last_down=now, low_since=now),
    )
